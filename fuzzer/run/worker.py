"""Targets run in worker processes, so that what the code under test does to its process (an illegal memory
access that kills the CUDA context, a segfault, an abort, a hang, running out of memory) never ends the
campaign or takes a finding with it.

A worker imports vLLM once, prepares one target (and the injected bug, if any) and then checks cases sent
over a socket: it runs the target and the oracle and sends back the observation (tensors stay in the worker)
and the verdicts. The campaign side (`WorkerExecutor`; the campaign journals each case before it runs) waits
with a per-case watchdog, turns a dead or silent worker into a verdict on that case, and starts a fresh
worker for the next one. Under compute-sanitizer the worker's output is its log: the worker prints a marker
before and after each case and synchronizes the device around it, so every report belongs to one case.

    python -m fuzzer.run.worker FD SPEC_JSON      (started by WorkerExecutor, never by hand)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections import deque
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from fuzzer.env import die_with_parent, prepare_process
from fuzzer.errors import (HarnessFailure, MutantError, VllmCallMoved, WorkerError, WorkerInjectError,
                           WorkerUnavailable, first_line)
from fuzzer.mutants import inject
from fuzzer.observation import Observation
from fuzzer.run.compute_sanitizer import dedupe, limit_reached, parse_log, sanitized_env, sanitizer_command
from fuzzer.targets.base import as_moved, lost_device, out_of_device_memory
from fuzzer.targets.registry import TARGETS
from fuzzer.targets.vllm_api import import_vllm
from oracles.verdict import Verdict
from strategies.case import Case

BEGIN, END = "ATTNFUZZ-CASE-BEGIN", "ATTNFUZZ-CASE-END"
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class WorkerSpec:
    target: str
    device: str
    inject: str | None = None
    sanitizer: str | None = None  # a compute-sanitizer tool, or None for a native worker
    case_timeout: float = 300.0  # the watchdog's floor: seconds for one case before the worker counts as hung
    startup_timeout: float = 900.0  # vLLM import, target set-up and (sanitized) tool start
    # Cases before a worker is replaced by a fresh one (0: never). A sanitized worker's device memory grows while
    # PyTorch holds nothing between cases (initcheck workers run out of it after some hundreds of cases): a fresh
    # process frees whatever the tool or the CUDA context held.
    recycle_after: int = 0
    # ...or sooner, once the device's free memory has fallen below this fraction of what was free when the worker
    # started (0: never): the growth per case depends on the cases and the device (an H100's 80 GB ran out after
    # ~120 fp8_ds_mla cases under initcheck), a fraction of the worker's start does not.
    recycle_below_free: float = 0.0


SANITIZED_RECYCLE_AFTER = 150  # cases per sanitized worker; each fresh one restarts the tool and imports vLLM
SANITIZED_RECYCLE_BELOW_FREE = 0.5  # a fresh sanitized worker once half of the memory free at its start is gone
SANITIZED_RECYCLING = {"recycle_after": SANITIZED_RECYCLE_AFTER, "recycle_below_free": SANITIZED_RECYCLE_BELOW_FREE}
MEMORY_EVERY = 25  # cases between the device-memory lines a CUDA worker logs (a leak shows as a trend)
MEMORY = "ATTNFUZZ-DEVICE-MEMORY"
# The watchdog's deadline learns from the cases' own times: HANG_FACTOR times the slowest of the last RECENT_CASES
# (the spec's case_timeout the floor), so a target of slow cases does not turn working cases into hangs. A case
# past it runs again on a fresh worker with HANG_CONFIRM times that deadline; only a case that hangs there too is
# a hang. A case's own time is the wall clock's less what the worker waited for a CPU while it could run (Linux
# schedstat), so a loaded host's queue is not counted against the case; at most STARVED_CAP times the deadline
# passes on the wall clock.
HANG_FACTOR = 10
RECENT_CASES = 50
HANG_CONFIRM = 4
STARVED_CAP = 10


# -- the worker process ---------------------------------------------------------------------------------------

def _device_lost(obs: Observation) -> bool:
    """The case lost the CUDA context: `Target.observe` told it by the exception's type (or a failed synchronize)."""
    return bool(obs.notes.get("device_lost"))


