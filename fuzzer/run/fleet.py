"""Nightly runs: `attnfuzz run --workers N|auto [--db PATH|redis://host:port/n]`.

One campaign process per GPU (`--workers auto`; on a CPU host 1 unless N is given), each an ordinary
`attnfuzz run` with `CUDA_VISIBLE_DEVICES` set to its GPU, seed = base seed + worker index, its own state
directory (journal, worker logs, pending findings: what a killed worker left is resumed by that worker's next
run) and its own repros directory and JSON summary, and all of them on ONE Hypothesis example database.

That database is how workers and hosts share: Hypothesis replays the failures stored under a test's key
before it generates anything, and the key is the target and profile alone (campaign.py), never the seed, so
every worker, on any host, replays every other's failures first. The parent then merges what the workers
saved: findings are deduplicated by target, injected bug and signature (one repro kept, the smallest case),
and a signature index kept beside the examples (a directory in a directory database, a Redis hash in a Redis
one) tells a later run or another host which signatures are already saved: those are counted, not saved again.

SIGINT or SIGTERM to the parent winds the workers down (each finishes its case, re-runs and saves what it
found: campaign.py's SIGTERM handler) and merges; a second signal, or a worker still running after
`GRACE_SECONDS`, is killed, and what it had found stays pending for its next run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from fuzzer.env import STATE_DIR, die_with_parent
from fuzzer.run import mps
from fuzzer.errors import ExitCode, RecordError, UsageError
from fuzzer.records import RunSummary, read_finding
from fuzzer.search.database import SignatureIndex, example_database, is_redis, signature_index
from strategies.case import Case

ROOT = Path(__file__).resolve().parents[2]
GRACE_SECONDS = 120.0  # after SIGTERM, how long a worker may take to re-run and save its findings
PROGRESS_EVERY = 30.0  # seconds between progress lines when only case counts changed


# -- the workers ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WorkerPlan:
    index: int
    seed: int
    gpu: str | None  # CUDA_VISIBLE_DEVICES for this worker; None on CPU
    dir: Path  # its ATTNFUZZ_STATE; repros/, summary.json and run.log inside

    @property
    def repros(self) -> Path:
        return self.dir / "repros"

    @property
    def pending(self) -> Path:
        """Where the worker's campaign keeps its pending findings (its state directory's pending/<target>/)."""
        return self.dir / "pending"

    @property
    def summary(self) -> Path:
        return self.dir / "summary.json"

    @property
    def log(self) -> Path:
        return self.dir / "run.log"


def parse_workers(text: str) -> int | str:
    """`--workers`: a count >= 1, or auto (one per visible GPU)."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--workers {text!r}: a count of 1 or more, or auto")
    return int(text)


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them for a child."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed:
        return [g.strip() for g in listed.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def plan_workers(workers: int | str, device: str, seed: int, root: Path) -> list[WorkerPlan]:
    gpus = visible_gpus() if device == "cuda" else []
    if device == "cuda" and not gpus:
        raise UsageError("--workers with --device cuda: no GPU is visible")
    n = (len(gpus) if device == "cuda" else 1) if workers == "auto" else int(workers)
    # More workers than GPUs share them round-robin.
    return [WorkerPlan(i, seed + i, gpus[i % len(gpus)] if gpus else None, root / f"w{i}") for i in range(n)]


# run options the parent sets per worker, and whether each takes a value (the rest pass through as given)
_PER_WORKER = {"--workers": True, "--seed": True, "--json": True, "--repros": True, "--db": True, "--out": True,
               "--quiet": False, "--mps": False}


def passed_through(run_argv: list[str]) -> list[str]:
    """`run_argv` (the `attnfuzz run` arguments as given) without the options the parent sets per worker."""
    out, skip = [], False
    for arg in run_argv:
        if skip:
            skip = False
            continue
        flag = arg.split("=", 1)[0]
        if flag in _PER_WORKER:
            skip = _PER_WORKER[flag] and "=" not in arg
            continue
        out.append(arg)
    return out


def worker_command(args, device: str, plan: WorkerPlan, db: str) -> list[str]:
    """The worker's `attnfuzz run`: the parent's options, with its own seed, summary, repros and the shared db."""
    argv = passed_through(args.run_argv)
    if getattr(args, "out", None):  # each worker's campaign directory beside the others'
        argv += ["--out", str(Path(args.out).resolve() / f"w{plan.index}")]
    return [sys.executable, "-m", "fuzzer.cli", "--device", device, "run", *argv, "--seed", str(plan.seed),
            "--json", str(plan.summary), "--repros", str(plan.repros), "--db", db]


def _worker_env(plan: WorkerPlan, daemon: mps.Mps | None) -> dict[str, str]:
    env = dict(os.environ, ATTNFUZZ_STATE=str(plan.dir), PYTHONUNBUFFERED="1", **(daemon.env() if daemon else {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    if plan.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = plan.gpu
    return env


# -- merging what the workers saved -----------------------------------------------------------------------------

@dataclass
class Candidate:
    """One worker's finding on disk: a saved repro, or a pending one a killed worker left."""
    worker: int
    path: Path
    finding: dict
    size: tuple[int, int]  # (tokens, case JSON length): the smallest case is the one kept
    pending: bool

    @property
    def key(self) -> str:
        f = self.finding
        return f"{f['target']}|{f.get('inject') or '-'}|{f['signature']}"


def _candidates(plan: WorkerPlan) -> list[Candidate]:
    found = []
    for pending, root, pattern in ((False, plan.repros, "*/finding.json"), (True, plan.pending, "*/*/finding.json")):
        for path in sorted(root.glob(pattern)):
            try:
                finding = read_finding(path).raw
                case_json = (path.parent / "case.json").read_text()
                case = Case.from_json(case_json)
            except Exception as e:  # half-written when the worker was killed: its next run redoes it
                print(f"attnfuzz fleet: skipping {path.parent}: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            found.append(Candidate(plan.index, path.parent, finding, (case.num_tokens, len(case.to_json(None))),
                                   pending))
    return found


@dataclass
class Merged:
    saved: list[dict] = field(default_factory=list)  # new this run: saved under --repros
    known: list[dict] = field(default_factory=list)  # already in the signature index: counted, not saved
    pending: list[dict] = field(default_factory=list)  # only in a killed worker's pending findings: its next run saves them
    duplicates: int = 0


def merge(plans: list[WorkerPlan], index: SignatureIndex, repros: Path, host: dict) -> Merged:
    """Deduplicate the workers' findings by key, keep the smallest case of each, consult the index."""
    groups: dict[str, list[Candidate]] = {}
    for plan in plans:
        for c in _candidates(plan):
            groups.setdefault(c.key, []).append(c)
    out = Merged()
    for key, group in groups.items():
        saved = [c for c in group if not c.pending]
        best = min(saved or group, key=lambda c: c.size)
        entry = dict(best.finding, workers=sorted({c.worker for c in group}), duplicates=len(group) - 1,
                     found_by=best.worker)
        out.duplicates += len(group) - 1
        if not saved:
            out.pending.append(dict(entry, path=str(best.path)))
            continue
        record = {"id": best.finding["id"], "target": best.finding["target"], "signature": best.finding["signature"],
                  "inject": best.finding.get("inject"), "path": str((repros / best.finding["id"]).resolve()),
                  "hostname": socket.gethostname(), "vllm": host.get("vllm"), "device": host.get("device"),
                  "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        earlier = index.claim(key, record)
        if earlier is None:
            dest = repros / best.finding["id"]
            if not dest.exists():  # the same id is the same case and signature: an existing one is kept
                repros.mkdir(parents=True, exist_ok=True)
                shutil.move(str(best.path), str(dest))
            out.saved.append(dict(entry, path=str(dest)))
        else:
            out.known.append(dict(entry, saved_as=earlier))
        for c in saved:  # the pending ones belong to their worker's next run
            if c.path.exists():
                shutil.rmtree(c.path)
    return out


# -- the parent -------------------------------------------------------------------------------------------------

class _Stop:
    """SIGINT/SIGTERM: the first winds the workers down, the second kills them."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, signum, frame) -> None:
        self.count += 1


def _log_cases(log: Path) -> int | None:
    """The worker's case count from its last progress line (one every 50 cases)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 4096))
            tail = f.read().decode(errors="replace")
    except OSError:
        return None
    counts = re.findall(r": (\d+) cases, \d+ finding", tail)
    return int(counts[-1]) if counts else None


def _progress(target: str, plans: list[WorkerPlan], start: float) -> tuple[str, tuple]:
    parts, state = [], []
    for p in plans:
        cases = _log_cases(p.log)
        found = len(list(p.repros.glob("*/finding.json"))) + len(list(p.pending.glob("*/*/finding.json")))
        state.append((cases, found))
        parts.append(f"w{p.index} {'?' if cases is None else cases} cases {found} found")
    m, s = divmod(int(time.monotonic() - start), 60)
    return f"fleet {target} {m // 60:02d}:{m % 60:02d}:{s:02d}: " + ", ".join(parts), tuple(state)


def _signal(procs: list[subprocess.Popen], sig: int) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                if sig == signal.SIGKILL:
                    os.killpg(proc.pid, sig)  # the worker's own group: its case runner dies with it anyway
                else:
                    os.kill(proc.pid, sig)
            except ProcessLookupError:
                pass


def run_fleet(args, device: str) -> int:

    db = args.db if args.db is not None else str((STATE_DIR / "examples").resolve())
    if not is_redis(db):
        db = str(Path(db).resolve())
    example_database(db)  # a bad --db fails here, once, not in every worker
    index = signature_index(db)
    plans = plan_workers(args.workers, device, args.seed, (STATE_DIR / "fleet" / args.target).resolve())
    for plan in plans:
        plan.repros.mkdir(parents=True, exist_ok=True)
        plan.summary.unlink(missing_ok=True)
    gpus = sorted({p.gpu for p in plans if p.gpu is not None})
    daemon = mps.start(gpus) if args.mps else None
    if device == "cuda" and not daemon and len(plans) > len(gpus) and not mps.serving() and not args.quiet:
        print(f"fleet: {len(plans)} workers share {len(gpus)} GPU(s), time-sliced between their contexts; --mps runs "
              f"their kernels side by side (docs/benchmarks.md: 1.8x with 8 workers on an H200)", file=sys.stderr)
    stop = _Stop()
    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    start = time.monotonic()
    procs: list[subprocess.Popen] = []
    try:
        for plan in plans:
            with open(plan.log, "wb") as log:
                procs.append(subprocess.Popen(worker_command(args, device, plan, db), env=_worker_env(plan, daemon),
                                              stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True, preexec_fn=die_with_parent))
        if not args.quiet:
            print(f"fleet {args.target}: {len(plans)} worker(s), seeds {', '.join(str(p.seed) for p in plans)}"
                  + (f", GPUs {', '.join(p.gpu for p in plans)}" if device == "cuda" else ", cpu")
                  + (f", MPS daemon {daemon.pipe_directory}" if daemon else "")
                  + f"; database {db}; logs {plans[0].dir.parent}/w*/run.log", file=sys.stderr, flush=True)
        last_line, last_state, wind_down_at = 0.0, None, None
        while any(p.poll() is None for p in procs):
            time.sleep(0.5)
            if stop.count and wind_down_at is None:
                wind_down_at = time.monotonic()
                print("fleet: stopping the workers (they save what they found; again to kill)", file=sys.stderr)
                _signal(procs, signal.SIGTERM)
            if wind_down_at is not None and (stop.count > 1 or time.monotonic() - wind_down_at > GRACE_SECONDS):
                _signal(procs, signal.SIGKILL)
            if not args.quiet:  # a line when a worker finds something, else at most every PROGRESS_EVERY
                line, state = _progress(args.target, plans, start)
                found = [n for _, n in state] != [n for _, n in last_state or ()]
                if state != last_state and (found or time.monotonic() - last_line > PROGRESS_EVERY):
                    print(line, file=sys.stderr, flush=True)
                    last_line, last_state = time.monotonic(), state
    finally:
        _signal(procs, signal.SIGKILL)  # only if the parent itself failed: nothing is left running
        for proc in procs:
            proc.wait()
        if daemon:
            mps.stop(daemon)
        for s, handler in previous.items():
            signal.signal(s, handler)
    return _report(args, plans, procs, merge(plans, index, args.repros, _host(plans)), db,
                   time.monotonic() - start, interrupted=stop.count > 0,
                   mps_daemon=None if daemon is None else ("started" if daemon.started else "already serving"))


def _summaries(plans: list[WorkerPlan]) -> list[dict | None]:
    out = []
    for p in plans:
        try:
            out.append(asdict(RunSummary.read(p.summary)))
        except RecordError:
            out.append(None)  # killed before it wrote one
    return out


def _host(plans: list[WorkerPlan]) -> dict:
    return next((s["host"] for s in _summaries(plans) if s), {})


def _report(args, plans, procs, merged: Merged, db: str, seconds: float, interrupted: bool,
            mps_daemon: str | None = None) -> int:
    summaries = _summaries(plans)
    workers = []
    for plan, proc, s in zip(plans, procs, summaries):
        workers.append({"worker": plan.index, "seed": plan.seed, "gpu": plan.gpu, "exit": proc.returncode,
                        "examples": s["examples"] if s else None, "seconds": s["seconds"] if s else None,
                        "cases_per_second": s["cases_per_second"] if s else None,
                        # Each worker's own: shares of knob pairs do not add up (`--out DIR`: DIR/w<i>/campaign.json).
                        "coverage": s.get("coverage") if s else None, "log": str(plan.log)})
    examples = sum(w["examples"] or 0 for w in workers)
    # Per-key case counts summed over the workers: checks, and which parts were vLLM's or attnfuzz's stand-ins.
    # And each stage's seconds (stage_seconds) and each `--known` bug's hits (known_hits), summed the same way.
    counts: dict[str, dict[str, int]] = {key: {} for key in ("checks", "real", "emulated", "stage_seconds",
                                                             "known_hits")}
    for s in summaries:
        for key, total in counts.items():
            for k, v in (s or {}).get(key, {}).items():
                total[k] = total.get(k, 0) + v
    checks = counts["checks"]
    poisoned = sum((s or {}).get("allocator_poisoned", 0) for s in summaries)
    failed = [(w, p) for w, p in zip(workers, plans) if w["exit"] not in (ExitCode.CLEAN, ExitCode.FOUND) and not interrupted]
    print(f"fleet {args.target}: {len(plans)} worker(s), {examples} cases in {seconds:.1f} s "
          f"({examples / max(seconds, 1e-9):.1f}/s){' (interrupted)' if interrupted else ''}: "
          f"{len(merged.saved)} new finding(s), {len(merged.known)} already saved, {len(merged.pending)} pending, "
          f"{merged.duplicates} duplicate(s) merged")
    for f in merged.saved:
        print(f"FOUND {f['path']}  by worker {f['found_by']} after {f['examples_to_find']} cases{_dups(f)}\n"
              f"  case: {f['summary']}\n  {f['verdicts'][0]['detail'][:300]}")
    for f in merged.known:
        print(f"KNOWN {f['signature']}: saved before as {f['saved_as'].get('path', '?')} "
              f"({f['saved_as'].get('hostname', '?')}, {f['saved_as'].get('saved_at', '?')}); "
              f"hit by worker(s) {', '.join(map(str, f['workers']))}, first after {f['examples_to_find']} cases")
    for f in merged.pending:
        print(f"PENDING {f['signature']}: in {f['path']}; worker {f['found_by']}'s next run saves it")
    for w, plan in failed:
        tail = plan.log.read_text(errors="replace").strip().splitlines()[-15:] if plan.log.exists() else []
        print(f"attnfuzz fleet: worker {w['worker']} exited {w['exit']}; {plan.log}:\n  " + "\n  ".join(tail),
              file=sys.stderr)
    if args.json:
        RunSummary(target=args.target, seed=args.seed, examples=examples, seconds=round(seconds, 2),
                   findings=merged.saved, cases_per_second=round(examples / max(seconds, 1e-9), 2), checks=checks,
                   host=_host(plans), real=counts["real"], emulated=counts["emulated"], allocator_poisoned=poisoned,
                   interrupted=interrupted, database=db, workers=workers, duplicates_merged=merged.duplicates,
                   known=merged.known, pending=merged.pending, mps=mps_daemon,
                   stage_seconds={k: round(v, 3) for k, v in counts["stage_seconds"].items()},
                   known_hits=counts["known_hits"],
                   host_faults=[x for s in summaries for x in (s or {}).get("host_faults", [])]).write(args.json)
    if merged.saved or merged.known or merged.pending:
        return ExitCode.FOUND
    if failed:
        return ExitCode.USAGE
    if interrupted:
        return ExitCode.INTERRUPTED
    if examples == 0:
        print("attnfuzz fleet: no case ran: nothing was tested", file=sys.stderr)
        return ExitCode.USAGE
    return ExitCode.CLEAN


def _dups(f: dict) -> str:
    if not f["duplicates"]:
        return ""
    return f"; {f['duplicates']} duplicate(s) merged from worker(s) {', '.join(map(str, f['workers']))}"
