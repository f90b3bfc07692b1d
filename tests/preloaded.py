"""A Python process that has imported vLLM (and with it torch and Triton) and forks a child for each command it is
sent: the tests' attnfuzz commands and one-off probes each get a process of their own (mutants patch vLLM
process-wide) without paying vLLM's import (6-8 s on the 2-core CI machine) and the interpreter's tear-down (1-2 s)
each time.

The server imports PRELOAD, in the environment conftest prepared for the CPU as `fuzzer.env.prepare_process`
prepares a campaign's process, and nothing else: attnfuzz's own modules, Hypothesis and vLLM's backends are imported
by each child, in the order its command imports them. A child runs its command as `python -m MODULE ...`,
`python -c CODE ...` or `python SCRIPT ...` would (argv, sys.path[0], cwd, environment, stdin, stdout, stderr,
exit status, uncaught exceptions, non-daemon threads, atexit handlers), then leaves with os._exit.

What must see a fresh interpreter does not come here (conftest's `fresh=True`): a command whose test is about the
start-up itself (what it refuses before vLLM loads, `--device cuda` on a CPU host, a release module hidden from the
import), a process the test signals or leaves running, and one saved reproducer end to end (test_run's seed bug:
`python repro.py` as a user runs it; the gate runs each of repros/ that way too). Other reproducers come here: a
CPU reproducer's first lines set the environment this server already has before vLLM loads, and what a reproducer
imports is tests/fuzzer/artifacts/test_repro.py's.

Protocol (one command at a time): a JSON request per line on the server's stdin; the server answers with a line
{"pid": N} once the child runs, then {"status": S} (os.waitstatus_to_exitcode) when it has ended.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# `import vllm`, then the module every target's release detection imports first (fuzzer.targets.vllm_api), which
# brings vllm.config and the attention-backend utilities: 6-8 s of the 7-9 s a campaign's start-up took on the
# 2-core CI machine. Nothing of attnfuzz patches or stands in for these two on import (its stand-ins and mutants
# are bound into modules already imported; the one import attnfuzz interposes on, FLASH_ATTN_MLA_SPARSE's module,
# is left to the child).
PRELOAD = ("vllm", "vllm.v1.attention.backends.mla.sparse_utils")


# -- the server -------------------------------------------------------------------------------------------------

def _child(req: dict) -> None:
    """Run one command in this forked process; never returns."""
    code = 1
    try:
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        for fd, (path, flags) in enumerate(((req["stdin"], os.O_RDONLY),
                                            (req["stdout"], os.O_WRONLY | os.O_TRUNC),
                                            (req["stderr"], os.O_WRONLY | os.O_TRUNC))):
            new = os.open(path, flags)
            os.dup2(new, fd)
            os.close(new)
        argv = req["argv"]
        import runpy
        import types

        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file in argv[0], as `python -m` does
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(argv[1], alter_argv=True)
        else:
            main = types.ModuleType("__main__")
            main.__builtins__ = __builtins__
            sys.modules["__main__"] = main
            if argv[0] == "-c":
                sys.argv = ["-c", *argv[2:]]
                sys.path[0] = ""
                exec(compile(argv[1], "<string>", "exec"), main.__dict__)
            else:
                sys.argv = list(argv)
                sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
                main.__file__ = argv[0]
                exec(compile(Path(argv[0]).read_text(), argv[0], "exec"), main.__dict__)
        code = 0
    except SystemExit as e:  # as the interpreter reads it
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:
        tb = e.__traceback__.tb_next  # from the command's first frame, as the interpreter prints it
        sys.excepthook(type(e), e, tb)
        code = 1
    try:  # what the interpreter does before it tears down: wait for non-daemon threads, run atexit handlers
        threading._shutdown()
        import atexit

        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code & 0xFF)


def serve() -> None:
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(2, 1)  # what an import prints goes to the server's stderr, never into the protocol
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    print(json.dumps({"ready": sorted(PRELOAD)}), file=replies, flush=True)
    for line in requests:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            _child(req)
        print(json.dumps({"pid": pid}), file=replies, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), file=replies, flush=True)


# -- the client -------------------------------------------------------------------------------------------------

class Preloaded:
    """The server, started on first use in this (test) process; `run` is a drop-in for
    subprocess.run(cmd, cwd=..., env=..., input=..., capture_output=True, text=True, timeout=...)."""

    def __init__(self, env: dict[str, str]):
        self.env = env  # the server's: what the test process had before any test changed it
        self.proc: subprocess.Popen | None = None
        self.unavailable: str | None = None  # why the server cannot start here (no vLLM): commands run fresh
        self.lock = threading.Lock()

    def _start(self) -> None:
        log = Path(self.env.get("ATTNFUZZ_STATE", tempfile.gettempdir())) / f"preloaded-{os.getpid()}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as err:  # what vLLM's import prints, and the server's own traceback if it dies
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.preloaded"], cwd=Path(__file__).parent.parent,
                                         env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         text=True, bufsize=1)
        self.buffer = b""
        try:
            ready = self._read(600)
        except RuntimeError:
            ready = None
        if ready is None or "ready" not in ready:
            self.close()
            raise RuntimeError(f"the preloaded interpreter did not start (exit {self.proc.poll()})")

    def _read(self, timeout: float | None) -> dict | None:
        """The server's next reply, or None after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and (left <= 0 or not select.select([fd], [], [], left)[0]):
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError("the preloaded interpreter ended")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def run(self, cmd: list[str], *, cwd, env=None, input: str | None = None,
            timeout: float | None = None) -> subprocess.CompletedProcess:
        assert cmd[0] == sys.executable, cmd
        with self.lock:
            if not self.unavailable and (self.proc is None or self.proc.poll() is not None):
                try:
                    self._start()
                except RuntimeError as e:
                    self.unavailable = str(e)
            if self.unavailable:
                return subprocess.run(cmd, cwd=cwd, env=env, input=input, capture_output=True, text=True,
                                      timeout=timeout)
            return self._run(cmd, cwd, env, input, timeout)

    def _run(self, cmd, cwd, env, input, timeout) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="preloaded-") as tmp:
            files = {name: Path(tmp) / name for name in ("stdin", "stdout", "stderr")}
            for path in files.values():
                path.write_text("")
            if input is not None:
                files["stdin"].write_text(input)
            self.proc.stdin.write(json.dumps({"argv": [str(a) for a in cmd[1:]], "cwd": str(cwd),
                                              "env": dict(os.environ if env is None else env),
                                              **{k: str(p) for k, p in files.items()}}) + "\n")
            self.proc.stdin.flush()
            pid = self._read(60)["pid"]
            reply = self._read(timeout)
            if reply is None:  # as subprocess.run: kill it, then raise
                os.kill(pid, signal.SIGKILL)
                self._read(None)
            out, err = (files[k].read_text() for k in ("stdout", "stderr"))
            if reply is None:
                raise subprocess.TimeoutExpired(cmd, timeout, out, err)
            return subprocess.CompletedProcess(cmd, reply["status"], out, err)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":
    serve()
