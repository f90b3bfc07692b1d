"""One `attnfuzz run` campaign in its own process, for the gate and the selftest.

A mutant patches vLLM process-wide, so every campaign gets a fresh process; each also gets a fresh state
directory (`ATTNFUZZ_STATE`), so no example database replays another campaign's failures and a fixed seed
draws the same cases every time. What the campaign found is read back from its `--json` summary.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from fuzzer import interrupt
from fuzzer.errors import RecordError
from fuzzer.records import RunSummary

ROOT = Path(__file__).resolve().parents[2]
# After a signal to this process, how long a running campaign may take to wind down (finish its case, save what it
# found, write its summary saying it was interrupted) before it is killed; a second signal kills this process.
STOP_GRACE_S = 60.0


@dataclass(frozen=True)
class CampaignSpec:
    target: str
    max_examples: int
    seed: int
    kv_cache_dtype: str | None = None  # None: the target's cases draw every dtype it takes
    inject: str | None = None  # a built-in mutant
    reruns: int | None = None  # None: `attnfuzz run`'s default
    extra: tuple[str, ...] = ()  # more `attnfuzz run` options (e.g. --sanitizer memcheck)
    env: tuple[tuple[str, str], ...] = ()  # more environment (e.g. ATTNFUZZ_GUARDS=0)
    label: str = ""  # tells apart campaigns that differ only in extra/env
    time_budget: float | None = None  # seconds of search (`run --time-budget`) in place of max_examples

    @property
    def name(self) -> str:
        return self.target + (f"[{self.kv_cache_dtype}]" if self.kv_cache_dtype else "") + \
            (f"+{self.inject}" if self.inject else "") + (f" ({self.label})" if self.label else "")

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "-", self.name).strip("-")

    def argv(self, device: str, workdir: Path) -> list[str]:
        argv = [sys.executable, "-m", "fuzzer.cli", "--device", device, "run", "--target", self.target,
                "--seed", str(self.seed),
                *(("--time-budget", f"{self.time_budget:g}s") if self.time_budget is not None
                  else ("--max-examples", str(self.max_examples))),
                "--json", str(workdir / "summary.json"), "--repros", str(workdir / "repros"), "--quiet"]
        if self.kv_cache_dtype:
            argv += ["--kv-cache-dtype", self.kv_cache_dtype]
        if self.inject:
            argv += ["--inject", self.inject]
        if self.reruns is not None:
            argv += ["--reruns", str(self.reruns)]
        return argv + list(self.extra)


def campaign_figures(examples: int, seconds: float, wall_seconds: float, emulated: list[str]) -> str:
    """One campaign's figures as gate and selftest print them, with the stand-ins it ran on (none: nothing said)."""
    return (f"{examples} cases in {seconds:.1f} s ({wall_seconds:.0f} s with start-up)"
            + (f", stand-ins: {', '.join(emulated)}" if emulated else ""))


@dataclass
class CampaignOutcome:
    spec: CampaignSpec
    returncode: int | None  # None: killed at the time limit
    wall_seconds: float  # the whole process, vLLM imports included
    summary: dict | None  # the campaign's --json; None when it wrote none
    log: Path

    @property
    def findings(self) -> list[dict]:
        return list((self.summary or {}).get("findings", []))

    @property
    def emulated(self) -> list[str]:
        """The ops attnfuzz's stand-ins served in this campaign (the host lacked the compiled ones): every result
        that reports the campaign names them."""
        return sorted((self.summary or {}).get("emulated") or {})

    @property
    def error(self) -> str | None:
        """Why the campaign itself did not complete (None when it did, with or without findings)."""
        if self.returncode is None:
            return f"timed out after {self.wall_seconds:.0f} s"
        if self.returncode not in (0, 1):
            return f"exited {self.returncode}: {self.log_tail(8)}"
        if self.summary is None:
            return f"exited {self.returncode} without a JSON summary: {self.log_tail(8)}"
        if (self.returncode == 1) != bool(self.findings):
            return f"exit code {self.returncode} disagrees with {len(self.findings)} finding(s) in its summary"
        return None

    def first_with_class(self, bug_class: str) -> dict | None:
        """The earliest finding whose bug classes include `bug_class`."""
        hits = [f for f in self.findings if bug_class in f.get("bug_classes", [])]
        return min(hits, key=lambda f: f.get("examples_to_find", 0)) if hits else None

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.strip().splitlines()[-lines:])


def run_campaign(spec: CampaignSpec, device: str, workdir: Path, timeout_s: float) -> CampaignOutcome:
    """Run `spec` in a fresh process with a fresh state directory under `workdir` (emptied first)."""
    workdir = workdir.resolve()  # the campaign runs from the repository root
    if workdir.exists():
        shutil.rmtree(workdir)  # a stale summary.json must never be read as this run's
    workdir.mkdir(parents=True)
    env = dict(os.environ, **dict(spec.env), ATTNFUZZ_STATE=str(workdir / "state"), PYTHONUNBUFFERED="1")
    log = workdir / "log.txt"
    start = time.monotonic()
    with log.open("w") as out:
        # Own process group: a campaign past its limit is ended with its worker processes.
        proc = subprocess.Popen(spec.argv(device, workdir), cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        rc = _wait(proc, timeout_s)
    seconds = time.monotonic() - start
    summary_path = workdir / "summary.json"
    try:
        summary = asdict(RunSummary.read(summary_path)) if summary_path.is_file() else None
    except RecordError:
        summary = None  # half-written: the outcome's error says there is none
    return CampaignOutcome(spec, rc, seconds, summary, log)


def _wait(proc: subprocess.Popen, timeout_s: float) -> int | None:
    """The campaign's exit status; None: it ran past `timeout_s` and was ended. A signal to this process
    (fuzzer/interrupt.py) is passed on as SIGTERM: the campaign winds down and writes its summary (exit 3 when it
    found nothing), or is killed after STOP_GRACE_S."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return proc.wait(timeout=max(0.01, min(0.5, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            pass
        if interrupt.received():
            _end_group(proc, grace=STOP_GRACE_S)
            return proc.returncode
        if time.monotonic() >= deadline:
            _end_group(proc)
            return None


def _end_group(proc: subprocess.Popen, grace: float = 10) -> None:
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def run_campaigns(specs: list[CampaignSpec], device: str, root: Path, timeout_s: float, jobs: int = 1,
                  on_done: Callable[[CampaignOutcome], None] | None = None) -> list[CampaignOutcome]:
    """Run each spec (up to `jobs` at a time) in `root/<slug>/`; outcomes in the order of `specs`. After a signal
    (fuzzer/interrupt.py) no campaign starts and those running wind down: the outcomes are those of the campaigns
    that ran (the caller sees `interrupt.received()`)."""
    def one(spec: CampaignSpec) -> CampaignOutcome | None:
        if interrupt.received():
            return None
        outcome = run_campaign(spec, device, root / spec.slug, timeout_s)
        if on_done:
            on_done(outcome)
        return outcome

    with interrupt.deferred(), ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:  # the threads poll for it
        return [o for o in pool.map(one, specs) if o is not None]