def _lost(spec: WorkerSpec, conn, e: BaseException) -> None:
    """The CUDA context died (an illegal access here, or memory an earlier case corrupted): report it as this
    case's crash and exit, so that a fresh worker takes the next case."""
    error = f"{type(e).__name__}: {first_line(e)}"
    obs = Observation(spec.target, spec.device, error_type="AcceleratorError", error=error[:500],
                      notes={"device_lost": True, **({"out_of_memory": True} if out_of_device_memory(e) else {})})
    conn.send(("result", obs, [Verdict("crash", False, f"CUDA context lost: {error[:300]}", where="device_lost")]))
    os._exit(3)


def run_and_judge(target, case: Case, lost=None) -> tuple[Observation, list[Verdict]]:
    """The target's observation of `case` and the oracle's verdicts, with the seconds each took
    (`stage_seconds`). `lost(obs)`: the run lost the device, so no oracle can run and the error is the verdict."""
    start = time.perf_counter()
    obs = target.run(case)
    ran = time.perf_counter()
    if lost is not None and lost(obs):
        obs.notes["device_lost"] = True
        verdicts = [Verdict("crash", False, f"{obs.error_type}: {obs.error}", where="device_lost")]
    else:
        verdicts = target.oracle(case, obs)
    obs.notes["stage_seconds"] = {"target": ran - start, "oracle": time.perf_counter() - ran}
    return obs, verdicts


def serve(fd: int, spec: WorkerSpec) -> None:

    die_with_parent()
    prepare_process(spec.device)
    conn = Connection(fd)
    try:

        vllm_version = import_vllm()  # once per worker, after prepare_process

        target = TARGETS[spec.target](spec.device)
        why = target.unavailable()
        if why:
            conn.send(("unavailable", why))
            return
        target.prepare()  # no narrowing here: the campaign draws the cases (its RunPlan), the worker runs them
        if spec.inject:
            inject(spec.inject)
    except MutantError as e:  # an --inject that cannot be applied: the user's to fix, in its own words
        conn.send(("mutant", str(e)))
        return
    except Exception as e:
        moved = as_moved(spec.target, e)  # the target's set-up called vLLM as this release no longer takes it
        conn.send(("moved", str(moved)) if moved is not None else ("failed", traceback.format_exc()))
        return
    # What the parent needs to plan the campaign without importing vLLM itself: the release and the target's plan.
    conn.send(("ready", os.getpid(), {"vllm": vllm_version, "plan": target.plan_state()}))
    free_at_start = _free_device_memory(spec)  # None unless a CUDA worker recycled for memory
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "stop":
            if spec.sanitizer:  # compute-sanitizer writes its summary from the process's own exit handlers
                return
            # Natively, skip the interpreter's shutdown (vLLM's and torch's exit hooks: ~2 s a campaign): nothing
            # of the worker's outlives it, and its results are sent.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        n, case = msg[1], Case.from_json(msg[2])
        print(f"{BEGIN} {n}", flush=True)
        try:
            # the context is gone after a lost device: no oracle can run here, the error is the verdict
            obs, verdicts = run_and_judge(target, case, lost=_device_lost)
        except Exception as e:
            late = _sync(spec.device)
            print(f"{END} {n}", flush=True)
            # lost: told by the exception's type, or by a device that fails every call now
            if spec.device == "cuda" and (lost_device(e) or late is not None):
                _lost(spec, conn, e)
            moved = as_moved(spec.target, e)  # a call into vLLM that does not fit this release: nothing was judged
            conn.send(("moved", str(moved)) if moved is not None else ("harness", traceback.format_exc()))
            continue
        late = _sync(spec.device)  # an asynchronous error from this case's kernels (the oracle's included)
        print(f"{END} {n}", flush=True)
        if late is not None and not obs.notes.get("device_lost"):
            _lost(spec, conn, late)
        for o in (obs, *obs.steps, *obs.parts.values(), *(s for p in obs.parts.values() for s in p.steps)):
            o.outputs = {}  # tensors stay here: findings keep verdicts and notes
        if spec.device == "cuda" and n % MEMORY_EVERY == 0:
            _log_device_memory(n)
        low = device_memory_low(_free_device_memory(spec), free_at_start, spec.recycle_below_free)
        if low:
            obs.notes["device_memory_low"] = low
        conn.send(("result", obs, verdicts))
        if obs.notes.get("device_lost"):
            os._exit(3)  # a fresh worker takes the next case


def _free_device_memory(spec: WorkerSpec) -> int | None:
    """The device's free memory in bytes (None: not a CUDA worker, not asked, or the context is gone)."""
    if spec.device != "cuda" or not spec.recycle_below_free:
        return None
    try:
        import torch

        return torch.cuda.mem_get_info()[0]
    except Exception:  # the context may be gone: the case's own verdict says so
        return None


