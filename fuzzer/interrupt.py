"""SIGINT and SIGTERM at any moment of a command, start-up included: the first one ends the command as interrupted
(exit 3, fuzzer/errors.py), every output saying so; a second one kills at once (the default action).

`fuzzer/cli.py` installs the handler first thing, before the commands (and torch, Hypothesis, vLLM) are imported.
The first signal is recorded (`received()`) and the default action restored for the next one. Whether it also
raises `Interrupted` where the main thread is depends on the section the command is in:

- `raising()`: it does (the command is importing vLLM or starting a worker, with nothing to lose);
- `deferred()`: it does not; the code polls `received()` (a campaign winds down, a gate stops its campaigns and
  writes what it has, outputs are written whole).

A campaign installs its own handler while it searches (fuzzer/search/campaign.py) and `note()`s the signal here,
so that a later one still kills.

A handler runs wherever the main thread is. Raised inside `subprocess.Popen` (the child forked, its Popen not yet
made) the exception would leave a child nobody can end; raised in an at-fork hook, a `__del__` or a weakref callback
Python prints it and drops it. There it is raised again a moment later (SIGALRM), at the next place it can be.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import contextmanager

from fuzzer.errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)
RETRY_S = 0.05  # how soon an Interrupted that could not be raised where the signal came is raised again

_received: str | None = None  # the first signal's name
_raising = False
_hook = sys.unraisablehook


def _handler(signum, frame) -> None:
    if _received is not None:  # a second signal (a handler restored after the first): the default action, now
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    note(signum)
    _raise(frame)


def _raise(frame) -> None:
    if not _raising or _received is None:
        return
    if _starting_a_process(frame):
        signal.setitimer(signal.ITIMER_REAL, RETRY_S)
        return
    raise Interrupted(_received)


def _starting_a_process(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename == subprocess.__file__ and frame.f_code.co_name in ("__init__", "_execute_child"):
            return True
        frame = frame.f_back
    return False


def _unraisable(info) -> None:
    if isinstance(info.exc_value, Interrupted):  # dropped by Python (an at-fork hook, a __del__): again, elsewhere
        if _raising:
            signal.setitimer(signal.ITIMER_REAL, RETRY_S)
        return
    _hook(info)


def install() -> None:
    """From now on the first SIGINT or SIGTERM is recorded (in the main thread only: elsewhere, nothing)."""
    try:
        for s in SIGNALS:
            signal.signal(s, _handler)
        signal.signal(signal.SIGALRM, lambda signum, frame: _raise(frame))
    except ValueError:  # not the main thread (a command run from a test's thread): signals keep their handlers
        return
    sys.unraisablehook = _unraisable


def note(signum: int) -> None:
    """A first signal (this module's handler or a campaign's): recorded, and the next one kills."""
    global _received
    if _received is None:
        _received = signal.Signals(signum).name
    for s in SIGNALS:
        try:
            signal.signal(s, signal.SIG_DFL)
        except ValueError:
            pass


def received() -> str | None:
    """The name of the first signal received (SIGINT, SIGTERM), or None."""
    return _received


def check() -> None:
    """Raise `Interrupted` if a signal came."""
    if _received is not None:
        raise Interrupted(_received)


@contextmanager
def raising():
    """A signal raises `Interrupted` here (one that came already: `check()`)."""
    global _raising
    before, _raising = _raising, True
    try:
        yield
    finally:
        _raising = before


def defer() -> None:
    """From here to the end of the `raising()` section around it, a signal is only recorded (and a retry still
    pending raises nothing)."""
    global _raising
    _raising = False
    try:
        signal.setitimer(signal.ITIMER_REAL, 0)
    except ValueError:  # not the main thread
        pass


def settle(caught: str | None) -> str | None:
    """Where a command's interruptible part ends (`caught`: the signal its `Interrupted` named, if one came): signals
    are deferred from here, so its outputs are written whole and a second signal kills; returns the signal that
    stopped it, caught or received since, or None."""
    defer()
    return caught or received()


@contextmanager
def deferred():
    """A signal is only recorded here: the code polls `received()`."""
    global _raising
    before, _raising = _raising, False
    try:
        yield
    finally:
        _raising = before


def reset() -> None:
    """Forget a signal (tests that signal their own process)."""
    global _received, _raising
    _received, _raising = None, False
