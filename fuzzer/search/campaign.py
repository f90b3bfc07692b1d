"""A campaign: Hypothesis drives a target's case strategy; each case is run, judged, and every failing
signature is shrunk and saved as a reproducer.

Hypothesis does the searching and the shrinking (its example database lives under `.attnfuzz/`, so a
rerun replays earlier failures first). Each distinct failure signature raises its own exception type, so
Hypothesis shrinks each bug separately instead of sliding from one to another.

The `swarm` search (the default) runs Hypothesis in batches of SWARM_BATCH cases, each under its own swarm
(fuzzer/search/combinations: one uncovered triple of knob categories pinned, other knobs pinned at random);
the `plain` search runs the target's strategy as it is, in one batch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, Verbosity, event, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import target as hypothesis_target
from hypothesis.control import current_build_context, currently_in_test_context
from hypothesis.database import DirectoryBasedExampleDatabase

from fuzzer import interrupt
from fuzzer.env import STATE_DIR, HostInfo
from fuzzer.errors import CaseFailed, HarnessError, HarnessFailure, VllmCallMoved
from fuzzer.errors import StopSearch as _Stop  # ends the Hypothesis run at once (a BaseException)
from fuzzer.observation import Observation
from fuzzer.records import Finding
from fuzzer.search.caselog import CaseLog
from fuzzer.search.combinations import Combinations
from fuzzer.search.database import KeepStoredFailures
from fuzzer.search.pending import Journal, Pending
from fuzzer.search.progress import Progress
from fuzzer.targets.base import WHOLE, RunPlan, Target, as_moved
from fuzzer.targets.probes import rarity
from oracles.verdict import Verdict, primary
from strategies.case import Case
from strategies.profiles import Profile
from strategies.swarm import Swarm

RARE_PATH_SCORE = 0.25  # a path, or the case's set of paths, seen at most four times so far
CLIMB_MARGIN = 0.1  # an error within 10x of the tolerance (clean cases sit near 1e-3)
SEARCHES = ("swarm", "plain")
SWARM_BATCH = 16  # cases per swarm: enough for Hypothesis to explore one, few enough for many per campaign


@dataclass
class CampaignResult:
    target: str
    examples: int = 0  # cases the search generated: never more than max_examples
    seconds: float = 0.0
    shrink_cases: int = 0  # cases run while shrinking a finding (on top of `examples`)
    rerun_cases: int = 0  # findings' re-runs (--reruns)
    interrupted: str | None = None  # the signal that cut the campaign short (SIGINT, SIGTERM)
    startup_seconds: float = 0.0  # the command's start-up before the campaign (set by the command)
    findings: list[Finding] = field(default_factory=list)
    host_faults: list[Finding] = field(default_factory=list)  # not tested: the host's fault (host_out_of_memory)
    checks: dict[str, int] = field(default_factory=dict)
    workers_started: int = 0
    repeats: dict[str, int] = field(default_factory=dict)  # later hits of an already-shrunk signature
    cases: CaseLog = field(default_factory=CaseLog)  # coverage, error margins, per-case records (run --out)

    @property
    def cases_run(self) -> int:
        return self.examples + self.shrink_cases + self.rerun_cases

    @property
    def rate(self) -> float:
        return self.cases_run / self.seconds if self.seconds else 0.0


class Campaign:
    def __init__(self, target: Target, profile: Profile, host: HostInfo, *, seed: int = 0,
                 executor, max_examples: int | None = 100, time_budget: float | None = None,
                 inject: str | None = None, progress: Progress | None = None, pending: Path | None = None,
                 journal: Path | None = None, reruns: int = 3, shrink: bool = True,
                 database=None, max_findings: int | None = None, search: str = "swarm",
                 known: tuple[str, ...] = (), plan: RunPlan = WHOLE) -> None:
        if search not in SEARCHES:
            raise ValueError(f"search must be one of {SEARCHES}, got {search!r}")
        self.search = search
        # Where cases run (fuzzer/run/executors): a worker process (crash isolation, sanitizers) or this process.
        self.executor = executor
        self.pending = Pending(pending, target.name, inject) if pending is not None else None
        self.journal = Journal(journal) if journal is not None else None
        self.reruns, self.shrink = reruns, shrink
        self.max_findings = max_findings  # stop searching once this many distinct findings are made
        self.target, self.profile, self.host = target, profile, host
        self.plan = plan  # what this run narrows the target's cases to (run --kv-cache-dtype, --cudagraph)
        self.seed, self.max_examples, self.time_budget, self.inject = seed, max_examples, time_budget, inject
        self.progress = progress or Progress(target.name)
        # Hypothesis's example database (--db: shared by a fleet's workers and hosts); None: .attnfuzz/examples
        self.database = database
        self.result = CampaignResult(target.name)
        self._failures: dict[str, Finding] = {}
        self._exc_types: dict[str, type[CaseFailed]] = {}
        self._failed_cases: dict[str, str] = {}  # each failing case's JSON: its signature (Hypothesis's last replay)
        self._start = 0.0
        self._batch_failed = False
        # Known open bugs' signatures (`run --known`): counted as repeats from the start, never raised, saved or
        # counted toward max_findings, as the bugs this campaign shrank in an earlier batch are.
        self.known = frozenset(known)
        self._settled: set[str] = set(self.known)
        self._winding_down = False  # SIGTERM: no case runs from now on
        self._in_cases = 0.0  # seconds spent inside cases (the rest of a batch is Hypothesis's own)

    def _out_of_time(self) -> bool:
        return self.time_budget is not None and time.monotonic() - self._start > self.time_budget

    def _shrinking(self) -> bool:
        """This batch found a bug and Hypothesis shrinks it: its cases must run whatever the budget says."""
        return self.shrink and self._batch_failed

    def _spent(self) -> bool:
        """No more cases to run: the campaign winds down, or its searched cases reach max_examples outside a shrink
        (shrinking runs on top, counted apart).
        Once a batch has failed, Hypothesis replays the rest of the stored corpus (a fleet's shared database)
        whatever its max_examples says, so the campaign's own count is the stop."""
        if self._winding_down:
            return True
        return (self.time_budget is None and self.max_examples is not None and not self._shrinking()
                and self.result.examples >= self.max_examples)

    # -- one case -----------------------------------------------------------------------------------------
    def check(self, case: Case) -> tuple[Observation, list[Verdict]]:
        if self.journal is not None:  # written before the case runs: a SIGKILLed campaign loses nothing
            self.journal.write(case)
        try:
            result = self.executor.check(case)
            if self.journal is not None:
                self.journal.clear()
            return result
        except VllmCallMoved:  # a call into vLLM that does not fit this release (the worker's or this process's)
            raise
        except HarnessFailure as e:  # attnfuzz's code raised inside the worker
            raise HarnessError(f"{self.target.name} on {case.summary()}: {e}") from e
        except Exception as e:  # raised by attnfuzz code, not by the code under test
            if (moved := as_moved(self.target.name, e)) is not None:  # raised by the target outside its observe
                raise moved from e
            raise HarnessError(f"{self.target.name} on {case.summary()}: {type(e).__name__}: {e}\n"
                               f"{traceback.format_exc()}") from e

    def _test(self, case: Case) -> None:
        self._raise_reported(case)
        if self._spent():
            raise _Stop()
        if self._out_of_time() and not self._shrinking():
            return  # the budget is spent: let Hypothesis run out the batch without running cases
        started = time.perf_counter()
        try:
            self._run_case(case, started)
        finally:
            self._in_cases += time.perf_counter() - started

    def _raise_reported(self, case: Case) -> None:
        """Hypothesis replays each failure once more before it reports them (its `is_final` run). The case ran and
        its failure is recorded: raise it again without running the case, which cost a worker restart per failing
        case, counted as a searched case, and past --max-examples (--no-shrink) raised a _Stop that Hypothesis
        grouped with the other failures into a BaseExceptionGroup. Any other run returns: the case runs."""
        if not currently_in_test_context() or not current_build_context().is_final:
            return
        signature = self._failed_cases.get(case.to_json(None))
        if signature is not None and signature not in self._settled:
            raise self._exc_types[signature](signature)

    def _run_case(self, case: Case, started: float) -> None:
        obs, verdicts = self.check(case)
        checked = time.perf_counter()
        r = self.result
        if self._shrinking():
            r.shrink_cases += 1
        else:
            r.examples += 1
        for v in verdicts:
            key = f"{v.check}:{'ok' if v.ok else 'FAIL'}"
            r.checks[key] = r.checks.get(key, 0) + 1
        failed = [v for v in verdicts if not v.ok]
        self.progress.update(r.cases_run, len(self._failures), obs.seconds)
        self._steer(case, obs, verdicts)
        r.cases.time_case(obs, checked - started, time.perf_counter() - checked)
        if not failed:
            return
        # One signature per bug: the primary symptom, so shrinking cannot slide between bugs.
        signature = primary(failed).signature
        if signature in self._settled:  # found and shrunk in an earlier batch: counted, the search goes on
            self.result.repeats[signature] = self.result.repeats.get(signature, 0) + 1
            return
        prior = self._failures.get(signature)
        finding = self._failures[signature] = Finding(
            self.target.name, signature, case, failed, obs, self.host, self.inject,
            prior.examples_to_find if prior else r.examples,
            prior.seconds_to_find if prior else time.monotonic() - self._start,
        )
        self._save_pending(finding)
        self._failed_cases[case.to_json(None)] = signature
        self._batch_failed = True  # from here on this batch is shrinking: never skip its cases
        exc = self._exc_types.setdefault(signature, type(f"CaseFailed{len(self._exc_types)}", (CaseFailed,), {}))
        raise exc(signature)

    def _steer(self, case: Case, obs: Observation, verdicts: list[Verdict]) -> None:
        """Count the case (campaign directory, report) and feed Hypothesis: an event per vLLM path the case took,
        and two targets, so the search goes where path coverage is thin and climbs toward failing."""
        log = self.result.cases
        record = log.add(case, obs, verdicts)
        if not currently_in_test_context():  # a journaled case re-checked on resume runs outside Hypothesis
            return
        paths = record["paths"]
        for p in paths:
            event(p)
        # Rare paths and rare combinations of them (the fp8 separate path with padding rows, ...) both count.
        # Only cases worth climbing from report a score: with an example database Hypothesis keeps a Pareto
        # front of every case that reports one, about 15 ms a case on the GPU host (a third of a fast case).
        score = rarity(paths, log.coverage) + 1.0 / log.path_sets[" + ".join(paths) or "-"]
        if score >= RARE_PATH_SCORE:
            hypothesis_target(score, label="path rarity")
        margins = [m for m in record["margins"].values() if isinstance(m, float)]
        if margins and max(margins) >= CLIMB_MARGIN:  # error / tolerance: > 1 fails
            hypothesis_target(max(margins), label="error margin")

    # -- the campaign --------------------------------------------------------------------------------------
    # -- findings survive the campaign's own death -----------------------------------------------------
    def _save_pending(self, finding: Finding) -> None:
        """Each finding (and each smaller case for it) is on disk the moment it is made."""
        if self.pending is not None:
            self.pending.save(finding)

    def _resume(self) -> None:
        """Before searching: the findings a killed campaign had made are taken back as they were saved (and
        re-run with the others at the end), and the case it was running when it died (the journal) is
        checked again, so a SIGKILL loses none of them."""
        for finding in self.pending.load() if self.pending is not None else ():
            if finding.signature not in self._failures and finding.signature not in self.known:
                self._failures[finding.signature] = finding
                self._settled.add(finding.signature)
        case = self.journal.read() if self.journal is not None else None
        if case is not None:
            try:
                self._test(case)
            except CaseFailed:
                pass
        if self.journal is not None:
            self.journal.clear()

    def _rerun(self, finding: Finding) -> None:
        """Run a finding's case again: one that does not fail the same way every time is flaky."""
        same = 0
        for _ in range(self.reruns):
            _, verdicts = self.check(finding.case)
            self.result.rerun_cases += 1
            failed = [v for v in verdicts if not v.ok]
            same += bool(failed) and primary(failed).signature == finding.signature
        finding.reruns = (same, self.reruns)

    def _isolate(self, finding: Finding) -> None:
        """A trace's finding whose first failing step is not its first: that step run alone, on a fresh engine.
        Passing there, the bug needs state the steps before it left (class H): the finding says so."""
        k = min((v.step for v in finding.verdicts if v.step), default=0)
        if k < 2:
            return
        alone = dataclasses.replace(finding.case.steps[k - 1], earlier=())
        try:
            _, verdicts = self.check(alone)
        except HarnessError:
            return  # the finding stands as it is
        self.result.rerun_cases += 1
        if all(v.ok for v in verdicts):
            finding.verdicts.append(Verdict(
                "stateful", False, f"step {k} fails after the {k - 1} step(s) before it, and passes run alone on a "
                f"fresh builder, impl, cache and buffers: it reads state an earlier step left", "H", where="stateful",
                step=k))

    def clear_pending(self, saved: list[Finding]) -> None:
        """Called once these findings are saved for good."""
        if self.pending is not None:
            self.pending.clear(saved)

    @property
    def started_at(self) -> float:
        return self._start

    def run(self) -> CampaignResult:
        self._start = time.monotonic()
        try:
            return self._run()
        finally:
            self.executor.close()

    def _run(self) -> CampaignResult:
        import signal
        import threading

        def wind_down(signum, frame):  # SIGINT or SIGTERM (a user, a CI timeout, a fleet's parent): stop, save
            self.time_budget = 0.0
            self._winding_down = True  # a shrink in progress stops too: its best case so far is pending on disk
            self.result.interrupted = signal.Signals(signum).name
            for s in (signal.SIGINT, signal.SIGTERM):  # a second one kills; what was found is pending on disk
                signal.signal(s, signal.SIG_DFL)
            interrupt.note(signum)  # the command's handler, restored below, kills on the next one too

        main = threading.current_thread() is threading.main_thread()
        previous = {s: signal.signal(s, wind_down) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
        if main and interrupt.received():  # one came just before (the command records it): no case runs
            wind_down(signal.Signals[interrupt.received()], None)
        try:
            space = self.target.cases(self.profile, self.plan)
            combos = self.result.cases.combinations = Combinations(space.knobs, self.profile.max_context)
            rng = random.Random(f"swarm/{self.seed}")
            self._resume()
            db = self.database
            if db is None:
                db = DirectoryBasedExampleDatabase(str(STATE_DIR / "examples"))
            batch, idle = 0, 0
            while True:
                if self.time_budget is not None:
                    left = self.time_budget - (time.monotonic() - self._start)
                    if left <= 0:
                        break
                    n = 50  # batches, so that the budget is checked between them
                else:
                    n = self.max_examples - self.result.examples
                    if n <= 0:
                        break
                swarm = None
                if self.search == "swarm":  # the first batch pins nothing; every knob is drawn over its categories
                    swarm = Swarm() if batch == 0 else combos.next_swarm(rng)
                    n = min(n, SWARM_BATCH)
                self.result.cases.swarm = swarm.label() if swarm else None
                before = self.result.examples
                shrinking_before = self.result.shrink_cases
                self._batch_failed = False
                # Batch k > 0 draws from a seed hashed from (seed, k), not seed + k: campaigns of adjacent seeds
                # (a fleet's workers) would otherwise replay each other's batches.
                digest = hashlib.sha256(f"{self.seed}/{batch}".encode()).hexdigest()
                seed = self.seed if batch == 0 else int(digest[:15], 16)
                # Settled bugs no longer raise: Hypothesis would delete their stored examples as fixed.
                try:
                    # Stored failures are replayed once, by the first batch (a later swarm would read them anew).
                    # Under swarms the swarm steers; Hypothesis's optimiser would spend a batch on one case's variants.
                    self._hypothesis(space.strategy(swarm), KeepStoredFailures(db) if self._settled else db, seed, n,
                                     reuse=batch == 0 or swarm is None)
                except _Stop:
                    if self.shrink:  # a signal stopped this batch's shrink: its cases are the smallest so far
                        for signature in set(self._failures) - self._settled:
                            self._failures[signature].observation.notes["shrink_cut_short"] = True
                    break
                for signature in set(self._failures) - self._settled:  # this batch's, shrunk to the end
                    self._failures[signature].shrunk = self.shrink
                # Hypothesis ends a batch at its first bug and shrinks it; the next batch goes on searching, and
                # the bugs already shrunk no longer stop it (they are counted, not raised).
                self._settled |= set(self._failures)
                batch += 1
                if self.max_findings is not None and len(self._failures) >= self.max_findings:
                    break
                idle = idle + 1 if self.result.examples == before and self.result.shrink_cases == shrinking_before else 0
                if idle >= (3 if swarm is not None else 1):
                    break  # nothing left to generate (under a swarm: three pinned spaces in a row exhausted)
            self.result.seconds = time.monotonic() - self._start
            self.result.findings = list(self._failures.values())
            for finding in self.result.findings:
                self._isolate(finding)
                if self.reruns:
                    self._rerun(finding)
            self.result.host_faults = [f for f in self.result.findings if f.host_out_of_memory]
            self.result.findings = [f for f in self.result.findings if not f.host_out_of_memory]
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        self.result.workers_started = getattr(self.executor, "started", 0)
        self.progress.done(self.result)
        return self.result

    def _hypothesis(self, strategy, db, seed: int, n: int, reuse: bool = True) -> None:
        @settings(max_examples=n, deadline=None, database=db, derandomize=False, print_blob=False,
                  suppress_health_check=list(HealthCheck), report_multiple_bugs=True,
                  phases=(Phase.explicit,) + ((Phase.reuse,) if reuse else ()) + (Phase.generate,)
                  + ((Phase.target,) if self.search == "plain" else ())
                  + ((Phase.shrink,) if self.shrink else ()),
                  verbosity=Verbosity.quiet)
        @given(strategy)
        @hypothesis_seed(seed)  # under @given: seed() on the finished test also sets its database to None
        def fuzz(case):
            self._test(case)

        # One example-database key per target, profile and injected bug, never the seed: a rerun, another worker
        # or another host replays those stored failures first. (Hypothesis reads this key from the finished test.)
        key = f"attnfuzz|{self.target.name}|{self.profile.name}|{self.inject or '-'}"
        fuzz._hypothesis_internal_database_key = key.encode()
        started, in_cases = time.perf_counter(), self._in_cases
        try:
            fuzz()
        except (HarnessError, _Stop):
            raise
        except BaseException as e:  # CaseFailed, or Hypothesis's (nested) groups of them: recorded in _failures
            errors = _flatten(e)
            for err in errors:
                if isinstance(err, HarnessError):
                    raise err
                if not isinstance(err, (CaseFailed, _Stop)):
                    raise
            if any(isinstance(err, _Stop) for err in errors):  # grouped with the failures it reports: they are
                raise _Stop() from e  # recorded (and pending) already; the campaign stops as a lone _Stop stops it
        finally:
            self.result.cases.stage_seconds["search"] += max(
                0.0, time.perf_counter() - started - (self._in_cases - in_cases))


def _flatten(e: BaseException) -> list[BaseException]:
    """The leaf exceptions of (nested) exception groups, e.g. Hypothesis's FlakyFailure around ours."""
    inner = getattr(e, "exceptions", None)
    if not inner:
        return [e]
    return [leaf for x in inner for leaf in _flatten(x)]