def device_memory_low(free: int | None, free_at_start: int | None, fraction: float) -> str | None:
    """Why the worker should be replaced for memory (None: it need not): free device memory below `fraction` of
    what was free at its start."""
    if free is None or not free_at_start or free >= fraction * free_at_start:
        return None
    return f"free device memory {free >> 20} MiB, {free_at_start >> 20} MiB at the worker's start"


def _log_device_memory(n: int) -> None:
    """Free device memory and what PyTorch holds, after case n, into the worker's log."""
    try:
        import torch

        free, total = torch.cuda.mem_get_info()
        print(f"{MEMORY} after case {n}: free {free >> 20} MiB of {total >> 20}, torch allocated "
              f"{torch.cuda.memory_allocated() >> 20} MiB", flush=True)
    except Exception as e:  # the context may be gone: the case's own verdict says so
        print(f"{MEMORY} after case {n}: unavailable ({type(e).__name__})", flush=True)


def _run_delays(pid: int) -> dict[tuple[int, int], float]:
    """Seconds each thread of process `pid` and of its descendants (a sanitized worker runs under the tool) has
    waited, runnable, for a CPU: /proc's schedstat. Empty where the kernel does not say."""
    delays, stack = {}, [pid]
    while stack:
        p = stack.pop()
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/schedstat") as f:
                    delays[(p, int(tid))] = int(f.read().split()[1]) / 1e9
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    stack += [int(c) for c in f.read().split()]
            except (OSError, ValueError, IndexError):
                continue
    return delays


def _sync(device: str) -> BaseException | None:
    """Wait for the device; the asynchronous error it reports, if any."""
    if device == "cuda":
        try:
            import torch

            torch.cuda.synchronize()
        except Exception as e:
            return e
    return None


# -- the campaign side --------------------------------------------------------------------------------------

