"""A campaign: Hypothesis drives a target's case strategy; each case is run, judged, and every failing
signature is shrunk and saved as a reproducer.

Hypothesis does the searching and the shrinking (its example database lives under `.attnfuzz/`, so a
rerun replays earlier failures first). Each distinct failure signature raises its own exception type, so
Hypothesis shrinks each bug separately instead of sliding from one to another.
"""

from __future__ import annotations

import hashlib
import json
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.database import DirectoryBasedExampleDatabase

from fuzzer.env import STATE_DIR, HostInfo
from fuzzer.observation import Observation
from fuzzer.progress import Progress
from fuzzer.targets.base import Target
from oracles.verdict import Verdict, primary
from strategies.case import Case
from strategies.profiles import Profile


class CaseFailed(Exception):
    """Raised inside the Hypothesis test for a failing case; subclassed once per signature."""


class HarnessError(RuntimeError):
    """attnfuzz itself failed (not the code under test): the campaign stops with exit code 2."""


@dataclass
class Finding:
    target: str
    signature: str
    case: Case
    verdicts: list[Verdict]  # the failed ones
    observation: Observation
    host: HostInfo
    inject: str | None
    examples_to_find: int
    seconds_to_find: float
    has_repro: bool = True

    @property
    def id(self) -> str:
        digest = hashlib.sha1(f"{self.signature}|{self.case.to_json(None)}".encode()).hexdigest()[:8]
        return f"{self.target.split('.')[-1].replace('_', '-')}-{digest}"

    @property
    def title(self) -> str:
        return primary(self.verdicts).detail

    def to_dict(self) -> dict:
        o = self.observation
        return {
            "id": self.id,
            "target": self.target,
            "signature": self.signature,
            "status": "open",
            "inject": self.inject,
            "bug_classes": sorted({v.bug_class for v in self.verdicts if v.bug_class}),
            "verdicts": [vars(v) for v in self.verdicts],
            "error": None if o.error_type is None else f"{o.error_type}: {o.error}",
            "memory": [v.describe() for v in o.memory],
            "real": list(o.real),
            "emulated": list(o.emulated),
            "host": self.host.to_dict(),
            "examples_to_find": self.examples_to_find,
            "seconds_to_find": round(self.seconds_to_find, 2),
            "summary": self.case.summary(),
        }


@dataclass
class CampaignResult:
    target: str
    examples: int = 0
    seconds: float = 0.0
    findings: list[Finding] = field(default_factory=list)
    checks: dict[str, int] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.examples / self.seconds if self.seconds else 0.0


class Campaign:
    def __init__(self, target: Target, profile: Profile, host: HostInfo, *, seed: int = 0,
                 max_examples: int | None = 100, time_budget: float | None = None, inject: str | None = None,
                 progress: Progress | None = None) -> None:
        self.target, self.profile, self.host = target, profile, host
        self.seed, self.max_examples, self.time_budget, self.inject = seed, max_examples, time_budget, inject
        self.progress = progress or Progress(target.name)
        self.result = CampaignResult(target.name)
        self._failures: dict[str, Finding] = {}
        self._exc_types: dict[str, type[CaseFailed]] = {}
        self._start = 0.0
        self._batch_failed = False

    def _out_of_time(self) -> bool:
        return self.time_budget is not None and time.monotonic() - self._start > self.time_budget

    # -- one case -----------------------------------------------------------------------------------------
    def check(self, case: Case) -> tuple[Observation, list[Verdict]]:
        try:
            obs = self.target.run(case)
            verdicts = self.target.oracle(case, obs)
        except Exception as e:  # raised by attnfuzz code, not by the code under test
            raise HarnessError(f"{self.target.name} on {case.summary()}: {type(e).__name__}: {e}\n"
                               f"{traceback.format_exc()}") from e
        return obs, verdicts

    def _test(self, case: Case) -> None:
        if self._out_of_time() and not self._batch_failed:
            return  # the budget is spent: let Hypothesis run out the batch without running cases
        obs, verdicts = self.check(case)
        r = self.result
        r.examples += 1
        for v in verdicts:
            key = f"{v.check}:{'ok' if v.ok else 'FAIL'}"
            r.checks[key] = r.checks.get(key, 0) + 1
        failed = [v for v in verdicts if not v.ok]
        self.progress.update(r.examples, len(self._failures), obs.seconds)
        if not failed:
            return
        # One signature per bug: the primary symptom, so shrinking cannot slide between bugs.
        signature = primary(failed).signature
        prior = self._failures.get(signature)
        self._failures[signature] = Finding(
            self.target.name, signature, case, failed, obs, self.host, self.inject,
            prior.examples_to_find if prior else r.examples,
            prior.seconds_to_find if prior else time.monotonic() - self._start,
        )
        self._batch_failed = True  # from here on this batch is shrinking: never skip its cases
        exc = self._exc_types.setdefault(signature, type(f"CaseFailed{len(self._exc_types)}", (CaseFailed,), {}))
        raise exc(signature)

    # -- the campaign --------------------------------------------------------------------------------------
    def run(self) -> CampaignResult:
        self._start = time.monotonic()
        strategy = self.target.cases(self.profile)
        db = DirectoryBasedExampleDatabase(str(STATE_DIR / "examples"))
        batch, seed = 0, self.seed
        while True:
            if self.time_budget is not None:
                left = self.time_budget - (time.monotonic() - self._start)
                if left <= 0:
                    break
                n = 50  # batches, so that the budget is checked between them
            else:
                n = self.max_examples - self.result.examples
                if n <= 0 or batch > 0:
                    break
            self._batch_failed = False
            self._hypothesis(strategy, db, seed, n)
            batch, seed = batch + 1, seed + 1
        self.result.seconds = time.monotonic() - self._start
        self.result.findings = list(self._failures.values())
        self.progress.done(self.result)
        return self.result

    def _hypothesis(self, strategy, db, seed: int, n: int) -> None:
        @settings(max_examples=n, deadline=None, database=db, derandomize=False, print_blob=False,
                  suppress_health_check=list(HealthCheck), report_multiple_bugs=True,
                  phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
                  verbosity=Verbosity.quiet)
        @given(strategy)
        def fuzz(case):
            self._test(case)

        # One example-database key per target and profile: reruns replay that target's failures first.
        fuzz._hypothesis_internal_add_digest = f"{self.target.name}|{self.profile.name}".encode()
        try:
            hypothesis_seed(seed)(fuzz)()
        except HarnessError:
            raise
        except BaseException as e:  # CaseFailed, or Hypothesis's group of them: recorded in _failures
            errors = getattr(e, "exceptions", [e])
            for err in errors:
                if isinstance(err, HarnessError):
                    raise err
                if not isinstance(err, CaseFailed):
                    raise


def save_finding(finding: Finding, repro_source: str, root: Path, tensors: dict | None = None) -> Path:
    """Write repros/<id>/: case.json, finding.json, report.md, repro.py (+ tensors.safetensors)."""
    from fuzzer.report import render_report

    d = root / finding.id
    d.mkdir(parents=True, exist_ok=True)
    finding.has_repro = bool(repro_source)
    (d / "case.json").write_text(finding.case.to_json() + "\n")
    (d / "finding.json").write_text(json.dumps(finding.to_dict(), indent=1) + "\n")
    (d / "report.md").write_text(render_report(finding))
    if repro_source:
        (d / "repro.py").write_text(repro_source)
    if tensors:
        from safetensors.torch import save_file

        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(d / "tensors.safetensors"))
    return d
