"""Exit codes and the exceptions every layer raises; a leaf module, imported from anywhere.

0 tested and clean (at least one case ran, nothing found, not cut short), 1 findings, 2 could not test (usage,
environment, harness; a reproducer that could not run its call), 3 interrupted before it finished, nothing
found so far. Each command maps what it caught to one of them in one place (`fuzzer/cli.py`).

Every exception class of attnfuzz is defined here, but for two families that cannot import this module:
`strategies/errors.py` (CaseError: strategies sit on floor 1, below this module, and import nothing of fuzzer/;
re-exported here) and `fuzzer/support/errors.py` (the stand-ins' and support code's errors: reproducers ship
fuzzer/support/ without the rest of attnfuzz). A harness fault is a HarnessError subclass, raised where it happens
and told apart by its type, never by its message (tests/test_errors.py checks both)."""

from __future__ import annotations

from enum import IntEnum

from strategies.errors import CaseError  # noqa: F401 (re-exported: one place to import every error from)


def first_line(e: BaseException) -> str:
    """The first line of an exception's message ("" for an empty one): what a one-line report of it shows."""
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


class ExitCode(IntEnum):
    CLEAN = 0
    FOUND = 1
    USAGE = 2
    INTERRUPTED = 3


class UsageError(Exception):
    """Bad arguments or an environment that cannot test: exit 2, with this one-line message."""


class RecordError(UsageError):
    """A malformed on-disk record (finding.json, a run summary, campaign.json): names the file and field."""


class MutantError(RuntimeError):
    """`--inject` cannot be applied: neither a built-in mutant nor a file, or the file raised (fuzzer/mutants)."""


class GateError(ValueError):
    """A malformed reproducer record or argument of `gate` or `selftest`: exit 2, naming the file and field."""


class SanitizerUnavailable(RuntimeError):
    """compute-sanitizer, cuda-python or a CUDA device is missing here (fuzzer/run/compute_sanitizer.py)."""


# -- harness faults: attnfuzz's own failures, never findings ------------------------------------------------------

class HarnessError(RuntimeError):
    """attnfuzz itself failed (not the code under test): the campaign stops with exit code 2."""


class HarnessFailure(HarnessError):
    """attnfuzz's own code raised inside a worker process (its traceback is the message)."""


class HarnessConfigError(HarnessError):
    """attnfuzz built vLLM's inputs incompletely for this release: a harness bug, never a finding."""


class VllmCallMoved(HarnessError):
    """A call attnfuzz makes into vLLM does not fit the installed release: a name it looks up, a keyword it passes
    or the shape of what it takes apart moved (told by fuzzer/targets/vllm_api.py `moved_call`). Could not test,
    naming the call: never a finding, never clean."""


class DeviceQueryUnanswered(VllmCallMoved):
    """On a CPU host, vLLM asked torch for a device (`torch.accelerator`, `torch.cuda`) where attnfuzz has no CPU
    answer for the query (told by fuzzer/targets/vllm_api.py `unanswerable_device_query`): a release asking
    something new of the device, as a moved call is one: could not test, naming the query and vLLM's line."""


class StandInUnmodelled(HarnessError):
    """A stand-in refused a call form it does not model (fuzzer/support/errors.py StandInRefused): the case could
    not be tested here (exit 2), which says nothing about the code under test."""


class WorkerError(RuntimeError):
    """A worker process could not be started or could not import what it needs: exit 2."""


class WorkerUnavailable(WorkerError):
    """The worker's target cannot run on this host or vLLM release (its `unavailable()`, asked in the worker)."""

    def __init__(self, target: str, why: str):
        super().__init__(f"worker for {target}: unavailable: {why}")
        self.target, self.why = target, why


class WorkerInjectError(WorkerError):
    """The worker could not apply `--inject` (a MutantError there): the user's to fix, in the MutantError's words."""

    def __init__(self, target: str, message: str):
        super().__init__(f"worker for {target}: mutant: {message}")
        self.target, self.message = target, message


# -- what targets raise about vLLM and the code under test ----------------------------------------------------------

class TargetUnavailable(RuntimeError):
    """This vLLM release lacks what a target drives (fuzzer/targets/vllm_api.py): the target is unavailable."""


class RankError(RuntimeError):
    """One or more ranks of a multi-process target raised (each rank's error is named). `device_lost`: a rank's
    error was one that loses the CUDA context (told by its type, on that rank), so the worker must be replaced."""

    def __init__(self, message: str, device_lost: bool = False):
        super().__init__(message)
        self.device_lost = device_lost


class CollectivesBroken(RuntimeError):
    """vLLM's DCP group's collectives returned wrong values on known inputs, before any case ran."""


# -- attnfuzz inside a user's test suite (fuzzer/api.py, fuzzer/pytest_plugin.py) -----------------------------------

class CouldNotTest(UsageError):
    """A library check or a pytest item could not test: the target cannot run on this host or vLLM release, or its
    campaign could not run (exit 2, a time-out). The test fails with this reason; it never passes."""


class FindingFailed(AssertionError):
    """A library check's case failed its oracle: the finding, and where its reproducer was saved (None while
    Hypothesis is still shrinking: the reproducer is saved for the final, shrunk case). Subclassed once per signature
    (fuzzer/api.py), so that Hypothesis shrinks each bug on its own."""

    def __init__(self, message: str, finding=None, path=None):
        super().__init__(message)
        self.finding, self.path = finding, path


class EmulatedWarning(UserWarning):
    """A library check ran on attnfuzz's stand-ins for compiled ops this host lacks: said once per target and set of
    ops, as every result of attnfuzz says it."""


# -- the search's own signals --------------------------------------------------------------------------------------

class CaseFailed(Exception):
    """Raised inside the Hypothesis test for a failing case; subclassed once per signature (fuzzer/search)."""


class StopSearch(BaseException):
    """Raised from a case to end the Hypothesis run at once (not an Exception: Hypothesis lets it through)."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM cut the command short (fuzzer/interrupt.py): exit 3. A BaseException, so that no
    `except Exception` on its way (an import's, a target's) takes it for an error."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal = signal_name