class WorkerExecutor:
    """check(case) -> (Observation, verdicts) through a worker process that is replaced whenever it dies."""

    def __init__(self, spec: WorkerSpec, log_dir: Path):
        self.spec, self.log_dir = spec, Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.started = 0  # workers started (replacements included)
        self.n = 0
        self.log_path: Path | None = None
        self._offset = 0
        self._reports_printed = 0
        self._cases_this_worker = 0
        self.ready: dict = {}  # what the last worker reported at start-up: vLLM's version, the target's plan
        self._awaiting = False  # spawned, its start-up report not read yet
        self.recent: deque[float] = deque(maxlen=RECENT_CASES)  # the last cases' own seconds, send to reply
        self._starved_from: dict[tuple[int, int], float] | None = None  # the worker's threads' CPU waits (`_wait`)

    def start(self) -> dict:
        """Start the worker now (the campaign would at its first case) and return what it reported."""
        if self._awaiting:  # started by `spawn`: its report is still to come
            self._await_ready()
            self._new_log()
        elif self.proc is None or self.proc.poll() is not None:
            self._kill()
            self._start()
            self._new_log()
        return self.ready

    def spawn(self) -> None:
        """Start the worker process and return at once: its imports (vLLM's, most of a CPU campaign's start-up) run
        while this process does its own; `start()` then waits for its report."""
        if self.proc is None or self.proc.poll() is not None:
            self._kill()
            self._spawn()

    # worker life
    def _start(self) -> None:
        self._spawn()
        self._await_ready()

    def _spawn(self) -> None:
        parent, child = socket.socketpair()
        self.started += 1
        self.log_path = self.log_dir / f"worker-{self.started}.log"
        cmd = [sys.executable, "-m", "fuzzer.run.worker", str(child.fileno()), json.dumps(asdict(self.spec))]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONFAULTHANDLER"] = "1"  # a fatal signal (and the watchdog's SIGABRT) prints every thread's stack
        if self.spec.sanitizer:

            cmd = sanitizer_command(self.spec.sanitizer) + cmd  # reports land in the worker's log, between markers
            env = sanitized_env(env)
            env["ATTNFUZZ_SANITIZER"] = self.spec.sanitizer  # a target may adapt to the tool (flashmla_runtime)
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, pass_fds=(child.fileno(),), stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=os.getcwd(), preexec_fn=die_with_parent)
        log.close()
        child.close()
        self.conn = Connection(parent.detach())
        self._offset = 0
        self._reports_printed = 0  # this worker's sanitizer reports so far (its print limit is per process)
        self._cases_this_worker = 0
        self._awaiting = True

    def _await_ready(self) -> None:
        self._awaiting = False
        if not self.conn.poll(self.spec.startup_timeout):
            self._kill()
            raise WorkerError(f"worker for {self.spec.target} did not start within {self.spec.startup_timeout:.0f} s; "
                              f"log: {self.log_path}")
        try:
            msg = self.conn.recv()
        except EOFError:
            msg = ("failed", f"the worker exited ({self._exit_status()}) during start-up:\n{self._log_tail()}")
        if msg[0] != "ready":
            self._kill()
            if msg[0] == "unavailable":
                raise WorkerUnavailable(self.spec.target, msg[1])
            if msg[0] == "mutant":
                raise WorkerInjectError(self.spec.target, msg[1])
            if msg[0] == "moved":
                raise VllmCallMoved(msg[1])
            raise WorkerError(f"worker for {self.spec.target}: {msg[0]}: {msg[1]}")
        self.ready = msg[2] if len(msg) > 2 else {}

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        if self.conn is not None:
            self.conn.close()
        self.proc, self.conn = None, None
        self._awaiting = False

    def _abort(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGABRT)
                self.proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass

    def close(self) -> None:
        if self.conn is not None and self.proc is not None and self.proc.poll() is None:
            try:
                self.conn.send(("stop",))
                self.proc.wait(timeout=30)
            except Exception:
                pass
        self._kill()

    def _exit_status(self) -> str:
        if self.proc is None:
            return "gone"
        try:
            rc = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            return "still running"
        if rc < 0:
            return f"killed by {signal.Signals(-rc).name}"
        return f"exit code {rc}"

    def _log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _new_log(self) -> str:
        """The worker's output since the last case (sanitizer reports included)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return ""
        self._offset += len(data)
        return data.decode(errors="replace")

    # one case
    def deadline(self) -> float:
        """Seconds the watchdog gives the next case: HANG_FACTOR times the slowest recent case, at least the
        spec's case_timeout (--case-timeout)."""
        return max(self.spec.case_timeout, HANG_FACTOR * max(self.recent, default=0.0))

    def check(self, case: Case) -> tuple[Observation, list[Verdict]]:
        deadline = self.deadline()
        obs, verdicts, log = self._attempt(case, deadline)
        if obs.error_type == "Hang":  # past the deadline: a hang, or a slow case on a loaded host; ask a fresh worker
            longer = deadline * HANG_CONFIRM
            obs, verdicts, again = self._attempt(case, longer)
            log += again
            if obs.error_type == "Hang":
                obs.error = (f"no result within {deadline:.0f} s, nor within {longer:.0f} s on a fresh worker "
                             f"(watchdog): worker killed")
                obs.notes["watchdog"] = {"deadline_s": round(deadline, 1), "confirm_s": round(longer, 1)}
                verdicts = [Verdict("hang", False, obs.error, where="hang")]
            else:  # no hang: the fresh worker's answer is the case's (its time now raises the deadline)
                obs.notes["watchdog_retry"] = (f"no result within {deadline:.0f} s; a fresh worker gave one within "
                                               f"{longer:.0f} s")
        if self.spec.sanitizer:
            verdicts = self._sanitizer_verdicts(log, obs) + verdicts
        self._cases_this_worker += 1
        why = self._recycle_why(obs)
        if why and self.proc is not None:
            self.close()  # asked to stop, so compute-sanitizer writes its summary; the next case starts a fresh one
            obs.notes["worker_recycled"] = why
        return obs, verdicts

    def _recycle_why(self, obs: Observation) -> str | None:
        """Why the worker is replaced after this case (None: it is not): its case count, or the memory it left."""
        n, low = self._cases_this_worker, obs.notes.get("device_memory_low")
        if self.spec.recycle_after and n >= self.spec.recycle_after:
            return f"after {n} cases"
        return f"after {n} cases: {low}" if low else None

    def _attempt(self, case: Case, deadline: float) -> tuple[Observation, list[Verdict], str]:
        """One run of `case` with the watchdog at `deadline` seconds: its observation, verdicts and the worker's
        output meanwhile. A hung worker is killed (its stacks first); a case that returned counts toward the
        deadline of the next."""
        if self._awaiting:  # spawned early (`spawn`) and never asked for its report: read it first
            self._await_ready()
            self._new_log()
        elif self.proc is None or self.proc.poll() is not None:
            self._kill()
            self._start()
            self._new_log()  # start-up output is not the case's
        self.n += 1
        try:
            self.conn.send(("case", self.n, case.to_json(None)))
        except (BrokenPipeError, ConnectionError, OSError):  # it died after its last reply: start another
            self._kill()
            self._start()
            self._new_log()
            self.conn.send(("case", self.n, case.to_json(None)))
        start = time.perf_counter()
        verdicts: list[Verdict]
        if not self._wait(deadline, start):
            self._abort()  # its stacks go to its log, for the report
            obs = Observation(self.spec.target, self.spec.device, error_type="Hang",
                              error=f"no result within {deadline:.0f} s (watchdog): worker killed",
                              notes={"log_tail": self._log_tail(60)})
            self._kill()
            verdicts = [Verdict("hang", False, obs.error, where="hang")]
        else:
            try:
                msg = self.conn.recv()
            except (EOFError, ConnectionError, OSError):
                msg = ("died", self._exit_status())
            if msg[0] == "result":
                obs, verdicts = msg[1], list(msg[2])
                self.recent.append(self._own_seconds(start))  # a case's own time (a death's is not)
                if obs.notes.get("device_lost"):  # it exits now; wait, so the next case starts a fresh one
                    self._exit_status()
                    self._kill()
            elif msg[0] == "harness":
                raise HarnessFailure(msg[1])
            elif msg[0] == "moved":
                raise VllmCallMoved(msg[1])
            else:  # the process died mid-case: a segfault, an abort, the OOM killer, a fatal CUDA error
                tail = self._log_tail(12)
                obs = Observation(self.spec.target, self.spec.device, error_type="WorkerCrash",
                                  error=f"the worker died running this case ({msg[1]})", notes={"log_tail": tail})
                verdicts = [Verdict("crash", False, f"worker died ({msg[1]}); last output: "
                                    f"{tail.splitlines()[-1] if tail else '-'}", where=msg[1].replace(" ", "-"))]
                self._kill()
        obs.seconds = obs.seconds or time.perf_counter() - start
        return obs, verdicts, self._new_log() if self.log_path else ""

    def _wait(self, deadline: float, start: float) -> bool:
        """Wait for the worker's reply to the case sent at `start` until the case has had `deadline` seconds of its
        own (`_own_seconds`), or STARVED_CAP times that on the wall clock. True: the reply came."""
        self._starved_from = None
        if self.conn.poll(min(deadline, 1.0)):  # most cases: no look at /proc
            return True
        self._starved_from = _run_delays(self.proc.pid) if self.proc is not None else {}
        while True:
            left = deadline - self._own_seconds(start)
            if left <= 0 or time.perf_counter() - start >= deadline * STARVED_CAP:
                return False
            if self.conn.poll(min(left, 1.0)):
                return True

    def _own_seconds(self, start: float) -> float:
        """Seconds since `start` less the longest wait for a CPU of one of the worker's threads since `_wait` began
        to watch them (a case answered within its first second is not watched: wall-clock seconds)."""
        wall = time.perf_counter() - start
        if not self._starved_from or self.proc is None:
            return wall
        now = _run_delays(self.proc.pid)
        return wall - max([0.0, *(d - self._starved_from.get(k, 0.0) for k, d in now.items())])

    def _sanitizer_verdicts(self, log: str, obs: Observation) -> list[Verdict]:

        printed = parse_log(log, self.spec.sanitizer)
        self._reports_printed += len(printed)
        if limit_reached(self._reports_printed):  # before compute-sanitizer stops printing: a fresh worker next
            self._kill()
            obs.notes["sanitizer_worker_retired"] = f"{self._reports_printed} reports printed"
        reports = dedupe(printed)
        obs.notes["sanitizer"] = self.spec.sanitizer
        if reports:
            obs.notes["sanitizer_log"] = log[-20000:]  # the raw log beside the finding
            obs.notes["sanitizer_reports"] = [r.to_dict() for r in reports]
        return [Verdict("memory", False, r.describe(), "C" if "Invalid" in r.kind else "H",
                        where=f"{r.tool}:{r.kernel}:{r.line}") for r in reports]


if __name__ == "__main__":
    serve(int(sys.argv[1]), WorkerSpec(**{k: tuple(v) if isinstance(v, list) else v
                                          for k, v in json.loads(sys.argv[2]).items()}))
