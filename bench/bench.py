#!/usr/bin/env python3
"""The benchmarks behind docs/benchmarks.md, one command on a CPU or on the GPU host:

  .venv/bin/python bench/bench.py --device cpu --out /tmp/bench
  scripts/gpu-host.sh -- python3 bench/bench.py --device cuda --out "$OUT/bench"

  throughput  one clean campaign per target and kv-cache dtype, one at a time (the gate's campaigns and budgets)
  mutants     time to find: `attnfuzz selftest --no-clean` (each mutant on each target it names)
  overheads   the same fixed-seed cases natively, with guard regions off (ATTNFUZZ_GUARDS=0) and, on a GPU,
              under `--sanitizer memcheck`

Writes OUT/bench.md (Markdown tables for docs/benchmarks.md), OUT/bench.json, and each campaign's summary and
log under OUT/. "process s" includes each campaign's start-up (vLLM imports); "cases/s" is the campaign's own,
its worker's start included, so a short campaign understates the steady rate.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PARTS = ("throughput", "mutants", "overheads")


def _row(o) -> dict:
    s = o.summary or {}
    return {"campaign": o.spec.name, "examples": s.get("examples", 0), "seconds": s.get("seconds", 0.0),
            "cases_per_second": s.get("cases_per_second", 0.0), "process_seconds": round(o.wall_seconds, 1),
            "findings": len(o.findings), "error": o.error}


def _table(rows: list[dict]) -> str:
    lines = ["| campaign | cases | s | cases/s | process s | findings |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['campaign']}` | {r['examples']} | {r['seconds']:.1f} | {r['cases_per_second']:.2f} | "
                     f"{r['process_seconds']:.0f} | {r['error'] or r['findings']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    p.add_argument("--budget-scale", type=float, default=1.0, help="scales the gate and selftest budgets")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overhead-target", default="vllm.flashmla_sparse")
    p.add_argument("--overhead-examples", type=int, default=None, help="default: 200 on a GPU, 100 on a CPU")
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.parts.split(",")]
    if bad := [x for x in parts if x not in PARTS]:
        p.error(f"--parts: unknown {', '.join(bad)}; known: {', '.join(PARTS)}")

    from fuzzer.env import prepare_process

    device = prepare_process(args.device)
    from fuzzer import budgets
    from fuzzer.commands.gate import gate_specs
    from fuzzer.env import host_info
    from fuzzer.run.campaign_process import CampaignSpec, run_campaigns
    from fuzzer.run.host import host_targets, import_vllm

    vllm_version = import_vllm()
    host = host_info(device)
    unavailable, dtypes = host_targets(device)
    args.out.mkdir(parents=True, exist_ok=True)
    timeout = budgets.CAMPAIGN_TIMEOUT_S[device]
    report = {"date": date.today().isoformat(), "device": device, "device_name": host.device_name, "vllm": vllm_version,
              "torch": host.torch, "triton": host.triton, "python": host.python}
    md = [f"Host: {device} ({host.device_name}), vLLM {vllm_version}, torch {host.torch}, Triton {host.triton} "
          f"({'interpreted' if host.interpreted else 'compiled'}), {report['date']}."]

    def progress(o) -> None:
        r = _row(o)
        print(f"  {r['campaign']}: {r['examples']} cases in {r['seconds']:.1f} s ({r['cases_per_second']:.2f}/s), "
              f"{r['process_seconds']:.0f} s with start-up, {r['error'] or str(r['findings']) + ' finding(s)'}", flush=True)

    if "throughput" in parts:
        print("throughput (clean campaigns, one at a time)", flush=True)
        specs, skipped = gate_specs(device, unavailable, dtypes, args.seed, args.budget_scale)
        rows = [_row(o) for o in run_campaigns(specs, device, args.out / "throughput", timeout, 1, progress)]
        report["throughput"] = rows + [{"campaign": s.name, "skipped": s.reason} for s in skipped]
        md += ["", "### Throughput (clean campaigns, profile " + ("gpu" if device == "cuda" else "cpu") + ")", "",
               _table(rows)] + [f"\nNot run here: `{s.name}` ({s.reason})." for s in skipped]

    if "mutants" in parts:
        print("time to find (attnfuzz selftest --no-clean)", flush=True)
        start = time.monotonic()
        rc = subprocess.run([sys.executable, "-m", "fuzzer.cli", "--device", device, "selftest", "--no-clean",
                             "--budget-scale", str(args.budget_scale), "--jobs", "1", "--out", str(args.out / "selftest"),
                             "--json", str(args.out / "selftest.json"), "--markdown", str(args.out / "selftest.md")],
                            cwd=ROOT).returncode
        got = args.out / "selftest.json"
        report["mutants"] = {"exit": rc, "seconds": round(time.monotonic() - start, 1),
                             **(json.loads(got.read_text()) if got.is_file() else {})}
        md += ["", f"### Mutants: time to find (`attnfuzz selftest --no-clean`, exit {rc})", "",
               (args.out / "selftest.md").read_text().strip() if got.is_file() else "(selftest wrote no results)"]

    if "overheads" in parts:
        target = args.overhead_target
        if unavailable.get(target, "unknown target"):
            print(f"overheads: {target} does not run here: {unavailable.get(target, 'unknown target')}")
        else:
            n = args.overhead_examples or (200 if device == "cuda" else 100)
            same = dict(target=target, max_examples=n, seed=args.seed, reruns=0)
            specs = [CampaignSpec(**same, label="native"),
                     CampaignSpec(**same, env=(("ATTNFUZZ_GUARDS", "0"),), label="guards off")]
            if device == "cuda":  # on a CPU every interpreted access is bounds-checked already
                specs.append(CampaignSpec(**same, extra=("--sanitizer", "memcheck"), label="memcheck"))
            print(f"overheads ({target}, {n} cases, seed {args.seed})", flush=True)
            rows = [_row(o) for o in run_campaigns(specs, device, args.out / "overheads", timeout * 3, 1, progress)]
            report["overheads"] = rows
            base = rows[0]["cases_per_second"] or float("nan")
            md += ["", f"### Guard and sanitizer overheads (`{target}`, the same {n} cases)", "", _table(rows), ""]
            md += [f"- {r['campaign']}: {r['cases_per_second'] / base:.2f}x the native rate" for r in rows[1:]]

    (args.out / "bench.md").write_text("\n".join(md) + "\n")
    (args.out / "bench.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out / 'bench.md'} and {args.out / 'bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
