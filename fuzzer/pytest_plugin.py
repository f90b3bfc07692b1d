"""attnfuzz's pytest plugin (entry point `pytest11: attnfuzz`): campaigns as test items, for vLLM's CI.

    pytest --attnfuzz vllm.index_remap,vllm.flashmla_sparse --attnfuzz-budget 60s --junitxml=attnfuzz.xml

One item per target and kv-cache dtype (`attnfuzz::vllm.flashmla_sparse[fp8_ds_mla]`), each the gate's campaign
(`attnfuzz gate`: fixed seed, stop at the first new finding, keep it as first found) run as the gate runs it, in a
process of its own (`fuzzer.run.campaign_process`), judged as the gate judges it (`fuzzer.commands.gate`): a finding
fails the item, printed with the directory of its reproducer; a known open bug (a reproducer of `--attnfuzz-repros`
whose finding.json expects the bug on the installed vLLM) found again is reported and passes; a campaign that could
not test (exit 2: the target cannot run here, the mutant does not apply, no case ran; a time-out) is an error with
the reason, never a pass. `--attnfuzz-budget D` gives each campaign D of search (`run --time-budget`); without it,
the gate's fixed case counts (fuzzer/budgets.py). `--attnfuzz-inject MUTANT`: every campaign with that built-in
mutant, and ATTNFUZZ_INJECT set for the library checks of the same pytest run (fuzzer/api.py): the red check.

`--attnfuzz-replay`: one item more per reproducer of `--attnfuzz-repros` (`attnfuzz::replay[<id>]`), replayed as the
gate replays it (`python repro.py` in a process of its own) and judged by the gate's rules for the installed vLLM
(its finding.json's status and releases): the bug known present and still there, or fixed and still gone, passes (one
expected present that now passes too, reported: update its finding.json); a fixed bug back fails; a reproducer that
could not run its call (exit 2, a time-out) is an error; one made on a GPU, on a CPU host, is skipped.

With `--attnfuzz` or `--attnfuzz-replay` and no test paths on the command line, only attnfuzz's items are collected
(not testpaths); name paths to run both. docs/library.md has the rest.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from fuzzer import budgets, interrupt
from fuzzer.artifacts.finding_report import found_text
from fuzzer.commands.gate import (
    PASSING,
    find_repros,
    gate_specs,
    judge_campaign,
    known_bugs,
    known_per_target,
    replay,
)
from fuzzer.commands.run import duration
from fuzzer.env import STATE_DIR, host_device, installed_vllm
from fuzzer.errors import CouldNotTest, FindingFailed, GateError, UsageError
from fuzzer.mutants import MUTANTS
from fuzzer.records import Finding, FindingRecord, read_finding
from fuzzer.run.campaign_process import ROOT, CampaignSpec, run_campaign
from fuzzer.targets.registry import TARGETS, declared
from strategies.case import Case

INJECT_ENV = "ATTNFUZZ_INJECT"  # what fuzzer/api.py reads: the mutant its checks run under


def pytest_addoption(parser) -> None:
    g = parser.getgroup("attnfuzz", "attnfuzz: differential fuzzing of vLLM's sparse attention")
    g.addoption("--attnfuzz", action="append", default=[], metavar="TARGETS",
                help="run attnfuzz campaigns on these targets (comma-separated, repeatable; `all`: every target): "
                     "one test item per target and kv-cache dtype")
    g.addoption("--attnfuzz-budget", default=None, metavar="D",
                help="search time per campaign (90s, 10m); default: the gate's fixed case counts")
    g.addoption("--attnfuzz-max-examples", type=int, default=None, metavar="N",
                help="cases per campaign, in place of the gate's (with no --attnfuzz-budget)")
    g.addoption("--attnfuzz-seed", type=int, default=budgets.GATE_SEED, metavar="S",
                help=f"the campaigns' seed (default the gate's, {budgets.GATE_SEED})")
    g.addoption("--attnfuzz-inject", default=None, metavar="MUTANT",
                help="a built-in mutant (`attnfuzz list`) in every campaign and in the library checks of the same pytest run "
                     "(ATTNFUZZ_INJECT): a red check")
    g.addoption("--attnfuzz-device", choices=("cpu", "cuda"), default=None,
                help="the campaigns' device (default: cuda on a host with a GPU driver, else cpu)")
    g.addoption("--attnfuzz-repros", type=Path, default=None, metavar="DIR",
                help="reproducers whose bugs, expected present on the installed vLLM, are known: found again they "
                     "pass (default: attnfuzz's repros/, where it has one)")
    g.addoption("--attnfuzz-replay", action="store_true", default=False,
                help="replay every reproducer of --attnfuzz-repros as a test item, judged by the gate's rules for the "
                     "installed vLLM (a fixed bug back fails; one that cannot run its call errs)")
    g.addoption("--attnfuzz-out", type=Path, default=None, metavar="DIR",
                help="the campaigns' logs, summaries and findings (default .attnfuzz/pytest)")
    g.addoption("--attnfuzz-min-pair-coverage", type=float, default=0.0, metavar="F",
                help="fail a campaign whose cases cover less than this share of the pairs of knob categories "
                     f"(the gate's is {budgets.GATE_MIN_PAIR_COVERAGE}; default 0: none)")


@dataclass(frozen=True)
class Plan:
    """The session's campaigns, as the options ask for them."""

    specs: tuple[CampaignSpec, ...]
    replays: tuple[FindingRecord, ...]  # the reproducers replayed as items (--attnfuzz-replay)
    device: str
    out: Path
    timeout_s: float
    known: dict  # (target, signature) -> the id of the reproducer that makes it a known open bug
    repros: Path | None
    vllm: str
    min_pair_coverage: float


