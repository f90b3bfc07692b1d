"""attnfuzz command line: run | replay | list | gate | selftest.

Exit codes: 0 nothing found (or a replayed bug is fixed), 1 findings (or the bug is still there),
2 usage or environment errors (unknown target, vLLM missing, a malformed case).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from fuzzer.artifacts import campaign_report
from fuzzer.commands import gate, selftest
from fuzzer.run import fleet

EXIT_CLEAN, EXIT_FOUND, EXIT_USAGE = 0, 1, 2


def _duration(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use e.g. 90s, 10m, 8h)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnfuzz", description="Differential fuzzer for vLLM's sparse-MLA backends")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if this host has a GPU")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run a campaign against one target")
    r.add_argument("--target", required=True)
    r.add_argument("--seed", type=int, default=0)
    g = r.add_mutually_exclusive_group()
    g.add_argument("--max-examples", type=int, default=None)
    g.add_argument("--time-budget", type=_duration, default=None, metavar="D")
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
    r.add_argument("--case-timeout", type=_duration, default=300.0, metavar="D",
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
    rp = sub.add_parser("replay", help="re-run a saved finding (repros/<id>/ or its case.json)")
    rp.add_argument("path", type=Path)
    rp.add_argument("--save-repro", type=Path, metavar="DIR",
                    help="if it still fails here, save this host's reproducer under DIR (e.g. a GPU repro.py for a "
                         "finding made on a CPU)")
    sub.add_parser("list", help="targets, mutants and what this host can run")
    for command in (gate, selftest, campaign_report):
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from fuzzer.env import prepare_process

    device = prepare_process(args.device)
    try:
        return {"run": cmd_run, "replay": cmd_replay, "list": cmd_list,
                "gate": gate.main, "selftest": selftest.main, "report": campaign_report.main}[args.command](args, device)
    except UsageError as e:
        print(f"attnfuzz: {e}", file=sys.stderr)
        return EXIT_USAGE


class UsageError(Exception):
    pass


def _import_vllm():
    try:
        import vllm  # noqa: F401  (once per process: 7-20 s on the GPU host)
    except Exception as e:
        raise UsageError(f"vLLM is not importable here ({type(e).__name__}: {e}); see README's set-up") from e


def _make_target(name: str, device: str):
    from fuzzer.targets.registry import TARGETS

    if name not in TARGETS:
        raise UsageError(f"unknown target {name!r}; known: {', '.join(TARGETS)}")
    target = TARGETS[name](device)
    why = target.unavailable()
    if why:
        raise UsageError(f"target {name} is not available here: {why}")
    target.prepare()
    return target


def cmd_run(args, device: str) -> int:
    from fuzzer.search.campaign import Campaign, HarnessError
    from fuzzer.env import STATE_DIR, host_info
    from fuzzer.run.worker import WorkerError
    from fuzzer.mutants import MutantError, inject
    from fuzzer.search.progress import Progress
    from fuzzer.artifacts.repro import write_repro
    from strategies.profiles import PROFILES

    if args.workers is not None:  # a fleet: this process runs none of the cases
        return fleet.run_fleet(args, device)
    _import_vllm()
    target = _make_target(args.target, device)  # detects the release's API before any mutant patches it
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
    executor = _executor(args, target, device, label)
    campaign = Campaign(target, PROFILES[profile_name], host, seed=args.seed, max_examples=max_examples,
                        time_budget=args.time_budget, inject=label, progress=Progress(target.name, args.quiet),
                        executor=executor, pending=args.repros / ".pending",
                        journal=STATE_DIR / "journal" / f"{target.name}.json", reruns=args.reruns,
                        shrink=not args.no_shrink, database=fleet.example_database(args.db),
                        max_findings=args.max_findings)
    try:
        result = campaign.run()
    except HarnessError as e:
        print(f"attnfuzz: harness error (a bug in attnfuzz, not in vLLM):\n{e}", file=sys.stderr)
        return EXIT_USAGE
    except WorkerError as e:
        raise UsageError(str(e)) from e
    saved = [write_repro(f, target, args.repros) for f in result.findings]
    campaign.clear_pending()
    _print_summary(result, saved, host)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "target": result.target, "seed": args.seed, "inject": label, "profile": profile_name,
            "kv_cache_dtypes": list(target.kv_cache_dtypes),
            "examples": result.examples, "seconds": round(result.seconds, 2), "cases_per_second": round(result.rate, 2),
            "isolation": args.isolation, "sanitizer": args.sanitizer, "workers_started": result.workers_started,
            # Which compiled ops were attnfuzz's stand-ins is known once cases ran (in the workers): every result says it.
            "checks": result.checks, "host": dict(host.to_dict(), emulated_ops=sorted(result.cases.emulated)),
            "emulated": dict(result.cases.emulated), "real": dict(result.cases.real),
            "allocator_poisoned": result.cases.allocator_poisoned,  # cases (ATTNFUZZ_POISON_ALLOCATOR=1, CUDA)
            "findings": [dict(f.to_dict(), path=str(p)) for f, p in zip(result.findings, saved)],
        }, indent=1) + "\n")
    if args.out:  # the campaign directory (campaign.json, findings) and its report.md / report.html
        campaign_report.write_from_run(args, result, saved, host, label, profile_name, target, max_examples)
    return EXIT_FOUND if result.findings else EXIT_CLEAN


def _executor(args, target, device: str, label):
    """Where the campaign's cases run (see fuzzer/run/worker.py)."""
    from fuzzer.env import STATE_DIR
    from fuzzer.run.worker import SANITIZED_RECYCLE_AFTER, AutoSanitizedExecutor, InProcessExecutor, WorkerExecutor, WorkerSpec

    if args.sanitizer:
        if device != "cuda":
            raise UsageError("--sanitizer needs a GPU (on CPU every interpreted load and store is bounds-checked)")
        from fuzzer.run.compute_sanitizer import SanitizerUnavailable, check_driver, find_compute_sanitizer

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
        from dataclasses import replace

        return AutoSanitizedExecutor(WorkerExecutor(spec, logs / "native"),
                                     WorkerExecutor(replace(spec, sanitizer="memcheck", case_timeout=args.case_timeout * 10,
                                                                   recycle_after=SANITIZED_RECYCLE_AFTER),
                                                    logs / "memcheck"), seed=args.seed)
    return WorkerExecutor(spec, logs)


