"""`attnfuzz run`: one campaign against one target (or, with --workers, a fleet of them)."""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace
from pathlib import Path

from fuzzer.artifacts.campaign_report import render, write_campaign
from fuzzer.artifacts.repro import write_repro
from fuzzer.env import STATE_DIR, host_info
from fuzzer.errors import ExitCode, HarnessError, UsageError, WorkerError
from fuzzer.mutants import MutantError, inject
from fuzzer.records import RunSummary
from fuzzer.run import fleet
from fuzzer.run.compute_sanitizer import SanitizerUnavailable, check_driver, find_compute_sanitizer
from fuzzer.run.executors import AutoSanitizedExecutor, InProcessExecutor
from fuzzer.run.host import import_vllm, make_target
from fuzzer.run.worker import SANITIZED_RECYCLE_AFTER, WorkerExecutor, WorkerSpec
from fuzzer.search.campaign import Campaign
from fuzzer.search.database import example_database
from fuzzer.search.progress import Progress
from strategies.profiles import PROFILES


def duration(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use e.g. 90s, 10m, 8h)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def add_parser(sub) -> None:
    r = sub.add_parser("run", help="run a campaign against one target")
    r.add_argument("--target", required=True)
    r.add_argument("--seed", type=int, default=0)
    g = r.add_mutually_exclusive_group()
    g.add_argument("--max-examples", type=int, default=None)
    g.add_argument("--time-budget", type=duration, default=None, metavar="D")
    r.add_argument("--inject", metavar="NAME_OR_FILE", help="a built-in mutant or a Python file to run first")
    r.add_argument("--kv-cache-dtype", default=None, help="draw only this kv_cache_dtype (backend targets)")
    r.add_argument("--profile", default=None, help="case sizes: cpu or gpu (default: the device's)")
    r.add_argument("--json", type=Path, metavar="PATH", help="write a JSON summary here")
    r.add_argument("--out", type=Path, metavar="DIR", help="campaign directory: campaign.json (coverage, margins, "
                   "every case), its findings, report.md and report.html")
    r.add_argument("--repros", type=Path, default=Path("repros"), help="where findings are saved")
    r.add_argument("--quiet", action="store_true")
    r.add_argument("--isolation", choices=("worker", "none"), default="worker",
                   help="worker (default): cases run in a worker process that a crash or hang cannot take the "
                        "campaign down with; none: in this process")
    r.add_argument("--sanitizer", choices=("memcheck", "initcheck", "racecheck", "synccheck", "auto"), default=None,
                   help="run every case under compute-sanitizer with this tool; auto: run natively and re-run "
                        "under memcheck each failing case, each new path and a 5%% sample (GPU; worker isolation)")
    r.add_argument("--case-timeout", type=duration, default=300.0, metavar="D",
                   help="watchdog: a case with no result after this long is a hang (default 300s)")
    r.add_argument("--no-shrink", action="store_true",
                   help="keep each finding's first case (when every failing case costs a worker restart)")
    r.add_argument("--reruns", type=int, default=3, help="re-runs of each finding to tell flaky ones (default 3)")
    r.add_argument("--max-findings", type=int, default=None, metavar="N",
                   help="stop searching once N distinct findings are made (a pre-merge check, a self-test)")
    r.add_argument("--workers", type=fleet.parse_workers, default=None, metavar="N|auto",
                   help="run N campaigns (auto: one per GPU; 1 on a CPU) with seeds S, S+1, ... on one example "
                        "database, and merge their findings, deduplicated across workers, runs and hosts")
    r.add_argument("--db", metavar="PATH|redis://host:port/n", default=None,
                   help="Hypothesis's example database (default .attnfuzz/examples): a directory on a shared "
                        "filesystem or a Redis server shares failures between workers and hosts")


def main(args, device: str) -> int:

    if args.workers is not None:  # a fleet: this process runs none of the cases
        return fleet.run_fleet(args, device)
    import_vllm()
    target = make_target(args.target, device)  # detects the release's API before any mutant patches it
    if args.kv_cache_dtype:
        if args.kv_cache_dtype not in target.kv_cache_dtypes:
            raise UsageError(f"--kv-cache-dtype {args.kv_cache_dtype}: {target.name} takes "
                             f"{', '.join(target.kv_cache_dtypes) or 'no kv cache'}")
        target.kv_cache_dtypes = (args.kv_cache_dtype,)
    label = None
    if args.inject:
        try:
            label = inject(args.inject)
        except (MutantError, RuntimeError) as e:
            raise UsageError(str(e)) from e
    profile_name = args.profile or ("gpu" if device == "cuda" else "cpu")
    if profile_name not in PROFILES:
        raise UsageError(f"unknown profile {profile_name!r}; known: {', '.join(PROFILES)}")
    max_examples = args.max_examples if args.max_examples is not None or args.time_budget else 100
    if args.max_findings is not None and args.max_findings < 1:
        raise UsageError(f"--max-findings {args.max_findings}: must be 1 or more")
    host = host_info(device)
    campaign = Campaign(target, PROFILES[profile_name], host, executor=executor_for(args, target, device),
                        seed=args.seed, max_examples=max_examples, time_budget=args.time_budget, inject=label,
                        progress=Progress(target.name, args.quiet), pending=args.repros / ".pending",
                        journal=STATE_DIR / "journal" / f"{target.name}.json", reruns=args.reruns,
                        shrink=not args.no_shrink, database=example_database(args.db),
                        max_findings=args.max_findings)
    try:
        result = campaign.run()
    except HarnessError as e:
        print(f"attnfuzz: harness error (a bug in attnfuzz, not in vLLM):\n{e}", file=sys.stderr)
        return ExitCode.USAGE
    except WorkerError as e:
        raise UsageError(str(e)) from e
    saved = [write_repro(f, target, args.repros) for f in result.findings]
    campaign.clear_pending()
    print_summary(result, saved, host)
    if args.json:
        summary_of(args, result, saved, host, label, profile_name, target).write(args.json)
    if args.out:  # the campaign directory (campaign.json, findings) and its report.md / report.html
        write_campaign_dir(args, result, saved, host, label, profile_name, target, max_examples)
    return ExitCode.FOUND if result.findings else ExitCode.CLEAN