def plan_campaigns(config) -> Plan | None:
    """The campaigns `--attnfuzz` and the replays `--attnfuzz-replay` ask for; None without either.
    pytest.UsageError: an option that cannot be run."""
    names = [t.strip() for option in config.getoption("attnfuzz") for t in option.split(",") if t.strip()]
    replaying = config.getoption("attnfuzz_replay")
    if not names and not replaying:
        return None
    if "all" in names:
        names = [t for t in TARGETS if t not in budgets.NOT_FUZZED]
    for t in names:
        if t not in TARGETS:
            raise pytest.UsageError(f"--attnfuzz: unknown target {t!r}; known: {', '.join(TARGETS)}")
        if t in budgets.NOT_FUZZED:
            raise pytest.UsageError(f"--attnfuzz: {t} is the harness's own fault target, not fuzzed")
    targets = list(dict.fromkeys(names))
    try:
        budget = duration(config.getoption("attnfuzz_budget")) if config.getoption("attnfuzz_budget") else None
    except argparse.ArgumentTypeError as e:
        raise pytest.UsageError(f"--attnfuzz-budget: {e}") from e
    if budget is not None and budget <= 0:
        raise pytest.UsageError("--attnfuzz-budget: must be more than 0 s (a campaign that tests nothing cannot pass)")
    examples = config.getoption("attnfuzz_max_examples")
    if examples is not None and (examples < 1 or budget is not None):
        raise pytest.UsageError("--attnfuzz-max-examples: 1 or more, and not with --attnfuzz-budget")
    mutant = config.getoption("attnfuzz_inject")
    if mutant is not None and mutant not in MUTANTS:
        raise pytest.UsageError(f"--attnfuzz-inject {mutant}: not a built-in mutant ({', '.join(MUTANTS)})")
    device = config.getoption("attnfuzz_device") or host_device()
    if device == "cuda" and os.environ.get("CUDA_VISIBLE_DEVICES") == "":  # its campaigns would see no GPU
        raise pytest.UsageError("--attnfuzz-device cuda: CUDA_VISIBLE_DEVICES is empty in this pytest process (in "
                                "attnfuzz's own checkout, tests/conftest.py prepares the CPU unless "
                                "ATTNFUZZ_TEST_DEVICE=cuda)")
    repros = config.getoption("attnfuzz_repros")
    if repros is None and (ROOT / "repros").is_dir():
        repros = ROOT / "repros"
    if replaying and repros is None:
        raise pytest.UsageError("--attnfuzz-replay: no reproducers to replay (name them with --attnfuzz-repros DIR)")
    vllm = installed_vllm()  # the installed distribution's: this process never imports vLLM
    try:
        records = find_repros(repros) if repros is not None else []
        known = known_bugs(records, vllm)
    except (GateError, UsageError) as e:  # a RecordError is a UsageError
        raise pytest.UsageError(f"--attnfuzz-repros: {e}") from e
    specs, _ = gate_specs(device, {t: None for t in targets}, {t: declared(t).kv_cache_dtypes for t in targets},
                          config.getoption("attnfuzz_seed"), 1.0, targets, known_per_target(known))
    specs = [replace(s, inject=mutant, time_budget=budget, max_examples=examples or s.max_examples) for s in specs]
    return Plan(tuple(specs), tuple(records) if replaying else (), device,
                (config.getoption("attnfuzz_out") or STATE_DIR / "pytest").resolve(),
                budgets.CAMPAIGN_TIMEOUT_S[device] + (budget or 0.0), known, repros, vllm,
                config.getoption("attnfuzz_min_pair_coverage"))


