#!/usr/bin/env python3
"""The cost of a step in a trace against a single fresh step, from one campaign's records (`attnfuzz run --out
DIR`: DIR/campaign.json, each case's `case_seconds`, its time from the journal to its verdicts, Hypothesis's
draw not included): per trace length, the cases, the median seconds per case and per step, and the ratio of
a step's cost to a single step's.

  python3 bench/trace_cost.py DIR/campaign.json [--skip N]   (N: the first cases, Triton compiling; default 20)
"""

import argparse
import json
import statistics
from collections import defaultdict


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("campaign")
    p.add_argument("--skip", type=int, default=20, help="leave out the first cases (kernels compiling)")
    a = p.parse_args()
    records = json.load(open(a.campaign))["cases"][a.skip:]
    by_steps = defaultdict(list)
    for r in records:
        if "case_seconds" in r:
            by_steps[r.get("steps", 1)].append(r["case_seconds"])
    if not by_steps:
        raise SystemExit(f"{a.campaign}: no case records with case_seconds")
    single = statistics.median(by_steps[1]) if by_steps.get(1) else None
    print("| steps | cases | median ms per case | ms per step | per step / single step |")
    print("|---|---|---|---|---|")
    for n in sorted(by_steps):
        med = statistics.median(by_steps[n])
        ratio = f"{med / n / single:.2f}" if single else "-"
        print(f"| {n} | {len(by_steps[n])} | {1000 * med:.1f} | {1000 * med / n:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