def executor_for(args, target, device: str):
    """Where the campaign's cases run (fuzzer/run/executors.py, fuzzer/run/worker.py)."""

    if args.sanitizer:
        if device != "cuda":
            raise UsageError("--sanitizer needs a GPU (on CPU every interpreted load and store is bounds-checked)")

        try:
            find_compute_sanitizer()
            check_driver()
        except SanitizerUnavailable as e:
            raise UsageError(str(e)) from e
    elif args.isolation == "none":
        return InProcessExecutor(target)
    spec = WorkerSpec(target.name, device, inject=args.inject, kv_cache_dtypes=tuple(target.kv_cache_dtypes) or None,
                      sanitizer=None if args.sanitizer == "auto" else args.sanitizer, case_timeout=args.case_timeout,
                      recycle_after=SANITIZED_RECYCLE_AFTER if args.sanitizer not in (None, "auto") else 0)
    logs = STATE_DIR / "workers" / target.name
    if args.sanitizer == "auto":
        return AutoSanitizedExecutor(WorkerExecutor(spec, logs / "native"),
                                     WorkerExecutor(replace(spec, sanitizer="memcheck", case_timeout=args.case_timeout * 10,
                                                            recycle_after=SANITIZED_RECYCLE_AFTER),
                                                    logs / "memcheck"), seed=args.seed)
    return WorkerExecutor(spec, logs)


def summary_of(args, result, saved, host, label, profile_name, target):

    return RunSummary(
        target=result.target, seed=args.seed, inject=label, profile=profile_name,
        kv_cache_dtypes=list(target.kv_cache_dtypes), examples=result.examples, seconds=round(result.seconds, 2),
        cases_per_second=round(result.rate, 2), isolation=args.isolation, sanitizer=args.sanitizer,
        workers_started=result.workers_started, checks=result.checks,
        # Which compiled ops were attnfuzz's stand-ins is known once cases ran (in the workers): every result says it.
        host=dict(host.to_dict(), emulated_ops=sorted(result.cases.emulated)),
        emulated=dict(result.cases.emulated), real=dict(result.cases.real),
        allocator_poisoned=result.cases.allocator_poisoned,  # cases (ATTNFUZZ_POISON_ALLOCATOR=1, CUDA)
        findings=[dict(f.to_dict(), path=str(p)) for f, p in zip(result.findings, saved)])


def print_summary(result, saved, host) -> None:
    from rich.console import Console

    console = Console()
    console.print(f"{result.target}: {result.examples} cases in {result.seconds:.1f} s "
                  f"({result.rate:.1f}/s) on {host.device}, vLLM {host.vllm}: {len(result.findings)} finding(s)")
    for f, path in zip(result.findings, saved):
        classes = ",".join(sorted({v.bug_class for v in f.verdicts if v.bug_class})) or "-"
        again = "" if f.reruns is None else (f", FLAKY: came back {f.reruns[0]} of {f.reruns[1]} re-runs" if f.flaky
                                             else f", reproduced {f.reruns[0]}/{f.reruns[1]}")
        console.print(f"[bold red]FOUND[/] {path}  class {classes}, after {f.examples_to_find} cases "
                      f"({f.seconds_to_find:.1f} s){again}\n  case: {f.case.summary()}\n  {f.title}", highlight=False)


def write_campaign_dir(args, result, saved: list[Path], host, inject: str | None, profile: str, target,
                       max_examples: int | None) -> tuple[Path, Path]:
    """`attnfuzz run --out DIR`: the campaign directory, then its report (paths printed)."""

    options = {"max_examples": None if args.time_budget else max_examples, "time_budget": args.time_budget,
               "kv_cache_dtypes": list(target.kv_cache_dtypes), "isolation": args.isolation,
               "sanitizer": args.sanitizer, "reruns": args.reruns, "shrink": not args.no_shrink}
    write_campaign(args.out, result, host=host, seed=args.seed, inject=inject, profile=profile, options=options,
                   findings_saved=saved)
    md, page = render(args.out)
    print(f"campaign directory {args.out}: {md.name}, {page.name}")
    return md, page