_PLAN = pytest.StashKey[Plan]()
_RESULTS = pytest.StashKey[list]()
_REPLAYS = pytest.StashKey[list]()


_INJECT_BEFORE = pytest.StashKey[tuple]()


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "attnfuzz: an attnfuzz campaign (pytest --attnfuzz TARGETS)")
    if config.getoption("attnfuzz_inject"):
        config.stash[_INJECT_BEFORE] = (os.environ.get(INJECT_ENV),)
        os.environ[INJECT_ENV] = config.getoption("attnfuzz_inject")
    plan = plan_campaigns(config)
    if plan is not None:
        config.stash[_PLAN] = plan
    config.stash[_RESULTS] = []
    config.stash[_REPLAYS] = []


def pytest_unconfigure(config) -> None:
    if _INJECT_BEFORE in config.stash:  # the session's mutant ends with it (a pytester run inside another session)
        (before,) = config.stash[_INJECT_BEFORE]
        if before is None:
            os.environ.pop(INJECT_ENV, None)
        else:
            os.environ[INJECT_ENV] = before


def pytest_report_header(config) -> list[str]:
    plan = config.stash.get(_PLAN, None)
    if plan is None:
        mutant = config.getoption("attnfuzz_inject")
        return [f"attnfuzz: library checks run with the mutant {mutant} injected ({INJECT_ENV})"] if mutant else []
    spec = plan.specs[0] if plan.specs else None
    budget = (f"{spec.time_budget:g} s of search each" if spec and spec.time_budget is not None
              else "the gate's case counts" if config.getoption("attnfuzz_max_examples") is None
              else f"{spec.max_examples} cases each" if spec else "")
    campaigns = (f"{len(plan.specs)} campaign(s) on {plan.device}, vLLM {plan.vllm}, {budget}, seed "
                 f"{config.getoption('attnfuzz_seed')}" if plan.specs else f"on {plan.device}, vLLM {plan.vllm}")
    return [f"attnfuzz: {campaigns}; known open bugs: {len(set(plan.known.values()))} reproducer(s) of "
            f"{plan.repros or 'none'}" + (f"; {len(plan.replays)} reproducer(s) replayed" if plan.replays else "")
            + (f"; injected: {spec.inject}" if spec and spec.inject else "")]


