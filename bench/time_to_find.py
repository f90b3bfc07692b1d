#!/usr/bin/env python3
"""Time to find: every built-in mutant on every target it names, over several seeds, per search.

  .venv/bin/python bench/time_to_find.py --device cpu --out /tmp/ttf [--seeds 5] [--cap 300] [--search swarm,plain]
                                         [--mutants A,B] [--jobs 2] [--max-steps N]
  .venv/bin/python bench/time_to_find.py --device cpu --out /tmp/ttf --search swarm --mutants call-modes

Each (mutant, target) runs in a process of its own (a mutant patches vLLM for the process's life): vLLM is
imported once, the mutant applied, and then one campaign per search and seed runs in that process (cases in
process, no shrinking, no re-runs, stopping at the first finding, at most --cap cases, a fresh in-memory example
database each, so that no seed replays another's failure). "Found" is any finding (selftest's found and
found-as-other); the cases and seconds are the campaign's own up to its first finding. `--clean N` adds one
clean campaign of N cases per target and search (any finding there is a false finding).

`--mutants` also takes a named set (GROUPS): `call-modes` is the seed bug (`remap-no-length-check`) in one call
mode of the index remap at a time (plain, valid counts, compaction, prefill workspace, idx_mapping,
BLOCK_STRIDE_ROWS: fuzzer/mutants/_kernel_patch.CALL_MODES), each found only by a case that pairs its mode with the
full-batch req_id_per_token.

Writes OUT/time_to_find.md (a table per search: median and worst cases and seconds, share missed within the cap,
the cases to find per seed) and OUT/time_to_find.json (every campaign).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def one(device: str, mutant: str | None, target_name: str, seeds: list[int], searches: list[str], cap: int,
        max_steps: int | None = None) -> list[dict]:
    """Run in a child process: the campaigns of one (mutant, target)."""
    from fuzzer.env import prepare_process

    device = prepare_process(device)
    from hypothesis.database import InMemoryExampleDatabase

    from fuzzer.env import host_info
    from fuzzer.mutants import inject
    from fuzzer.run.executors import InProcessExecutor
    from fuzzer.run.host import import_vllm
    from fuzzer.search.campaign import Campaign
    from fuzzer.search.progress import Progress
    from fuzzer.targets.registry import TARGETS
    from strategies.profiles import PROFILES

    from fuzzer.commands.selftest import known_open_bugs

    version = import_vllm()
    # The target's known open bugs (repros/, expected present on this release) are counted, never the finding, as
    # `attnfuzz selftest` runs its mutant campaigns: a mutant's time to find is not an open bug's.
    known = known_open_bugs(ROOT / "repros", version).get(target_name, ())
    target = TARGETS[target_name](device)
    target.prepare()
    if mutant:
        inject(mutant)
    host = host_info(device)
    profile = PROFILES["gpu" if device == "cuda" else "cpu"]
    if max_steps is not None:
        profile = dataclasses.replace(profile, max_steps=max_steps)
    rows = []
    for search in searches:
        for seed in seeds:
            c = Campaign(target, profile, host, seed=seed,
                         executor=InProcessExecutor(target), max_examples=cap, inject=mutant, reruns=0, shrink=False,
                         max_findings=1 if mutant else None, database=InMemoryExampleDatabase(), search=search,
                         progress=Progress(target_name, quiet=True), known=known)
            r = c.run()
            f = min(r.findings, key=lambda f: f.examples_to_find, default=None)
            rows.append({"mutant": mutant, "target": target_name, "search": search, "seed": seed, "cases": r.examples,
                         "seconds": round(r.seconds, 2), "found": f is not None,
                         "cases_to_find": f.examples_to_find if f else None,
                         "seconds_to_find": round(f.seconds_to_find, 2) if f else None,
                         "classes": sorted({v.bug_class for v in f.verdicts if v.bug_class}) if f else [],
                         "pairs": round(r.cases.combinations.share(2), 4), "triples": round(r.cases.combinations.share(3), 4)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def groups() -> dict[str, list[str]]:
    """Named sets of built-in mutants for --mutants."""
    from fuzzer.mutants._kernel_patch import CALL_MODES

    return {"call-modes": [f"remap-no-length-check-{mode.replace('_', '-')}" for mode in CALL_MODES]}


def summarize(rows: list[dict], cap: int) -> list[dict]:
    out = []
    keys = sorted({(r["mutant"] or "", r["target"], r["search"]) for r in rows})
    for mutant, target, search in keys:
        rs = sorted((r for r in rows if (r["mutant"] or "", r["target"], r["search"]) == (mutant, target, search)),
                    key=lambda r: r["seed"])
        found = [r for r in rs if r["found"]]
        # A miss counts as the cap (and its seconds) in the median and the worst: it was not found in that many.
        cases = [r["cases_to_find"] if r["found"] else cap for r in rs]
        secs = [r["seconds_to_find"] if r["found"] else r["seconds"] for r in rs]
        out.append({"mutant": mutant or None, "target": target, "search": search, "seeds": len(rs),
                    "found": len(found), "missed_share": round(1 - len(found) / len(rs), 2),
                    "median_cases": statistics.median(cases), "worst_cases": max(cases),
                    "median_seconds": round(statistics.median(secs), 1), "worst_seconds": round(max(secs), 1),
                    "classes": sorted({c for r in found for c in r["classes"]}),
                    "pairs": round(statistics.median(r["pairs"] for r in rs), 3),
                    "per_seed": {r["seed"]: r["cases_to_find"] for r in rs}})  # None: missed within the cap
    return out


def markdown(summary: list[dict], cap: int) -> str:
    searches = sorted({s["search"] for s in summary}, key=lambda s: s != "plain")
    by = {(s["mutant"], s["target"], s["search"]): s for s in summary}
    pairs = sorted({(s["mutant"], s["target"]) for s in summary}, key=lambda p: (p[0] is None, p[0] or "", p[1]))
    head = "| mutant | target | " + " | ".join(f"{s}: median / worst cases (s) | {s}: missed | {s}: cases per seed"
                                              for s in searches) + " |"
    lines = [head, "|---|---|" + "---|---|---|" * len(searches)]
    for m, t in pairs:
        cells = []
        for s in searches:
            x = by.get((m, t, s))
            if x is None:
                cells += ["-", "-", "-"]
            elif m is None:  # a clean run: findings are false findings
                cells += [f"{x['seeds']} clean run(s), {x['found']} with a finding", "-", "-"]
            else:
                worst = f">{cap}" if x["found"] < x["seeds"] else str(x["worst_cases"])
                cells += [f"{x['median_cases']:g} / {worst} ({x['median_seconds']:g} / {x['worst_seconds']:g})",
                          f"{x['seeds'] - x['found']}/{x['seeds']}",
                          ", ".join(f"{seed}: {n if n is not None else f'>{cap}'}" for seed, n in x["per_seed"].items())]
        lines.append(f"| {'`' + m + '`' if m else 'clean'} | `{t}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", type=int, default=5, help="seeds 0 .. N-1")
    p.add_argument("--cap", type=int, default=300, help="cases per campaign at most (a miss)")
    p.add_argument("--search", default="swarm,plain")
    p.add_argument("--mutants", default=None,
                   help="comma-separated names or sets (call-modes); default: every built-in mutant")
    p.add_argument("--targets", default=None, help="comma-separated: only these targets")
    p.add_argument("--clean", type=int, default=0, metavar="N", help="also a clean campaign of N cases per target")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=None, help="steps per trace case (1: single fresh steps only)")
    p.add_argument("--one", nargs=2, metavar=("MUTANT", "TARGET"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    searches = [s.strip() for s in args.search.split(",")]
    seeds = list(range(args.seeds))
    if args.one:
        mutant = None if args.one[0] == "-" else args.one[0]
        rows = one(args.device, mutant, args.one[1], seeds, searches, args.cap, args.max_steps)
        (args.out).write_text(json.dumps(rows))
        return 0

    from fuzzer.mutants import MUTANTS, load
    from fuzzer.run.host import host_targets

    unavailable, _ = host_targets(args.device)
    only = set(args.targets.split(",")) if args.targets else None
    jobs = []
    sets = groups()
    names = [n for m in args.mutants.split(",") for n in sets.get(m.strip(), [m.strip()])] if args.mutants else MUTANTS
    for m in names:
        jobs += [(m, t) for t in load(m).TARGETS if not unavailable.get(t, "?") and (not only or t in only)]
    if args.clean:
        jobs += [("-", t) for t in sorted({t for _, t in jobs})]
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()

    def child(job) -> list[dict]:
        m, t = job
        path = args.out / f"{m}--{t}.json"
        cap = args.clean if m == "-" else args.cap
        argv = [sys.executable, __file__, "--device", args.device, "--out", str(path), "--seeds",
                str(1 if m == "-" else args.seeds), "--cap", str(cap), "--search", args.search, "--one", m, t,
                *(["--max-steps", str(args.max_steps)] if args.max_steps is not None else [])]
        log = args.out / f"{m}--{t}.log"
        with log.open("w") as fh:
            rc = subprocess.run(argv, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT).returncode
        if rc != 0 or not path.is_file():
            print(f"{m} on {t}: exit {rc}, see {log}", flush=True)
            return [{"mutant": None if m == "-" else m, "target": t, "error": f"exit {rc}", "log": str(log)}]
        rows = json.loads(path.read_text())
        for s in searches:
            rs = [r for r in rows if r["search"] == s]
            print(f"{m} on {t} [{s}]: found in {sum(r['found'] for r in rs)}/{len(rs)} seeds; cases "
                  f"{[r['cases_to_find'] for r in rs]}", flush=True)
        return rows

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        rows = [r for rs in pool.map(child, jobs) for r in rs]
    ok = [r for r in rows if "error" not in r]
    summary = summarize(ok, args.cap)
    doc = {"date": date.today().isoformat(), "device": args.device, "seeds": seeds, "cap": args.cap,
           "searches": searches, "seconds": round(time.monotonic() - start, 1), "summary": summary, "campaigns": rows,
           "errors": [r for r in rows if "error" in r]}
    (args.out / "time_to_find.json").write_text(json.dumps(doc, indent=1) + "\n")
    (args.out / "time_to_find.md").write_text(markdown(summary, args.cap) + "\n")
    print(markdown(summary, args.cap))
    print(f"{len(ok)} campaigns in {doc['seconds']:.0f} s; wrote {args.out / 'time_to_find.md'}")
    return 2 if doc["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