def _print_summary(result, saved, host) -> None:
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


def cmd_replay(args, device: str) -> int:
    from fuzzer.mutants import inject
    from strategies.case import Case, CaseError

    path = args.path
    case_file = path / "case.json" if path.is_dir() else path
    meta_file = case_file.parent / "finding.json"
    if not case_file.is_file():
        raise UsageError(f"{case_file}: no such file")
    try:
        case = Case.from_json(case_file.read_text())
    except CaseError as e:
        raise UsageError(f"{case_file}: {e}") from e
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    if "target" not in meta:
        raise UsageError(f"{meta_file}: missing, or has no 'target' field")
    _import_vllm()
    target = _make_target(meta["target"], device)
    if meta.get("inject"):
        inject(meta["inject"])
    obs = target.run(case)
    failed = [v for v in target.oracle(case, obs) if not v.ok]
    for v in failed:
        print(f"BUG [{v.check}] {v.detail}")
    print(f"{meta['target']} on {case.summary()}: {'still failing' if failed else 'passes (fixed)'}")
    if failed and args.save_repro:
        from fuzzer.search.campaign import Finding
        from fuzzer.env import host_info
        from fuzzer.artifacts.repro import write_repro
        from oracles.verdict import primary

        finding = Finding(meta["target"], primary(failed).signature, case, failed, obs,
                          host_info(device, obs.emulated), meta.get("inject"), meta.get("examples_to_find", 0),
                          meta.get("seconds_to_find", 0.0))
        print(f"reproducer for this host: {write_repro(finding, target, args.save_repro)}/repro.py")
    return EXIT_FOUND if failed else EXIT_CLEAN


def cmd_list(args, device: str) -> int:
    from rich.console import Console
    from rich.table import Table

    from fuzzer.env import host_info
    from fuzzer.mutants import MUTANTS, load
    from fuzzer.targets.registry import TARGETS

    console = Console(width=None if sys.stdout.isatty() else 200)  # logs and pipes: never truncate names
    try:
        _import_vllm()
    except UsageError as e:
        console.print(str(e))
    t = Table("target", "classes", "runs here", "what")
    for name, cls in TARGETS.items():
        why = cls(device).unavailable()
        t.add_row(name, cls.bug_classes, "yes" if why is None else f"no: {why}", cls.summary)
    console.print(t)
    m = Table("mutant (--inject)", "class", "targets", "what")
    for name in MUTANTS:
        mod = load(name)
        m.add_row(name, mod.BUG_CLASS, ", ".join(mod.TARGETS), (mod.__doc__ or "").split(":")[0].replace("\n", " "))
    console.print(m)
    h = host_info(device)
    console.print(f"host: {h.device} ({h.device_name}); vLLM {h.vllm}; torch {h.torch}; triton {h.triton}; "
                  f"Triton {'interpreted' if h.interpreted else 'compiled'}")
    return EXIT_CLEAN


if __name__ == "__main__":
    sys.exit(main())