def pytest_ignore_collect(collection_path, config):
    """`--attnfuzz` with no test paths named: only the campaigns (testpaths' tests are another run's)."""
    if config.stash.get(_PLAN, None) is not None and config.args_source != pytest.Config.ArgsSource.ARGS:
        return True
    return None


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect: they see the campaigns too
def pytest_collection_modifyitems(session, config, items) -> None:
    if config.stash.get(_PLAN, None) is None:
        return
    # Collected and reported as any collector is (the session's count, --collect-only, a collection error).
    collector = Campaigns.from_parent(session, name="attnfuzz", nodeid="attnfuzz")
    report = collector.ihook.pytest_make_collect_report(collector=collector)
    collector.ihook.pytest_collectreport(report=report)
    items.extend(x for x in report.result if isinstance(x, pytest.Item))


class Campaigns(pytest.Collector):
    """The session's campaigns (`attnfuzz::<campaign>`) and replays (`attnfuzz::replay[<id>]`)."""

    def collect(self):
        plan = self.config.stash[_PLAN]
        return [*(CampaignItem.from_parent(self, name=spec.name, spec=spec) for spec in plan.specs),
                *(ReplayItem.from_parent(self, name=f"replay[{r.id}]", record=r) for r in plan.replays)]


class CampaignItem(pytest.Item):
    """One campaign: run in setup (one that could not test is an error there), judged in the call (a finding
    fails it)."""

    def __init__(self, *, spec: CampaignSpec, **kwargs) -> None:
        super().__init__(**kwargs)
        self.spec = spec
        self.result = None
        self.add_marker("attnfuzz")

    def setup(self) -> None:
        plan = self.config.stash[_PLAN]
        with campaign_signals():
            outcome = run_campaign(self.spec, plan.device, plan.out / self.spec.slug, plan.timeout_s)
        self.result = r = judge_campaign(outcome, plan.known, plan.min_pair_coverage)
        self.config.stash[_RESULTS].append(r)
        self.user_properties += [("target", r.target), ("kv_cache_dtype", r.kv_cache_dtype or "-"),
                                 ("device", plan.device), ("vllm", plan.vllm), ("cases", r.examples),
                                 ("search_seconds", round(r.seconds, 1)),
                                 ("emulated", ", ".join(r.emulated) or "none"), ("known", "; ".join(r.known) or "none"),
                                 ("log", str(outcome.log))]
        if r.outcome == "error":
            raise CouldNotTest(f"COULD NOT TEST {self.spec.name} (exit 2 or a time-out: says nothing about vLLM): "
                               f"{r.reason}\n  log: {outcome.log}")

    def runtest(self) -> None:
        r = self.result  # its figures are in the session's attnfuzz summary
        if r.outcome == "passed":
            return
        lines = [f"{r.name}: {r.figures}"]
        lines += [finding_text(f["path"]) for f in r.findings] or [r.reason]  # no finding: below the pair coverage
        if r.findings:
            lines.append(f"  shrink it: {shrink_command(self.spec)}")
        raise FindingFailed("\n".join(lines), r.findings, [f["path"] for f in r.findings])

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, (FindingFailed, CouldNotTest)):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"attnfuzz campaign {self.spec.name}"


