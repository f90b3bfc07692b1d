"""`attnfuzz gate`: the CI gate. Replays every reproducer in `repros/`, then runs a fixed-seed, fixed-budget
campaign on every target this host runs (one per kv-cache dtype); writes JUnit XML and a JSON summary.

Reproducer status (each `repros/<id>/finding.json`):
  "status": "open" | "fixed"    is the bug still in the newest release checked?
  "releases": {"0.26.0": "present", "0.33.0": "absent"}    what repro.py did on each release (optional)
The installed release's record decides what the replay should show; a release with no record follows the
status (open: present, fixed: absent). The release a finding was made on counts as "present" unless recorded
otherwise (a fresh finding of `attnfuzz run` is open and needs no editing).

  bug expected | repro.py exits | outcome     | gate
  present      | 1              | known       | passes
  present      | 0              | now-passes  | passes, reported: update finding.json
  absent       | 0              | fixed       | passes
  absent       | 1              | regressed   | FAILS
  either       | other, timeout | broken      | FAILS (an error: the reproducer itself broke)
  On a release older than the one the finding was made on and not in its "releases", exit 2 (could not run its call:
  what it calls may not exist yet) is skipped, not broken; everywhere else a moved call is broken.

A finding of the gate's campaigns fails the gate, unless a reproducer expected to be present on this release
has the same signature on the same target or one built over it (`<target>.layer`): a known open bug, reported, not
failed (a signature is coarse, e.g. "output:output", so a known bug can hide a new one of the same symptom until it is
fixed).
Exit codes: 0 passed, 1 failed, 2 usage (checked before anything runs: arguments, the reproducers' records, the
output paths), 3 interrupted (SIGINT, SIGTERM: the campaigns running wind down, the JSON and JUnit say so and list
what did not run; a failure found before the signal still fails the gate, exit 1).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fuzzer import budgets, interrupt
from fuzzer.artifacts.junit import JUnitCase, JUnitSuite, write_junit
from fuzzer.commands.outputs import check_outputs
from fuzzer.commands.run import host_after_interrupt
from fuzzer.env import STATE_DIR, host_info, installed_vllm
from fuzzer.errors import GateError, Interrupted, UsageError
from fuzzer.records import FindingRecord, read_finding, release_of, verdicts_title
from fuzzer.run.campaign_process import CampaignOutcome, CampaignSpec, campaign_figures, run_campaigns
from fuzzer.run.host import host_targets, import_vllm
from fuzzer.targets.registry import REGISTERED, TARGETS, declared

# A finding is kept as first seen: shrinking one can take a thousand cases, and the gate's time must stay bounded
# (`attnfuzz run` with the campaign's target, dtype and seed shrinks it).
NO_SHRINK = ("--no-shrink",)
# The gate fails on a campaign's first new finding, so the campaign ends there: a backend that loses the CUDA
# context on every case would otherwise cost a fresh worker per case until the campaign's timeout.
STOP_AT_FIRST = ("--max-findings", "1")
PASSING = {"known", "now-passes", "fixed"}


# -- reproducers ---------------------------------------------------------------------------------------
def replay_outcome(expects_bug: bool, returncode: int | None) -> str:
    """What one replay means (the table in this module's docstring); returncode None: timed out."""
    if returncode not in (0, 1):
        return "broken"
    present = returncode == 1
    if expects_bug:
        return "known" if present else "now-passes"
    return "regressed" if present else "fixed"


@dataclass
class ReproResult:
    id: str
    path: str
    target: str
    status: str
    expected: str  # present | absent | - (skipped)
    outcome: str  # known | now-passes | fixed | regressed | broken | skipped | interrupted (not run to its end)
    returncode: int | None = None
    seconds: float = 0.0
    detail: str = ""
    emulated: list[str] = field(default_factory=list)  # the stand-ins the reproducer said it ran on
    log: str = ""


# What a reproducer prints of the stand-ins it carried for ops this host lacks (every template that has any).
STAND_INS_LINE = re.compile(r"stand-ins for ops this host lacks: (.*)$", re.M)


def reported_stand_ins(output: str) -> list[str]:
    m = STAND_INS_LINE.search(output)
    names = m.group(1).strip() if m else "none"
    return [] if names == "none" else [n.strip() for n in names.split(",") if n.strip()]


def reached_through(found_on: str, target: str) -> bool:
    """Whether a bug found on target `found_on` is met again by `target`: the same target, or one built over it (named
    `<found_on>.<more>`: a backend's layer runs the backend's own calls)."""
    return target == found_on or target.startswith(found_on + ".")


# Targets that run other targets' backends side by side, each verdict named after its backend ("check:BACKEND:where"):
# target -> {member target: vLLM's backend name} (tests/fuzzer/commands check it against each target's BACKENDS).
SIDE_BY_SIDE = {"vllm.sparse_mla.all": {"vllm.flashmla_sparse": "FLASHMLA_SPARSE",
                                        "vllm.flashattn_sparse": "FLASH_ATTN_MLA_SPARSE",
                                        "vllm.triton_sparse": "XPU_MLA_SPARSE",
                                        "vllm.flashinfer_sparse_sm90": "FLASHINFER_MLA_SPARSE_SM90",
                                        "vllm.flashinfer_sparse_sm100": "FLASHINFER_MLA_SPARSE",
                                        "vllm.flashinfer_sparse_sm120": "FLASHINFER_MLA_SPARSE_SM120",
                                        "vllm.flashattn_sparse_fa4": "FLASH_ATTN_MLA_SPARSE_FA4",
                                        "vllm.rocm_aiter_sparse": "ROCM_AITER_MLA_SPARSE"},
                "vllm.dsv4.all": {"vllm.dsv4.flashmla": "FLASHMLA_SPARSE_DSV4",
                                  "vllm.dsv4.flashinfer": "FLASHINFER_MLA_SPARSE_DSV4",
                                  "vllm.dsv4.rocm": "ROCM_FLASHMLA_SPARSE_DSV4"},
                "vllm.dsv41.all": {"vllm.dsv41.flashmla": "FLASHMLA_SPARSE_DSV41",
                                   "vllm.dsv41.flashinfer": "FLASHINFER_MLA_SPARSE_DSV41",
                                   "vllm.dsv41.flashmla_mega": "FLASHMLA_MEGA_ATTN_DSV41",
                                   "vllm.dsv41.rocm": "ROCM_FLASHMLA_SPARSE_DSV41"}}


def known_signature(found_on: str, signature: str, target: str, needs: tuple[str, ...] = ()) -> str | None:
    """The signature a bug found on `found_on` carries when `target` meets it again, or None where it does not: on
    `found_on`, a target built over it, or one declaring (`runs_backend_of`) that it runs such a target's backend,
    provided the target reaches what the bug needs (a graph replay: a module target running FULL eagerly cannot meet
    a backend's graph bug, and a NaN of its own must not pass as that bug)."""
    if needs and target in REGISTERED and not set(needs) <= declared(target).reaches:
        return None
    also = declared(target).runs_backend_of if target in REGISTERED else ()
    if any(reached_through(found_on, t) for t in (target, *also)):
        return signature
    backend = SIDE_BY_SIDE.get(target, {}).get(found_on)
    if backend is None:
        return None
    check, _, where = signature.partition(":")
    return f"{check}:{backend}:{where}" if where else f"{check}:{backend}"


def known_bugs(records: list[FindingRecord], vllm_version: str) -> dict[tuple[str, str], str]:
    """(target, signature) -> id of the reproducer whose bug is expected present on `vllm_version`, for every
    registered target that meets that bug (`known_signature`): a campaign finding it again is not failed."""
    return {(t, sig): rec.id for rec in records if rec.expects_bug(vllm_version) for t in TARGETS
            if (sig := known_signature(rec.target, rec.signature, t, rec.needs))}


def known_per_target(known: dict[tuple[str, str], str]) -> dict[str, tuple[str, ...]]:
    """target -> the signatures of its known open bugs (`known_bugs`), as `gate_specs` passes them to `run --known`."""
    per_target: dict[str, tuple[str, ...]] = {}
    for target, sig in known:
        per_target[target] = per_target.get(target, ()) + (sig,)
    return per_target


def find_repros(root: Path) -> list[FindingRecord]:
    if not root.is_dir():
        raise GateError(f"--repros {root}: no such directory")
    return [read_finding(d) for d in sorted(root.iterdir()) if (d / "finding.json").is_file()]


def predates(vllm_version: str, record: FindingRecord) -> bool:
    """Is this release older than the one the finding was made on, and unrecorded in its `releases`?"""
    def key(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in release_of(v).split(".") if p.isdigit())

    here, made_on = release_of(vllm_version), record.host.get("vllm")
    return bool(made_on) and here not in record.releases and key(here) < key(made_on)


def replay(record: FindingRecord, device: str, vllm_version: str, unavailable: dict[str, str | None],
           logs: Path, timeout_s: float) -> ReproResult:
    """Run the reproducer (repro.py, or `attnfuzz replay` where there is none) in a fresh process."""
    base = dict(id=record.id, path=str(record.dir), target=record.target, status=record.status)
    standalone = (record.dir / "repro.py").is_file()
    made_on = record.host.get("device", "cpu")
    # A repro.py needs only torch and vLLM: it runs wherever its device is, whatever attnfuzz's target detection
    # says of this vLLM (a release that moved what the repro calls must show as broken, not as skipped).
    why = (f"made on {made_on}; this host runs {device}" if standalone and made_on == "cuda" != device else None
           if standalone else unavailable.get(record.target, f"unknown target {record.target}"))
    if why:
        return ReproResult(**base, expected="-", outcome="skipped", detail=f"not runnable here: {why}")
    expects = record.expects_bug(vllm_version)
    if standalone:
        argv = [sys.executable, "repro.py"]
    else:
        argv = [sys.executable, "-m", "fuzzer.cli", "--device", device, "replay", str(record.dir.resolve())]
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{record.id}.log"
    start = time.monotonic()
    with log.open("w") as out:
        try:
            rc: int | None = subprocess.run(argv, cwd=record.dir, stdout=out, stderr=subprocess.STDOUT,
                                            timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = None
    seconds = time.monotonic() - start
    outcome = replay_outcome(expects, rc)
    # Made on a newer release, with no record for this one: what it calls may not exist yet. Only a release the
    # finding names, or a newer one (drift), makes a reproducer that cannot run its call broken.
    older = outcome == "broken" and rc == 2 and predates(vllm_version, record)
    if older:
        outcome = "skipped"
    detail = {
        "known": f"known bug, still present on vLLM {vllm_version}: {record.title}",
        "now-passes": f"expected present on vLLM {vllm_version}, now passes: good news; record it in finding.json "
                      f"(\"releases\": {{\"{release_of(vllm_version)}\": \"absent\"}}, \"status\": \"fixed\")",
        "fixed": f"fixed on vLLM {vllm_version}, stays fixed",
        "regressed": f"REGRESSION: a fixed bug is back on vLLM {vllm_version}: {record.title}",
        "broken": f"BROKEN: the reproducer could not run its call ({'timed out' if rc is None else f'exit {rc}'}): "
                  "it says nothing about the bug",
        "skipped": f"made on vLLM {record.host.get('vllm', '?')}, no record for the older vLLM {vllm_version}, where "
                   "it could not run its call",
    }[outcome]
    if record.sanitizer and outcome == "now-passes":
        detail += f" (made under compute-sanitizer --tool {record.sanitizer}: run plainly it may not show)"
    output = log.read_text(errors="replace")
    tail = "\n".join(output.strip().splitlines()[-15:])
    if outcome in ("broken", "skipped") and (why := [ln for ln in tail.splitlines() if ln.startswith("COULD NOT RUN")]):
        detail += f"; {why[-1]}"
    emulated = reported_stand_ins(output)
    if emulated:
        detail += f" (stand-ins: {', '.join(emulated)})"
    return ReproResult(**base, expected="-" if older else "present" if expects else "absent", outcome=outcome,
                       returncode=rc,
                       seconds=seconds, detail=detail, emulated=emulated, log=tail)


# -- campaigns -----------------------------------------------------------------------------------------
@dataclass
class CampaignResult:
    name: str
    target: str
    kv_cache_dtype: str | None
    max_examples: int
    outcome: str  # passed | failed | error | skipped | interrupted (cut short or not run: the gate had a signal)
    examples: int = 0
    seconds: float = 0.0  # the campaign's own figure (cases, shrinking, re-runs)
    wall_seconds: float = 0.0  # its process, vLLM imports included
    reason: str = ""
    findings: list[dict] = field(default_factory=list)
    known: list[str] = field(default_factory=list)  # findings that are known open bugs: "<signature> (<repro id>)"
    emulated: list[str] = field(default_factory=list)  # ops attnfuzz's stand-ins served (the host lacked them)
    log: str = ""

    @property
    def figures(self) -> str:
        return campaign_figures(self.examples, self.seconds, self.wall_seconds, self.emulated)


def gate_specs(device: str, unavailable: dict[str, str | None], kv_cache_dtypes: dict[str, tuple[str, ...]],
               seed: int, scale: float, only: list[str] | None = None,
               known: dict[str, tuple[str, ...]] | None = None) -> tuple[list[CampaignSpec], list[CampaignResult]]:
    """The campaigns to run, and those skipped (target not runnable here) as results already. `known`: target ->
    signatures of its known open bugs, passed as `run --known` (hit again, they neither stop the campaign nor
    fail it)."""
    specs, skipped = [], []
    for target, why in unavailable.items():
        if target in budgets.NOT_FUZZED or (only and target not in only):
            continue
        n = budgets.examples(device, target, "gate", scale)
        for dtype in kv_cache_dtypes.get(target) or (None,):
            known_args = tuple(a for sig in (known or {}).get(target, ()) for a in ("--known", sig))
            spec = CampaignSpec(target, n, seed, kv_cache_dtype=dtype, extra=NO_SHRINK + STOP_AT_FIRST + known_args)
            if why:
                skipped.append(CampaignResult(spec.name, target, dtype, n, "skipped", reason=why))
            else:
                specs.append(spec)
    return specs, skipped


def judge_campaign(o: CampaignOutcome, known: dict[tuple[str, str], str] | None = None,
                   min_pairs: float = 0.0, interrupted: str | None = None) -> CampaignResult:
    """`known`: (target, signature) -> id of a reproducer whose bug is expected present on this release.
    `min_pairs`: the share of pairs of knob categories the campaign's cases must cover (a campaign whose cases
    stay in one corner of the space fails, however clean). `interrupted`: the signal the gate had (its campaigns
    wound down: one that did not end with a result is interrupted, not an error)."""
    known = known or {}
    s = o.summary or {}
    r = CampaignResult(o.spec.name, o.spec.target, o.spec.kv_cache_dtype, o.spec.max_examples, "passed",
                       examples=s.get("examples", 0), seconds=s.get("seconds", 0.0), wall_seconds=round(o.wall_seconds, 1),
                       emulated=o.emulated)
    if interrupted and o.returncode not in (0, 1):
        r.outcome, r.reason = "interrupted", f"cut short after {r.examples} cases: the gate was interrupted by {interrupted}"
        return r
    if o.error:
        r.outcome, r.reason, r.log = "error", o.error, o.log_tail(30)
        return r
    for sig in sorted(s.get("known_hits") or {}):  # `run --known`: hit again, counted, not saved
        r.known.append(f"{sig} ({known.get((o.spec.target, sig), 'known')})")
    for f in o.findings:
        key = (o.spec.target, f.get("signature", ""))
        if key in known:
            r.known.append(f"{key[1]} ({known[key]})")
            continue
        r.findings.append({"id": f.get("id"), "path": f.get("path"), "signature": f.get("signature"),
                           "bug_classes": f.get("bug_classes", []), "examples_to_find": f.get("examples_to_find"),
                           "title": verdicts_title(f.get("verdicts", [])) or f.get("summary", "")})
    if r.findings:
        r.outcome = "failed"
        r.reason = "; ".join(f"{f['title']} (class {','.join(f['bug_classes']) or '-'}; repro {f['path']})"
                             for f in r.findings)
    elif r.known:
        r.reason = "known open bug(s) found again: " + ", ".join(r.known)
    pairs = (s.get("coverage") or {}).get("pairs")
    if min_pairs and (pairs is None or pairs < min_pairs):
        r.outcome = "failed" if r.outcome == "passed" else r.outcome
        r.reason = "; ".join(x for x in (r.reason, f"covered {pairs if pairs is not None else 'no'} of the pairs of knob "
                                         f"categories, below --min-pair-coverage {min_pairs}") if x)
    return r


# -- reports ---------------------------------------------------------------------------------------------
def junit_suites(repros: list[ReproResult], campaigns: list[CampaignResult], properties: dict,
                 interrupted: str = "") -> list[JUnitSuite]:
    """`interrupted`: what the gate says of a signal that cut it short (an error of its own in the XML)."""
    rcases = []
    for r in repros:
        outcome = {"regressed": "failed", "broken": "error", "skipped": "skipped", "interrupted": "skipped"}.get(
            r.outcome, "passed")
        rcases.append(JUnitCase(f"{r.id} ({r.target})", outcome, r.seconds, message=r.detail,
                                details=f"{r.detail}\nrepro: {r.path}/repro.py\n\n{r.log}",
                                stdout=f"{r.outcome}: {r.detail}\n{r.log}" if outcome == "passed" else ""))
    ccases = []
    for c in campaigns:
        figures = f"{c.figures}, budget {c.max_examples}"
        message = c.reason.splitlines()[0] if c.reason else figures
        ccases.append(JUnitCase(c.name, "skipped" if c.outcome == "interrupted" else c.outcome, c.wall_seconds,
                                message=message[:500],
                                details=f"{c.reason}\n{figures}\n\n{c.log}".strip(),
                                stdout=f"{figures}\n{c.reason}".strip() if c.outcome == "passed" else ""))
    suites = [JUnitSuite("repros", rcases, properties), JUnitSuite("campaigns", ccases, properties)]
    if interrupted:  # an error of its own: CI must never read a cut-short gate as green
        suites.append(JUnitSuite("gate", [JUnitCase("interrupted", "error", message=interrupted)], properties))
    return suites


def add_parser(subparsers) -> None:
    g = subparsers.add_parser("gate", help="CI gate: replay repros/, fixed-seed campaigns on every target; JUnit + JSON")
    g.add_argument("--repros", type=Path, default=Path("repros"), help="the reproducers to replay (default repros/)")
    g.add_argument("--junit", type=Path, metavar="PATH", help="write JUnit XML here")
    g.add_argument("--json", type=Path, metavar="PATH", help="write a JSON summary here")
    g.add_argument("--out", type=Path, default=None,
                   help="campaign summaries, logs and the findings' reproducers (default .attnfuzz/gate)")
    g.add_argument("--budget-scale", type=float, default=1.0, help="multiply every campaign's budget (fuzzer/budgets.py)")
    g.add_argument("--seed", type=int, default=budgets.GATE_SEED)
    g.add_argument("--min-pair-coverage", type=float, default=budgets.GATE_MIN_PAIR_COVERAGE, metavar="F",
                   help="fail a campaign whose cases cover less than this share of the pairs of knob categories "
                        f"(default {budgets.GATE_MIN_PAIR_COVERAGE}; 0: no minimum)")
    g.add_argument("--jobs", type=int, default=None, help="campaigns (and reproducers) at a time (default 2: a campaign keeps about one core busy, its process and its worker taking turns)")
    g.add_argument("--targets", default=None, help="comma-separated: fuzz only these targets")
    g.add_argument("--no-repros", action="store_true", help="skip the replay step")
    g.add_argument("--no-campaigns", action="store_true", help="skip the campaign step")


def check_arguments(args: argparse.Namespace, out: Path) -> None:
    """What the gate refuses before vLLM loads and before anything runs (GateError, UsageError: exit 2)."""
    if not math.isfinite(args.budget_scale) or args.budget_scale <= 0:
        raise GateError(f"--budget-scale {args.budget_scale}: must be a finite number more than 0 (it multiplies "
                        f"every campaign's budget)")
    if not math.isfinite(args.min_pair_coverage) or not 0 <= args.min_pair_coverage <= 1:
        raise GateError(f"--min-pair-coverage {args.min_pair_coverage}: a share of the pairs, from 0 to 1")
    if args.jobs is not None and args.jobs < 1:
        raise GateError(f"--jobs {args.jobs}: must be 1 or more")
    if args.no_repros and args.no_campaigns:
        raise GateError("--no-repros with --no-campaigns: nothing to test (a gate that tests nothing cannot pass)")
    for t in target_list(args.targets) or ():
        if t not in TARGETS:
            raise GateError(f"--targets: unknown target {t!r}; known: {', '.join(TARGETS)}")
    check_outputs(files={"--junit": args.junit, "--json": args.json}, dirs={"--out": out})


def target_list(option: str | None) -> list[str] | None:
    return [t.strip() for t in option.split(",")] if option else None


def vllm_imported(command: str) -> str | None:
    """vLLM imported, for a command that runs campaigns: its version, or None where it cannot be (said on stderr as
    `attnfuzz <command>: ...`). A signal that came while the commands were imported raises Interrupted first."""
    interrupt.check()
    try:
        return import_vllm()
    except UsageError as e:
        print(f"attnfuzz {command}: {e}", file=sys.stderr)
        return None


def main(args: argparse.Namespace, device: str) -> int:

    start = time.monotonic()
    out = args.out or STATE_DIR / "gate"
    try:
        check_arguments(args, out)
        records = [] if args.no_repros else find_repros(args.repros)
    except (GateError, UsageError) as e:  # a RecordError is a UsageError
        print(f"attnfuzz gate: {e}", file=sys.stderr)
        return 2
    only = target_list(args.targets)
    vllm_version, host, stopped = installed_vllm(), None, None
    repro_results: list[ReproResult] = []
    campaign_results: list[CampaignResult] = []
    specs: list[CampaignSpec] | None = None  # None: not planned (the signal came first)
    try:  # vLLM's import and the reproducers: a signal raises Interrupted here (fuzzer/interrupt.py)
        vllm_version = vllm_imported("gate")
        if vllm_version is None:
            return 2
        unavailable, dtypes = host_targets(device)
        host = host_info(device)
        print(f"attnfuzz gate on {device} ({host.device_name}), vLLM {vllm_version}: {len(records)} reproducer(s)",
              flush=True)

        jobs = args.jobs or 2
        # each reproducer is a process of its own: `jobs` at a time, reported in their order
        pool = concurrent.futures.ThreadPoolExecutor(jobs)
        try:
            for r in pool.map(lambda rec: replay(rec, device, vllm_version, unavailable, out / "repro-logs",
                                                 budgets.REPRO_TIMEOUT_S[device]), records):
                repro_results.append(r)
                print(f"  repro {r.id}: {r.outcome} ({r.seconds:.1f} s) {r.detail}", flush=True)
        finally:  # a signal starts no more of them
            pool.shutdown(wait=True, cancel_futures=True)

        if not args.no_campaigns:
            known = known_bugs(records, vllm_version)
            specs, skipped = gate_specs(device, unavailable, dtypes, args.seed, args.budget_scale, only,
                                        known_per_target(known))
            for s in skipped:
                print(f"  campaign {s.name}: skipped ({s.reason})", flush=True)

            def report(o: CampaignOutcome) -> None:
                r = judge_campaign(o, known, args.min_pair_coverage, interrupt.received())
                print(f"  campaign {r.name}: {r.outcome}, {r.figures}{': ' + r.reason if r.reason else ''}", flush=True)

            # A signal here is passed on to the campaigns running (they wind down) and starts no more.
            outcomes = run_campaigns(specs, device, out / "campaigns", budgets.CAMPAIGN_TIMEOUT_S[device], jobs, report)
            campaign_results = [judge_campaign(o, known, args.min_pair_coverage, interrupt.received())
                                for o in outcomes] + skipped
    except Interrupted as e:
        stopped = e.signal
    stopped = interrupt.settle(stopped)
    if stopped:  # what did not run to its end is listed as interrupted: no output reads as a finished gate
        why = f"not run to its end: the gate was interrupted by {stopped}"
        ran = {r.id for r in repro_results}
        repro_results += [ReproResult(id=rec.id, path=str(rec.dir), target=rec.target, status=rec.status, expected="-",
                                      outcome="interrupted", detail=why) for rec in records if rec.id not in ran]
        done = {c.name for c in campaign_results}
        campaign_results += [CampaignResult(spec.name, spec.target, spec.kv_cache_dtype, spec.max_examples,
                                            "interrupted", reason=why) for spec in specs or () if spec.name not in done]
        host = host or host_after_interrupt(device)

    failed = [r for r in repro_results if r.outcome not in PASSING | {"skipped", "interrupted"}] + \
             [c for c in campaign_results if c.outcome in ("failed", "error")]
    # A gate that ran nothing to its end (every reproducer and campaign skipped here) tested nothing: never green.
    tested = any(r.outcome not in ("skipped", "interrupted") for r in repro_results) or \
        any(c.outcome not in ("skipped", "interrupted") for c in campaign_results)
    seconds = time.monotonic() - start
    not_run = (f"not run to their end: {sum(r.outcome == 'interrupted' for r in repro_results)} reproducer(s), "
               f"{sum(c.outcome == 'interrupted' for c in campaign_results)} campaign(s)"
               + ("" if specs is not None or args.no_campaigns else ", the campaigns never planned"))
    properties = {"device": device, "device_name": host.device_name, "vllm": vllm_version, "torch": host.torch,
                  "triton": host.triton, "seed": str(args.seed), "budget_scale": str(args.budget_scale)}
    if stopped:
        properties["interrupted"] = stopped
    if args.junit:
        write_junit(junit_suites(repro_results, campaign_results, properties,
                                 f"the gate was interrupted by {stopped}; {not_run}" if stopped else ""),
                    args.junit, "attnfuzz-gate")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "passed": not failed and not stopped and tested, "seconds": round(seconds, 1), **properties,
            "interrupted": bool(stopped), "interrupted_by": stopped, "seed": args.seed,
            "budget_scale": args.budget_scale, "out": str(out),
            "repros": [asdict(r) for r in repro_results], "campaigns": [asdict(c) for c in campaign_results],
        }, indent=1) + "\n")
    news = [r for r in repro_results if r.outcome == "now-passes"]
    verdict = "FAILED" if failed else "PASSED" if tested else "COULD NOT TEST (everything skipped here)"
    if stopped:
        verdict = f"FAILED (and INTERRUPTED by {stopped})" if failed else f"INTERRUPTED by {stopped}"
    print(f"gate {verdict} in {seconds:.0f} s: "
          f"{sum(r.outcome in PASSING for r in repro_results)}/{len(repro_results)} reproducers as expected"
          f"{f' ({len(news)} now pass: update their finding.json)' if news else ''}, "
          f"{sum(c.outcome == 'passed' for c in campaign_results)}/{len(campaign_results)} campaigns clean"
          f" ({sum(c.outcome == 'skipped' for c in campaign_results)} skipped){'; ' + not_run if stopped else ''}", flush=True)
    return 1 if failed else 3 if stopped else 0 if tested else 2
