"""`attnfuzz selftest`: does attnfuzz still find the bugs it was built to find, and nothing else?

Every built-in mutant (fuzzer/mutants/) runs on every one of its TARGETS that this host runs, one fixed-seed
campaign each that stops at its first finding (at most budgets.SELFTEST_MUTANT_CAP cases; --reruns 1,
--no-shrink); it is found when one of the campaign's findings carries the
mutant's BUG_CLASS. Then one clean campaign per target (every kv-cache dtype drawn) must find nothing.
A mutant campaign whose findings carry other classes only is "found-as-other": the bug was detected (the clean
run of that target, same seed and budget, finds nothing), but the oracle named its symptom differently from
the mutant's declared cause (a class-B stale index read seen as NaN, class I); it passes unless
--strict-classes. A target this host or release cannot run is skipped with its reason. Known open bugs (the
reproducers under --repros, default repros/, whose bug is expected present on this release, as the gate reads
them) are passed to their target's campaigns as `run --known`: counted, not findings, so that neither a clean
run fails nor a mutant's campaign stops on them (each row lists the hits). Exit 1 when a mutant
is missed on any of its targets, a clean run reports a finding, or a campaign breaks; 0 otherwise; 2 on usage
errors (arguments, the reproducers' records and the output paths are checked before anything runs) and when no
campaign is left to run here; 3 when interrupted (SIGINT, SIGTERM: the campaigns running wind down, every output
says so and lists what did not run; a failure seen before the signal is still exit 1).
(Not the `selftest.fault` target: that one tests crash isolation and fails on purpose.)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fuzzer import budgets, interrupt
from fuzzer.artifacts.junit import JUnitCase, JUnitSuite, write_junit
from fuzzer.commands.gate import find_repros, known_signature, target_list, vllm_imported
from fuzzer.commands.outputs import check_outputs
from fuzzer.commands.run import host_after_interrupt
from fuzzer.env import STATE_DIR, host_info, installed_vllm
from fuzzer.errors import GateError, Interrupted, RecordError, UsageError
from fuzzer.mutants import MUTANTS, load, unavailable_on
from fuzzer.run.campaign_process import CampaignOutcome, CampaignSpec, campaign_figures, run_campaigns
from fuzzer.run.host import host_targets
from fuzzer.targets.registry import TARGETS

# Time to find is the measure here: findings are kept as first seen (shrinking is tested elsewhere).
NO_SHRINK = ("--no-shrink",)
STOP_AT_FIRST = ("--max-findings", "1")  # a mutant campaign has done its job once it finds something
VERDICTS = {"found": "passed", "found-as-other": "passed", "clean": "passed", "skipped": "skipped",
            "missed": "failed", "false-finding": "failed", "error": "error",
            "interrupted": "skipped"}  # cut short or not run: the selftest had a signal (its own JUnit error says so)


@dataclass
class SelftestRow:
    mutant: str | None  # None: a clean run
    bug_class: str  # the mutant's BUG_CLASS ("" for a clean run)
    target: str
    verdict: str  # found | found-as-other | missed | clean | false-finding | error | skipped | interrupted
    examples_to_find: int | None = None
    seconds_to_find: float | None = None
    examples: int = 0  # the campaign's cases (a mutant's campaign stops at its first finding)
    seconds: float = 0.0
    wall_seconds: float = 0.0  # the campaign's process, vLLM imports included
    found_classes: list[str] = field(default_factory=list)
    emulated: list[str] = field(default_factory=list)  # ops attnfuzz's stand-ins served (the host lacked them)
    reason: str = ""

    @property
    def name(self) -> str:
        return f"{self.mutant} on {self.target}" if self.mutant else f"clean {self.target}"

    @property
    def ok(self) -> bool:
        return VERDICTS[self.verdict] in ("passed", "skipped")


def cut_short(o: CampaignOutcome, interrupted: str | None) -> str | None:
    """Why `o` has no verdict: the selftest had a signal and the campaign did not end with a result."""
    if interrupted and o.returncode not in (0, 1):
        return f"cut short after {(o.summary or {}).get('examples', 0)} cases: the selftest was interrupted by {interrupted}"
    return None


def judge_mutant(mutant: str, bug_class: str, o: CampaignOutcome, interrupted: str | None = None) -> SelftestRow:
    s = o.summary or {}
    row = SelftestRow(mutant, bug_class, o.spec.target, "missed", examples=s.get("examples", 0),
                      seconds=s.get("seconds", 0.0), wall_seconds=round(o.wall_seconds, 1),
                      found_classes=sorted({c for f in o.findings for c in f.get("bug_classes", [])}),
                      emulated=o.emulated)
    if why := cut_short(o, interrupted):
        row.verdict, row.reason = "interrupted", why
        return row
    if o.error:
        row.verdict, row.reason = "error", o.error
        return row
    hit = o.first_with_class(bug_class)
    if hit:
        row.verdict = "found"
    elif o.findings:
        hit = min(o.findings, key=lambda f: f.get("examples_to_find", 0))
        row.verdict = "found-as-other"
        row.reason = (f"detected, but as class {', '.join(row.found_classes)}, not {bug_class}" if row.found_classes
                      else f"detected, by {len(o.findings)} finding(s) without a class, not {bug_class}")
    else:
        row.reason = f"no finding in {row.examples} cases"
    if hit:
        row.examples_to_find, row.seconds_to_find = hit.get("examples_to_find"), hit.get("seconds_to_find")
    return row


def judge_clean(o: CampaignOutcome, interrupted: str | None = None) -> SelftestRow:
    s = o.summary or {}
    row = SelftestRow(None, "", o.spec.target, "clean", examples=s.get("examples", 0), seconds=s.get("seconds", 0.0),
                      wall_seconds=round(o.wall_seconds, 1),
                      found_classes=sorted({c for f in o.findings for c in f.get("bug_classes", [])}),
                      emulated=o.emulated)
    if why := cut_short(o, interrupted):
        row.verdict, row.reason = "interrupted", why
    elif o.error:
        row.verdict, row.reason = "error", o.error
    elif o.findings:
        row.verdict = "false-finding"
        row.reason = "; ".join(f"{f.get('signature')} ({f.get('path')})" for f in o.findings)
    elif s.get("known_hits"):
        row.reason = "known open bugs hit (not findings): " + ", ".join(
            f"{sig} x{n}" for sig, n in sorted(s["known_hits"].items()))
    return row


def known_open_bugs(repros: Path, vllm_version: str) -> dict[str, tuple[str, ...]]:
    """target -> signatures of the reproducers under `repros` whose bug is expected present on this release (on
    their own target, those built over it and those running it side by side: `known_signature`)."""
    if not repros.is_dir():
        return {}
    known: dict[str, tuple[str, ...]] = {}
    for rec in find_repros(repros):
        for target in TARGETS if rec.expects_bug(vllm_version) else ():
            if sig := known_signature(rec.target, rec.signature, target, rec.needs):
                known[target] = tuple(sorted({*known.get(target, ()), sig}))
    return known


def plan(device: str, unavailable: dict[str, str | None], seed: int, scale: float, mutants: list[str] | None = None,
         clean: bool = True, targets: list[str] | None = None,
         known: dict[str, tuple[str, ...]] | None = None) -> tuple[list[tuple[str | None, str, CampaignSpec]],
                                                                  list[SelftestRow]]:
    """(mutant, bug class, spec) per campaign to run (mutant None: clean run), and the rows already skipped;
    `mutants` and `targets` narrow it; `known`: each target's known open bugs' signatures (`run --known`)."""

    def known_args(target: str) -> tuple[str, ...]:
        return tuple(a for sig in (known or {}).get(target, ()) for a in ("--known", sig))

    runs, skipped = [], []
    for name in mutants or MUTANTS:
        mod = load(name)
        for target in mod.TARGETS:
            if targets and target not in targets:
                continue
            why = unavailable.get(target, f"unknown target {target}") or unavailable_on(mod, device)
            if why:
                skipped.append(SelftestRow(name, mod.BUG_CLASS, target, "skipped", reason=why))
            else:
                # Stops at its first finding: the cap only costs where a mutant is missed.
                cap = max(budgets.examples(device, target, "selftest", scale),
                          max(1, round(budgets.SELFTEST_MUTANT_CAP * scale)))
                spec = CampaignSpec(target, cap, seed, inject=name, reruns=1,
                                    extra=NO_SHRINK + STOP_AT_FIRST + known_args(target))
                runs.append((name, mod.BUG_CLASS, spec))
    if clean:
        for target, why in unavailable.items():
            if target in budgets.NOT_FUZZED or (targets and target not in targets):
                continue
            if why:
                skipped.append(SelftestRow(None, "", target, "skipped", reason=why))
            else:
                runs.append((None, "", CampaignSpec(target, budgets.examples(device, target, "selftest", scale), seed,
                                                    reruns=1, extra=NO_SHRINK + known_args(target))))
    return runs, skipped


def failures(rows: list[SelftestRow], strict_classes: bool = False) -> list[SelftestRow]:
    return [r for r in rows if not r.ok or (strict_classes and r.verdict == "found-as-other")]


def markdown_table(rows: list[SelftestRow]) -> str:
    lines = ["| mutant (class) | target | result | found after (cases / s) | classes found | campaign cases / s | "
             "process s | stand-ins | note |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        found = f"{r.examples_to_find} / {r.seconds_to_find:.1f}" if r.examples_to_find is not None else "-"
        who = f"`{r.mutant}` ({r.bug_class})" if r.mutant else "clean run"
        lines.append(f"| {who} | `{r.target}` | {r.verdict} | {found} | {', '.join(r.found_classes) or '-'} | "
                     f"{r.examples} / {r.seconds:.1f} | "
                     f"{r.wall_seconds:.0f} | {', '.join(r.emulated) or '-'} | {r.reason.replace('|', '/')[:200]} |")
    return "\n".join(lines)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("selftest", help="every built-in mutant must be found, clean runs must find nothing")
    p.add_argument("--mutant", action="append", default=None, metavar="NAME", help="only this mutant (repeatable)")
    p.add_argument("--targets", default=None, help="comma-separated: only campaigns on these targets")
    p.add_argument("--no-clean", action="store_true", help="skip the clean runs")
    p.add_argument("--strict-classes", action="store_true",
                   help="a mutant detected only under another bug class than its own counts as missed")
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every campaign's budget (fuzzer/budgets.py)")
    p.add_argument("--seed", type=int, default=budgets.SELFTEST_SEED)
    p.add_argument("--repros", type=Path, default=Path("repros"),
                   help="known open bugs: reproducers here whose bug is expected present on this release are passed "
                        "to their target's campaigns as --known (default repros/)")
    p.add_argument("--jobs", type=int, default=None, help="campaigns at a time (default 2: a campaign keeps about one core busy, its process and its worker taking turns)")
    p.add_argument("--out", type=Path, default=None, help="campaign summaries and logs (default .attnfuzz/selftest)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the rows as JSON here")
    p.add_argument("--junit", type=Path, metavar="PATH", help="write JUnit XML here")
    p.add_argument("--markdown", type=Path, metavar="PATH", help="write the table as Markdown here")


def check_arguments(args: argparse.Namespace, out: Path) -> None:
    """What the selftest refuses before vLLM loads and before any campaign runs (GateError, UsageError: exit 2)."""
    for m in args.mutant or ():
        if m not in MUTANTS:
            raise GateError(f"--mutant {m!r} is not a built-in mutant; known: {', '.join(MUTANTS)}")
    if not math.isfinite(args.budget_scale) or args.budget_scale <= 0:
        raise GateError(f"--budget-scale {args.budget_scale}: must be a finite number more than 0 (it multiplies "
                        f"every campaign's budget)")
    if args.jobs is not None and args.jobs < 1:
        raise GateError(f"--jobs {args.jobs}: must be 1 or more")
    for t in target_list(args.targets) or ():
        if t not in TARGETS:
            raise GateError(f"--targets: unknown target {t!r}; known: {', '.join(TARGETS)}")
    check_outputs(files={"--markdown": args.markdown, "--json": args.json, "--junit": args.junit}, dirs={"--out": out})
    if args.repros.is_dir():
        find_repros(args.repros)  # a malformed record is named now, not after vLLM's import


def main(args: argparse.Namespace, device: str) -> int:

    start = time.monotonic()
    out = args.out or STATE_DIR / "selftest"
    try:
        check_arguments(args, out)
    except (GateError, UsageError) as e:  # a RecordError is a UsageError
        print(f"attnfuzz selftest: {e}", file=sys.stderr)
        return 2
    targets = target_list(args.targets)
    vllm_version, host, stopped = installed_vllm(), None, None
    runs: list[tuple[str | None, str, CampaignSpec]] | None = None  # None: not planned (the signal came first)
    rows: list[SelftestRow] = []
    try:  # vLLM's import: a signal raises Interrupted here (fuzzer/interrupt.py)
        vllm_version = vllm_imported("selftest")
        if vllm_version is None:
            return 2
        unavailable, _ = host_targets(device)
        try:
            known = known_open_bugs(args.repros, vllm_version)
        except (GateError, RecordError) as e:
            print(f"attnfuzz selftest: {e}", file=sys.stderr)
            return 2
        runs, skipped = plan(device, unavailable, args.seed, args.budget_scale, args.mutant, not args.no_clean,
                             targets, known)
        host = host_info(device)
        print(f"attnfuzz selftest on {device} ({host.device_name}), vLLM {vllm_version}: {len(runs)} campaigns, "
              f"{len(skipped)} skipped", flush=True)
        if not runs:
            for r in skipped:
                print(f"  {r.name}: skipped ({r.reason})")
            print("attnfuzz selftest: no campaign to run here (every one selected is skipped): nothing would be "
                  "tested", file=sys.stderr)
            return 2
        by_spec = {spec: (mutant, cls) for mutant, cls, spec in runs}

        def judge(o: CampaignOutcome) -> SelftestRow:
            mutant, cls = by_spec[o.spec]
            return judge_mutant(mutant, cls, o, interrupt.received()) if mutant else judge_clean(o, interrupt.received())

        def report(o: CampaignOutcome) -> None:
            r = judge(o)
            found = f" after {r.examples_to_find} cases ({r.seconds_to_find:.1f} s)" if r.examples_to_find is not None else ""
            figures = campaign_figures(r.examples, r.seconds, r.wall_seconds, r.emulated)
            print(f"  {r.name}: {r.verdict}{found}; {figures}{': ' + r.reason if r.reason else ''}", flush=True)

        jobs = args.jobs or 2
        # A signal here is passed on to the campaigns running (they wind down) and starts no more.
        outcomes = run_campaigns([spec for _, _, spec in runs], device, out, budgets.CAMPAIGN_TIMEOUT_S[device], jobs,
                                 report)
        rows = [judge(o) for o in outcomes] + skipped
        for r in skipped:
            print(f"  {r.name}: skipped ({r.reason})")
    except Interrupted as e:
        stopped = e.signal
    stopped = interrupt.settle(stopped)
    if stopped:  # what did not run to its end is listed as interrupted: no output reads as a finished selftest
        why = f"not run to its end: the selftest was interrupted by {stopped}"
        done = {(r.mutant, r.target) for r in rows}
        rows += [SelftestRow(mutant, cls, spec.target, "interrupted", reason=why) for mutant, cls, spec in runs or ()
                 if (mutant, spec.target) not in done]
        host = host or host_after_interrupt(device)
    bad = failures(rows, args.strict_classes)
    seconds = time.monotonic() - start
    table = markdown_table(rows)
    cut = (f"{sum(r.verdict == 'interrupted' for r in rows)} campaign(s) not run to their end"
           + ("" if runs is not None else ", the campaigns never planned") if stopped else "")
    print(table)
    properties = {"device": device, "device_name": host.device_name, "vllm": vllm_version, "seed": str(args.seed),
                  "budget_scale": str(args.budget_scale)}
    if stopped:
        properties["interrupted"] = stopped
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text((f"**INTERRUPTED by {stopped}**: {cut}.\n\n" if stopped else "") + table + "\n")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"passed": not bad and not stopped, "seconds": round(seconds, 1), **properties,
                                         "interrupted": bool(stopped), "interrupted_by": stopped,
                                         "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    if args.junit:
        cases = [JUnitCase(r.name, "failed" if r in bad and r.ok else VERDICTS[r.verdict], r.wall_seconds,
                           message=r.reason or r.verdict, details=r.reason,
                           stdout=f"{r.verdict}: {r.reason}".strip(": ") if r.ok else "") for r in rows]
        if stopped:  # an error of its own: CI must never read a cut-short selftest as green
            cases.append(JUnitCase("interrupted", "error", message=f"the selftest was interrupted by {stopped}: {cut}"))
        write_junit([JUnitSuite("selftest", cases, properties)], args.junit, "attnfuzz-selftest")
    mutants = [r for r in rows if r.mutant and r.verdict != "skipped"]
    cleans = [r for r in rows if not r.mutant and r.verdict != "skipped"]
    verdict = "FAILED" if bad else "PASSED"
    if stopped:
        verdict = f"FAILED (and INTERRUPTED by {stopped})" if bad else f"INTERRUPTED by {stopped}"
    print(f"selftest {verdict} in {seconds:.0f} s: "
          f"{sum(r.verdict == 'found' for r in mutants)}/{len(mutants)} mutant campaigns found their bug under its class, "
          f"{sum(r.verdict == 'found-as-other' for r in mutants)} under another, "
          f"{sum(r.verdict == 'clean' for r in cleans)}/{len(cleans)} clean runs clean"
          + (f"; {cut}" if stopped else ""), flush=True)
    return 1 if bad else 3 if stopped else 0