class ReplayItem(pytest.Item):
    """One reproducer, replayed in setup as the gate replays it (one that could not run its call is an error there,
    one not runnable on this host skipped), judged in the call by the gate's rules (a fixed bug back fails it)."""

    def __init__(self, *, record: FindingRecord, **kwargs) -> None:
        super().__init__(**kwargs)
        self.record = record
        self.result = None
        self.add_marker("attnfuzz")

    def setup(self) -> None:
        plan = self.config.stash[_PLAN]
        self.result = r = replay(self.record, plan.device, plan.vllm, {t: None for t in TARGETS},
                                 plan.out / "repro-logs", budgets.REPRO_TIMEOUT_S[plan.device])
        self.config.stash[_REPLAYS].append(r)
        self.user_properties += [("target", r.target), ("status", r.status), ("expected", r.expected),
                                 ("outcome", r.outcome), ("returncode", "-" if r.outcome == "skipped" else
                                                          "timeout" if r.returncode is None else r.returncode),
                                 ("device", plan.device), ("vllm", plan.vllm), ("seconds", round(r.seconds, 1)),
                                 ("emulated", ", ".join(r.emulated) or "none"),
                                 ("log", str(plan.out / "repro-logs" / f"{r.id}.log"))]
        if r.outcome == "skipped":
            pytest.skip(f"replay {r.id}: {r.detail}")
        if r.outcome == "broken":
            raise CouldNotTest(f"COULD NOT TEST replay {r.id} ({r.target}): {r.detail}\n  repro: {r.path}/repro.py\n"
                               f"  log: {plan.out / 'repro-logs' / f'{r.id}.log'}\n{r.log}")

    def runtest(self) -> None:
        r = self.result
        if r.outcome in PASSING:
            return
        raise FindingFailed(f"replay {r.id} ({r.target}): {r.detail}\n  reproducer: cd {r.path} && python repro.py   "
                            f"# exits 1 while the bug is present\n{r.log}", None, r.path)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, (FindingFailed, CouldNotTest)):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"attnfuzz replay {self.record.id}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A campaign or a replay that could not test errs in setup: its reason, not attnfuzz's traceback."""
    report = yield
    if isinstance(item, (CampaignItem, ReplayItem)) and call.excinfo is not None and \
            isinstance(call.excinfo.value, CouldNotTest):
        report.longrepr = str(call.excinfo.value)
    return report


def finding_text(path: str) -> str:
    """A campaign's finding, as a failing library check prints one (from its saved directory)."""
    record = read_finding(Path(path))
    finding = Finding.from_record(record, Case.from_json((Path(path) / "case.json").read_text()))
    finding.has_repro = (Path(path) / "repro.py").is_file()
    return found_text(finding, path)


def shrink_command(spec: CampaignSpec) -> str:
    """The `attnfuzz run` that finds the item's finding again and shrinks it (the gate's campaigns keep the first
    case they find)."""
    return " ".join(["attnfuzz", "run", "--target", spec.target, "--seed", str(spec.seed),
                     *(("--time-budget", f"{spec.time_budget:g}s") if spec.time_budget is not None
                       else ("--max-examples", str(spec.max_examples))),
                     *(("--kv-cache-dtype", spec.kv_cache_dtype) if spec.kv_cache_dtype else ()),
                     *(("--inject", spec.inject) if spec.inject else ())])


@contextmanager
def campaign_signals():
    """While a campaign runs: SIGINT or SIGTERM is passed on to it (it winds down, saves what it found and writes its
    summary; fuzzer/run/campaign_process.py), a second one kills; then the session stops (KeyboardInterrupt)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in interrupt.SIGNALS}
    for s in interrupt.SIGNALS:
        signal.signal(s, lambda signum, frame: interrupt.note(signum))
    try:
        yield
    finally:
        stopped = interrupt.received()
        for s, handler in previous.items():
            signal.signal(s, handler)
        interrupt.reset()
        if stopped:
            raise KeyboardInterrupt(f"attnfuzz: a campaign was interrupted by {stopped}")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    results = config.stash.get(_RESULTS, [])
    replays = config.stash.get(_REPLAYS, [])
    api = sys.modules.get("fuzzer.api")  # the session's library checks, if any ran (never imported here)
    emulated = getattr(api, "EMULATED", {}) if api is not None else {}
    if not results and not replays and not emulated:
        return
    terminalreporter.section("attnfuzz")
    for r in results:
        terminalreporter.line(f"{r.name}: {r.outcome}, {r.figures}" + (f": {r.reason}" if r.reason else ""))
    for r in replays:
        terminalreporter.line(f"replay {r.id}: {r.outcome} ({r.seconds:.1f} s): {r.detail}")
    for target, ops in sorted(emulated.items()):
        terminalreporter.line(f"library checks on {target} ran on stand-ins for ops this host lacks (emulated): "
                              f"{', '.join(sorted(ops))}")
