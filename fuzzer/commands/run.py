"""`attnfuzz run`: one campaign against one target (or, with --workers, a fleet of them)."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

from fuzzer.artifacts.campaign_report import render, write_campaign
from fuzzer.commands.outputs import unwritable
from fuzzer.env import STATE_DIR, HostInfo, host_info, installed_vllm
from fuzzer import interrupt
from fuzzer.errors import (ExitCode, HarnessError, Interrupted, UsageError, VllmCallMoved, WorkerError,
                           WorkerInjectError, WorkerUnavailable)
from fuzzer.mutants import MUTANTS, MutantError, inject
from fuzzer.mutants import load as load_mutant
from fuzzer.records import RunSummary
from fuzzer.run import fleet
from fuzzer.run.compute_sanitizer import EAGER_ONLY, SanitizerUnavailable, check_driver, find_compute_sanitizer
from fuzzer.run.executors import AutoSanitizedExecutor, InProcessExecutor
from fuzzer.run.host import import_vllm, make_target
from fuzzer.run.worker import SANITIZED_RECYCLING, WorkerExecutor, WorkerSpec
from fuzzer.search.campaign import SEARCHES, Campaign, CampaignResult
from fuzzer.search.database import example_database, is_redis
from fuzzer.search.progress import Progress
from fuzzer.targets.base import RunPlan
from fuzzer.targets.registry import TARGETS, declared
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
    r.add_argument("--cudagraph", default=None, metavar="MODE",
                   help="draw only engines of this CUDA-graph mode: none (eager) or full (targets that replay graphs)")
    r.add_argument("--profile", default=None, help="case sizes: cpu or gpu (default: the device's)")
    r.add_argument("--max-steps", type=int, default=None, metavar="N",
                   help="steps per case for targets that run traces, the case's own included (default: the "
                        "profile's, 4; 1: single fresh steps only)")
    r.add_argument("--json", type=Path, metavar="PATH", help="write a JSON summary here")
    r.add_argument("--out", type=Path, metavar="DIR", help="campaign directory: campaign.json (coverage, margins, "
                   "every case), its findings, report.md and report.html")
    r.add_argument("--repros", type=Path, default=None,
                   help="where findings are saved (default .attnfuzz/findings; promote one into repros/ by hand)")
    r.add_argument("--quiet", action="store_true")
    r.add_argument("--isolation", choices=("worker", "none"), default="worker",
                   help="worker (default): cases run in a worker process that a crash or hang cannot take the "
                        "campaign down with; none: in this process")
    r.add_argument("--sanitizer", choices=("memcheck", "initcheck", "racecheck", "synccheck", "auto"), default=None,
                   help="run every case under compute-sanitizer with this tool; auto: run natively and re-run "
                        "under memcheck each failing case, each new path and a 5%% sample (GPU; worker isolation)")
    r.add_argument("--case-timeout", type=duration, default=300.0, metavar="D",
                   help="the watchdog's floor (default 300s): a case gets this long, or 10x the slowest recent "
                        "case if that is longer; one past it runs again on a fresh worker with 4x as long, and only "
                        "a case that hangs there too is a hang")
    r.add_argument("--no-shrink", action="store_true",
                   help="keep each finding's first case (when every failing case costs a worker restart)")
    r.add_argument("--reruns", type=int, default=3, help="re-runs of each finding to tell flaky ones (default 3)")
    r.add_argument("--max-findings", type=int, default=None, metavar="N",
                   help="stop searching once N distinct findings are made (a pre-merge check, a self-test)")
    r.add_argument("--known", action="append", default=[], metavar="SIGNATURE",
                   help="a known open bug's finding signature (repeatable): its cases are counted (the summary's "
                        "repeats), never saved or counted toward --max-findings (selftest passes repros/' open bugs)")
    r.add_argument("--search", choices=SEARCHES, default="swarm",
                   help="swarm (default): batches of cases, each under its own swarm of pinned knobs, steered to "
                        "knob combinations not yet covered; plain: the target's strategy as it is, one batch")
    r.add_argument("--workers", type=fleet.parse_workers, default=None, metavar="N|auto",
                   help="run N campaigns (auto: one per GPU; 1 on a CPU) with seeds S, S+1, ... on one example "
                        "database, and merge their findings, deduplicated across workers, runs and hosts")
    r.add_argument("--mps", action="store_true",
                   help="with --workers on a GPU: the workers share each GPU through CUDA's MPS daemon (one already "
                        "serving, else one of the fleet's own), so their kernels run side by side, not time-sliced")
    r.add_argument("--db", metavar="PATH|redis://host:port/n", default=None,
                   help="Hypothesis's example database (default .attnfuzz/examples): a directory on a shared "
                        "filesystem or a Redis server shares failures between workers and hosts")


MIN_CASE_TIMEOUT_S = 5.0  # below this every slow case (a first Triton compile, a big interpreted one) is a "hang"


def validate(args, device: str) -> None:
    """Every argument and output location checked before vLLM (or torch) is imported and before the first case
    runs: what it reads of the target is its declarations (fuzzer/targets/declared.py), not the imported class."""
    if args.target not in TARGETS:
        raise UsageError(f"unknown target {args.target!r}; known: {', '.join(TARGETS)}")
    cls = declared(args.target)
    if args.max_examples is not None and args.max_examples < 1:
        raise UsageError(f"--max-examples {args.max_examples}: must be 1 or more (a run that tests nothing "
                         f"cannot pass)")
    if args.time_budget is not None and args.time_budget <= 0:
        raise UsageError(f"--time-budget {args.time_budget:g}s: must be more than 0")
    if args.reruns < 0:
        raise UsageError(f"--reruns {args.reruns}: must be 0 or more")
    if args.max_findings is not None and args.max_findings < 1:
        raise UsageError(f"--max-findings {args.max_findings}: must be 1 or more")
    if args.case_timeout < MIN_CASE_TIMEOUT_S:
        raise UsageError(f"--case-timeout {args.case_timeout:g}s: at least {MIN_CASE_TIMEOUT_S:g}s (one case can "
                         f"take that long; a shorter watchdog reports working cases as hangs)")
    profile = args.profile or ("gpu" if device == "cuda" else "cpu")
    if profile not in PROFILES:
        raise UsageError(f"--profile {profile!r}: unknown; known: {', '.join(PROFILES)}")
    if args.max_steps is not None and args.max_steps < 1:
        raise UsageError(f"--max-steps {args.max_steps}: a case has at least its own step (1)")
    if args.kv_cache_dtype and args.kv_cache_dtype not in cls.kv_cache_dtypes:
        raise UsageError(f"--kv-cache-dtype {args.kv_cache_dtype}: {args.target} takes "
                         f"{', '.join(cls.kv_cache_dtypes) or 'no kv cache'}")
    if args.cudagraph and args.cudagraph not in cls.cudagraph_modes:
        raise UsageError(f"--cudagraph {args.cudagraph}: {args.target} takes {', '.join(cls.cudagraph_modes)}")
    if args.mps and (args.workers is None or device != "cuda"):
        raise UsageError("--mps: for --workers on a GPU (--device cuda); it shares a GPU between worker processes")
    if args.sanitizer and device != "cuda":
        raise UsageError("--sanitizer needs a GPU (on CPU every interpreted load and store is bounds-checked)")
    if args.cudagraph not in (None, "none") and every_case_sanitized(args):
        raise UsageError(f"--cudagraph {args.cudagraph} with --sanitizer {args.sanitizer}: {EAGER_ONLY}; fuzz full "
                         f"graphs natively or with --sanitizer auto (its memcheck re-runs skip graph cases)")
    if args.inject:
        if args.inject in MUTANTS:
            meant_for = load_mutant(args.inject).TARGETS
            # A target built on another (the DCP ranks on the emulated DCP step) runs the code its mutants break.
            if not any(cls.derives_from(declared(name)) for name in meant_for if name in TARGETS):
                raise UsageError(f"--inject {args.inject}: the mutant breaks {', '.join(meant_for)}; on "
                                 f"{args.target} it would change nothing")
        elif not Path(args.inject).is_file():
            raise UsageError(f"--inject {args.inject!r}: neither a built-in mutant ({', '.join(MUTANTS)}) nor a file")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out}: exists and is not a directory")
    for option, where in (("--repros", args.repros), ("--out", args.out), ("--json", args.json and args.json.parent)):
        if where is not None and (why := unwritable(Path(where))):
            raise UsageError(f"{option} {where}: cannot write there ({why})")
    if args.db is not None:  # a file, an unknown scheme, a Redis server that does not answer: here, not after start-up
        example_database(args.db)
        if not is_redis(args.db) and (why := unwritable(Path(args.db))):
            raise UsageError(f"--db {args.db}: cannot write there ({why})")


def main(args, device: str) -> int:
    if args.repros is None:  # a newcomer's findings stay out of repros/, the corpus the gate replays
        args.repros = STATE_DIR / "findings"
    validate(args, device)
    if every_case_sanitized(args) and "full" in declared(args.target).cudagraph_modes and not args.quiet:
        print(f"{args.target}: eager engines only under --sanitizer {args.sanitizer} ({EAGER_ONLY})", file=sys.stderr)
    if args.workers is not None:  # a fleet: this process runs none of the cases
        return fleet.run_fleet(args, device)
    profile_name = args.profile or ("gpu" if device == "cuda" else "cpu")
    max_examples = args.max_examples if args.max_examples is not None or args.time_budget else 100
    target = executor = campaign = label = None
    try:  # start-up (vLLM's import here or in the worker: 17-40 s): a signal raises Interrupted (fuzzer/interrupt.py)
        interrupt.check()  # one that came while the commands were imported
        in_process = args.isolation == "none" and not args.sanitizer
        if not args.quiet:  # the first line: start-up takes tens of seconds on a CPU host before any case runs
            print(f"{args.target}: starting: {'this process' if in_process else 'a worker process'} imports vLLM and "
                  f"prepares the target ({'7-20' if device == 'cuda' else '10-40'} s)", file=sys.stderr, flush=True)
        if in_process:  # the cases run here: vLLM loads here, once
            import_vllm()
            target = make_target(args.target, device)  # detects the release's API before any mutant patches it
        else:  # the cases run in a worker: it imports vLLM, checks the target and reports its plan; this process never.
            # The worker starts first: its imports (vLLM's, most of the start-up) run while this process does its own.
            executor = executor_for(args, args.target, device)
            if isinstance(executor, WorkerExecutor):
                executor.spawn()
            with interrupt.deferred():  # the target's module imports torch: a signal raised inside that can crash
                cls = TARGETS[args.target]
            interrupt.check()
            target = cls(device)
        host = host_info(device)  # imports Triton: for a worker's campaign, while the worker is still starting
        if args.inject and in_process:
            try:
                label = inject(args.inject)
            except MutantError as e:
                raise UsageError(str(e)) from e
        elif args.inject:  # applied in the worker; a file that raises is named there (a usage error, below)
            label = args.inject if args.inject in MUTANTS else str(Path(args.inject))
        if executor is None:
            executor = executor_for(args, target, device)
        if not in_process:
            try:
                ready = executor.start()
            except WorkerError as e:
                raise UsageError(worker_failure(e)) from e
            target.adopt(ready.get("plan", {}))
        profile = PROFILES[profile_name]
        if args.max_steps is not None:
            profile = replace(profile, max_steps=args.max_steps)
        campaign = Campaign(target, profile, host, executor=executor,
                            seed=args.seed, max_examples=max_examples, time_budget=args.time_budget, inject=label,
                            progress=Progress(target.name, args.quiet), pending=STATE_DIR / "pending" / target.name,
                            journal=STATE_DIR / "journal" / f"{target.name}.json", reruns=args.reruns,
                            shrink=not args.no_shrink, database=example_database(args.db),
                            max_findings=args.max_findings, search=args.search, known=tuple(args.known),
                            plan=run_plan(args))
    except Interrupted as e:  # before the first case: the outputs all say so, and exit 3
        interrupt.defer()  # a retry still pending (fuzzer/interrupt.py) must not cut these outputs short
        if executor is not None:
            abandon(executor)
        result = CampaignResult(args.target, interrupted=e.signal)
        result.startup_seconds = max(0.0, time.monotonic() - getattr(args, "started", time.monotonic()))
        target = target or TARGETS[args.target](device)
        if label is None and args.inject:
            label = args.inject if args.inject in MUTANTS else str(Path(args.inject))
        host = host_after_interrupt(device)
        campaign = None
    interrupt.defer()  # from here a signal is recorded: the campaign winds down on it; outputs are written whole
    if campaign is not None:
        try:
            result = campaign.run()
        except VllmCallMoved as e:
            print(f"attnfuzz: COULD NOT TEST {e}", file=sys.stderr)
            return ExitCode.USAGE
        except HarnessError as e:
            print(f"attnfuzz: harness error (a bug in attnfuzz, not in vLLM):\n{e}", file=sys.stderr)
            return ExitCode.USAGE
        except WorkerError as e:
            raise UsageError(str(e)) from e
        result.startup_seconds = max(0.0, campaign.started_at - getattr(args, "started", campaign.started_at))
    saved, unsaved = save_findings(result.findings, target, args.repros)
    if campaign is not None:
        campaign.clear_pending([f for f, _ in saved] + result.host_faults)
    result.interrupted = result.interrupted or interrupt.received()  # one after the search, before the outputs
    print_summary(result, saved, unsaved, host, campaign)
    findings = [f for f, _ in saved]
    if args.json:
        summary_of(args, result, saved, host, label, profile_name, target).write(args.json)
    if args.out:  # the campaign directory (campaign.json, findings) and its report.md / report.html
        write_campaign_dir(args, result, saved, host, label, profile_name, target, max_examples)
    if result.findings:
        return ExitCode.FOUND
    if result.interrupted:
        return ExitCode.INTERRUPTED
    if result.host_faults:  # cases left untested: never a clean run
        return ExitCode.USAGE
    if result.examples == 0:
        print("attnfuzz: no case ran: nothing was tested", file=sys.stderr)
        return ExitCode.USAGE
    assert not findings
    return ExitCode.CLEAN


def abandon(executor) -> None:
    """A worker still starting (importing vLLM) when the run is interrupted: killed now, not asked to stop (it
    would read the request only once its imports are done)."""
    for worker in (getattr(executor, "native", None), getattr(executor, "sanitized", None), executor):
        if isinstance(worker, WorkerExecutor):
            worker._kill()


def host_after_interrupt(device: str):
    """The host, for the outputs of a run interrupted in start-up: an import the signal cut short (torch's, Triton's
    under vLLM's) may not come back, and then the versions are the installed distributions'."""
    try:
        return host_info(device)
    except Exception:
        import platform
        from importlib.metadata import version

        def installed(name: str) -> str:
            try:
                return version(name)
            except Exception:
                return "unknown"

        return HostInfo(device, "unknown", installed_vllm(), installed("torch"), installed("triton"),
                        platform.python_version(), os.environ.get("TRITON_INTERPRET") == "1",
                        hypothesis=installed("hypothesis"))


def run_plan(args) -> RunPlan:
    """What this run narrows the target's cases to: an argument of the campaign, never set on the target. Under a
    compute-sanitizer tool, eager engines only (EAGER_ONLY says why)."""
    graphs = (args.cudagraph,) if args.cudagraph else ("none",) if every_case_sanitized(args) else None
    return RunPlan(kv_cache_dtypes=(args.kv_cache_dtype,) if args.kv_cache_dtype else None, cudagraph_modes=graphs)


def every_case_sanitized(args) -> bool:
    """Every case runs under a compute-sanitizer tool (`--sanitizer auto` runs them natively)."""
    return args.sanitizer not in (None, "auto")


def worker_failure(e: WorkerError) -> str:
    """A worker's start-up failure, told by its type: an unavailable target, an --inject that could not be applied
    (a file that raised: its file and line, in one line), or where the worker's traceback ended."""
    if isinstance(e, WorkerInjectError):
        return (e.message.strip().splitlines() or [""])[0]
    if isinstance(e, WorkerUnavailable):
        return f"worker for {e.target} is not available here: {e.why}"
    return str(e)


def save_findings(findings, target, repros: Path) -> tuple[list, list]:
    """Each finding's directory under `repros`, or under the state directory where `repros` cannot take it;
    a finding neither can take stays pending (and is listed)."""
    from fuzzer.artifacts.repro import write_repro  # deferred: it imports torch (seconds); argument errors come first

    saved, unsaved = [], []
    for f in findings:
        for root in dict.fromkeys((Path(repros), STATE_DIR / "findings")):
            try:
                path = write_repro(f, target, root)
            except OSError as e:
                print(f"attnfuzz: cannot save {f.id} under {root}: {e.strerror or e}", file=sys.stderr)
                continue
            if root != Path(repros):
                print(f"attnfuzz: {f.id} saved under {root} instead", file=sys.stderr)
            saved.append((f, path))
            break
        else:
            unsaved.append(f)
    return saved, unsaved


def executor_for(args, target, device: str):
    """Where the campaign's cases run (fuzzer/run/executors.py, fuzzer/run/worker.py). `target`: the target, or for
    cases run in a worker process only its name (the worker makes its own)."""
    name = target if isinstance(target, str) else target.name

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
    spec = WorkerSpec(name, device, inject=args.inject,
                      sanitizer=None if args.sanitizer == "auto" else args.sanitizer, case_timeout=args.case_timeout,
                      **(SANITIZED_RECYCLING if every_case_sanitized(args) else {}))
    logs = STATE_DIR / "workers" / name
    if args.sanitizer == "auto":
        return AutoSanitizedExecutor(WorkerExecutor(spec, logs / "native"),
                                     WorkerExecutor(replace(spec, sanitizer="memcheck", case_timeout=args.case_timeout * 10,
                                                            **SANITIZED_RECYCLING),
                                                    logs / "memcheck"), seed=args.seed)
    return WorkerExecutor(spec, logs)


def summary_of(args, result, saved, host, label, profile_name, target) -> RunSummary:
    return RunSummary(
        target=result.target, seed=args.seed, inject=label, profile=profile_name,
        kv_cache_dtypes=list(run_plan(args).kv_dtypes(target)), examples=result.examples,
        seconds=round(result.seconds, 2), cases_per_second=round(result.rate, 2), isolation=args.isolation,
        sanitizer=args.sanitizer,
        workers_started=result.workers_started, checks=result.checks,
        # Which compiled ops were attnfuzz's stand-ins is known once cases ran (in the workers): every result says it.
        host=dict(host.to_dict(), emulated_ops=sorted(result.cases.emulated)),
        emulated=dict(result.cases.emulated), real=dict(result.cases.real),
        allocator_poisoned=result.cases.allocator_poisoned,  # cases (ATTNFUZZ_POISON_ALLOCATOR=1, CUDA)
        findings=[dict(f.to_dict(), path=str(p)) for f, p in saved],
        interrupted=bool(result.interrupted), interrupted_by=result.interrupted, shrink_cases=result.shrink_cases,
        rerun_cases=result.rerun_cases, startup_seconds=round(result.startup_seconds, 2), search=args.search,
        coverage=_coverage(result),
        stage_seconds={k: round(v, 3) for k, v in result.cases.stage_seconds.items()},
        known_hits={sig: n for sig, n in result.repeats.items() if sig in args.known},
        host_faults=[f"{f.title}: {f.case.summary()}" for f in result.host_faults])


def _coverage(result) -> dict:
    combos = result.cases.combinations
    if combos is None:
        return {}
    return {"pairs": round(combos.share(2), 4), "triples": round(combos.share(3), 4),
            "paths": len(result.cases.coverage), "path_pairs": len(combos.path_pairs), "swarms": combos.swarms}


def print_summary(result, saved, unsaved, host, campaign) -> None:
    from rich.console import Console

    console = Console()
    extra = ", ".join(f"{n} {what}" for n, what in ((result.shrink_cases, "shrinking"), (result.rerun_cases, "re-runs"))
                      if n)
    cut = "" if not result.interrupted else (
        f" [bold]INTERRUPTED[/] by {result.interrupted}" + (": the search did not finish;" if result.cases_run else
                                                            " in start-up, before the first case: nothing tested;"))
    console.print(f"{result.target}: {result.examples} cases{f' (+{extra})' if extra else ''} in {result.seconds:.1f} s "
                  f"({result.rate:.1f}/s, start-up {result.startup_seconds:.1f} s) on {host.device}, vLLM {host.vllm}:"
                  f"{cut} {len(result.findings)} finding(s)", highlight=False)
    known = {sig: n for sig, n in result.repeats.items() if sig in campaign.known}
    if known:
        console.print("  known open bugs hit again (--known; not saved): "
                      + ", ".join(f"{sig} in {n} case(s)" for sig, n in sorted(known.items())), highlight=False)
    for f, path in saved:
        classes = ",".join(sorted({v.bug_class for v in f.verdicts if v.bug_class})) or "-"
        again = "" if f.reruns is None else (f", FLAKY: came back {f.reruns[0]} of {f.reruns[1]} re-runs" if f.flaky
                                             else f", reproduced {f.reruns[0]}/{f.reruns[1]}")
        case = "shrunk case" if f.shrunk else "case (as first found, not shrunk)"
        injected = f", injected bug {f.inject}" if f.inject else ""
        console.print(f"[bold red]FOUND[/] {path}  class {classes}{injected}, after {f.examples_to_find} cases "
                      f"({f.seconds_to_find:.1f} s) on vLLM {f.host.vllm}{again}\n  {case}: {f.case.summary()}\n"
                      f"  {f.title}", highlight=False)
    for f in unsaved:
        console.print(f"[bold red]FOUND, NOT SAVED[/] {f.id}: kept in {campaign.pending.dir} (the next run of "
                      f"{result.target} takes it back)\n  {f.title}", highlight=False)
    for f in result.host_faults:
        console.print(f"[bold yellow]NOT TESTED[/] (exit 2): {f.title}, and none of its {f.reruns[1]} re-run(s) on a "
                      f"fresh worker: the device was short of memory (other campaigns on it, or what a sanitized "
                      f"worker had left), not the case; run fewer campaigns on this GPU\n  case: {f.case.summary()}",
                      highlight=False)


def write_campaign_dir(args, result, saved: list, host, inject: str | None, profile: str, target,
                       max_examples: int | None) -> tuple[Path, Path]:
    """`attnfuzz run --out DIR`: the campaign directory, then its report (paths printed)."""
    options = {"max_examples": None if args.time_budget else max_examples, "time_budget": args.time_budget,
               "kv_cache_dtypes": list(run_plan(args).kv_dtypes(target)), "isolation": args.isolation,
               "sanitizer": args.sanitizer, "reruns": args.reruns, "shrink": not args.no_shrink, "search": args.search}
    write_campaign(args.out, result, host=host, seed=args.seed, inject=inject, profile=profile, options=options,
                   findings_saved=[p for _, p in saved], findings=[f for f, _ in saved])
    md, page = render(args.out)
    print(f"campaign directory {args.out}: {md.name}, {page.name}")
    return md, page
