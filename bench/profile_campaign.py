#!/usr/bin/env python3
"""Where a campaign's time per case goes: `attnfuzz run` in this process (`--isolation none`) under cProfile,
then the wall time per case of each stage of the flow (draw, materialize, engine set-up, vLLM's build and
forward, oracle) and the functions that cost the most.

  python3 bench/profile_campaign.py [--prof FILE] [--top N] -- ATTNFUZZ-ARGS...
  e.g. python3 bench/profile_campaign.py -- --device cuda run --target vllm.flashmla_sparse --profile gpu-bench \
           --time-budget 30s --no-shrink --reruns 1 --max-steps 1

Stages overlap (a step's forward is inside its target's run); "per case" divides by the cases the campaign ran.
cProfile's own overhead inflates Python-heavy stages, so compare stages with each other, not with other runs.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# stage: a regex on "file:line(function)" as pstats names a function (cumulative time of the outermost call)
STAGES = {
    "hypothesis test function (all of a case)": r"hypothesis/core\.py:\d+\(execute_once\)",
    "draw (strategies)": r"/strategies/batches\.py:\d+\(attention_cases\)|/strategies/batches\.py:\d+\(\w+_case\)",
    "target.run": r"/fuzzer/targets/\w+\.py:\d+\(run\)$",
    "materialize inputs": r"/strategies/tensors\.py:\d+\(materialize_\w+\)",
    "configure (VllmConfig per case)": r"/fuzzer/support/flashmla_runtime\.py:\d+\(configure\)",
    "guards + cache + top-k buffer": r"/fuzzer/targets/harness\.py:\d+\((paged_cache|topk_buffer_for)\)",
    "builder __init__ (vLLM)": r"/vllm/.*(flashmla_sparse|flashattn_mla_sparse|sparse_mla_attention)\.py:\d+\(__init__\)",
    "builder.build (vLLM)": r"/vllm/v1/attention/backends/mla/\w+\.py:\d+\(build\)$",
    "forward_mqa (vLLM)": r"/vllm/.*\.py:\d+\(forward_mqa\)",
    "layer forward_impl (vLLM)": r"/vllm/.*\.py:\d+\(forward_impl\)",
    "cache writer": r"/fuzzer/targets/flashmla_sparse\.py:\d+\(<lambda>\)",
    "path probes": r"/fuzzer/targets/probes\.py:\d+\(observe_paths\)",
    "finish (guard/cache checks)": r"/fuzzer/targets/\w+\.py:\d+\(finish\)",
    "oracle": r"/oracles/steps\.py:\d+\(judged\)",
    "reference (fp32)": r"/oracles/attention_judge\.py:\d+\((reference_for|layer_reference_for)\)",
    "torch.cuda.synchronize": r"\{method 'synchronize'|torch/cuda/__init__\.py:\d+\(synchronize\)",
    "campaign bookkeeping": r"/fuzzer/search/campaign\.py:\d+\(record\w*\)|/fuzzer/search/caselog\.py",
}


def cases_run(summary: Path) -> int:
    try:
        return int(json.loads(summary.read_text()).get("examples") or 0)
    except (OSError, ValueError):
        return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prof", help="keep the raw profile here")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args()
    argv = [x for x in a.args if x != "--"]
    if not argv or "run" not in argv:
        p.error("give `attnfuzz run` arguments after --")
    summary = Path(tempfile.mkdtemp()) / "summary.json"
    argv = [*argv, "--isolation", "none", "--json", str(summary)] if "--json" not in argv else argv
    if "--json" in a.args:
        summary = Path(argv[argv.index("--json") + 1])

    from fuzzer.cli import main as attnfuzz

    prof = cProfile.Profile()
    rc = 2
    try:
        rc = prof.runcall(attnfuzz, argv) or 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 2
    out = a.prof or str(summary.with_suffix(".prof"))
    prof.dump_stats(out)
    n = cases_run(summary)
    stats = pstats.Stats(out)
    rows = stats.stats  # {(file, line, fn): (cc, nc, tt, ct, callers)}
    print(f"attnfuzz exit {rc}; {n} cases; profile {out}")
    print(f"\n{'stage':45s} {'s':>8s} {'ms/case':>9s}")
    for stage, pattern in STAGES.items():
        rx = re.compile(pattern)
        hits = [(k, v) for k, v in rows.items() if rx.search(f"{k[0]}:{k[1]}({k[2]})")]
        # cumulative time of the outermost matches only: a match called from another match counts once
        keys = {k for k, _ in hits}
        total = sum(v[3] for k, v in hits if not any(c in keys for c in v[4]))
        print(f"{stage:45s} {total:8.2f} {1000 * total / max(n, 1):9.1f}")
    print(f"\nthe {a.top} functions of the most own time (tottime), ms per case:")
    for k, v in sorted(rows.items(), key=lambda kv: -kv[1][2])[: a.top]:
        print(f"{1000 * v[2] / max(n, 1):9.2f} {v[1]:>8d} calls  {k[0].split('site-packages/')[-1]}:{k[1]}({k[2]})")
    print(f"\nthe {a.top} of the most cumulative time under attnfuzz or vLLM, ms per case:")
    mine = [(k, v) for k, v in rows.items() if re.search(r"/(fuzzer|strategies|oracles|vllm)/", k[0])]
    for k, v in sorted(mine, key=lambda kv: -kv[1][3])[: a.top]:
        print(f"{1000 * v[3] / max(n, 1):9.2f} {v[1]:>8d} calls  {k[0].split('site-packages/')[-1]}:{k[1]}({k[2]})")
    return rc


if __name__ == "__main__":
    sys.exit(main())
