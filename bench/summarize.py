"""A Markdown table of a results folder: one row per run of bench/scenario.sh (RESULTS/runs.tsv: name, exit,
wall seconds, command) with what its --json summary says (`attnfuzz run`, a fleet, `gate`, `selftest`), or,
without runs.tsv, one row per *.json summary of `attnfuzz run`.

  python3 bench/summarize.py RESULTS
"""

import json
import sys
from pathlib import Path


def findings(d: dict) -> str:
    out = []
    for kind in ("findings", "known", "pending"):
        for f in d.get(kind) or []:
            classes = ",".join(f.get("bug_classes") or []) or "-"
            where = f"{f.get('examples_to_find', '?')} cases / {f.get('seconds_to_find', '?')} s"
            what = f.get("summary") or f.get("signature") or f.get("id") or ""
            out.append(f"{'' if kind == 'findings' else kind + ' '}[{classes}] after {where}: `{str(what)[:160]}`")
    return "; ".join(out) or "none"


def row(name: str, d: dict | None) -> tuple[str, str, str, str]:
    """(cases, campaign s, cases/s, result) of one summary."""
    if not d:
        return "-", "-", "-", f"(no summary: {name}.log)"
    if "passed" in d:  # gate, selftest
        return "-", str(d.get("seconds", "-")), "-", "passed" if d["passed"] else "FAILED"
    extra = f" ({d['duplicates_merged']} duplicates merged)" if d.get("duplicates_merged") else ""
    return (str(d.get("examples", "-")), str(d.get("seconds", "-")), str(d.get("cases_per_second", "-")),
            findings(d) + extra)


STAGES = ("search", "transport", "harness", "calls", "oracle", "record")


def stage_table(results: Path, names: list[str]) -> list[str]:
    """Milliseconds per case in each stage of a campaign (attnfuzz run's `stage_seconds`), for the runs that
    report them: where a worker's time goes."""
    rows = []
    for name in names:
        try:
            d = json.loads((results / f"{name}.json").read_text())
        except (OSError, ValueError):
            continue
        stages, cases = d.get("stage_seconds") or {}, d.get("examples", 0) + d.get("shrink_cases", 0)
        if not stages or not cases:
            continue
        ms = [1000 * stages.get(s, 0.0) / cases for s in STAGES]
        rows.append(f"| {name} | {cases} | " + " | ".join(f"{x:.1f}" for x in ms) + f" | {sum(ms):.1f} |")
    if not rows:
        return []
    return ["", "Milliseconds per case by stage (`stage_seconds`):", "",
            "| run | cases | " + " | ".join(STAGES) + " | sum |", "|---" * (len(STAGES) + 3) + "|", *rows]


def main() -> None:
    results = Path(sys.argv[1])
    lines = ["| run | exit | wall s | cases | campaign s | cases/s | findings |", "|---|---|---|---|---|---|---|"]
    tsv = results / "runs.tsv"
    if tsv.is_file():
        runs = [ln.split("\t")[:3] for ln in tsv.read_text().splitlines() if ln.strip()]
    else:
        runs = [[p.stem, "-", "-"] for p in sorted(results.glob("*.json"))]
    for name, rc, wall in runs:
        p = results / f"{name}.json"
        try:
            d = json.loads(p.read_text()) if p.is_file() else None
        except ValueError:
            d = None
        cases, secs, rate, result = row(name, d)
        lines.append(f"| {name} | {rc} | {wall} | {cases} | {secs} | {rate} | {result} |")
    lines += stage_table(results, [name for name, _, _ in runs])
    host = results / "host.txt"
    if host.is_file():
        lines = ["```", host.read_text().strip(), "```", ""] + lines
    print("\n".join(lines))


if __name__ == "__main__":
    main()
