#!/usr/bin/env python3
"""Host-side CPU time per case of attnfuzz's own stages for a backend target's cases (what a GPU cannot
speed up). No vLLM import, no kernels:

  .venv/bin/python bench/host_stages.py [--profile gpu-bench] [--cases 100]

  draw       Hypothesis drawing the case (derandomized: the same cases on every run of the same code)
  index      materialize_index_inputs (topk_indices, req_id_per_token, ... built on the CPU on any device)

CPU time (time.process_time, one torch thread), so other load on the machine does not count; index: best of 5
passes over the same cases.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="gpu-bench")
    p.add_argument("--cases", type=int, default=100)
    args = p.parse_args()

    import torch
    from hypothesis import HealthCheck, Phase, given, settings

    from strategies.batches import AttentionFeatures, attention_cases
    from strategies.profiles import PROFILES
    from strategies.tensors import materialize_index_inputs

    torch.set_num_threads(1)
    # vllm.flashmla_sparse's cases on 0.33 (both cache dtypes, block sizes 64 and 128, strided blocks).
    strategy = attention_cases(PROFILES[args.profile], AttentionFeatures(
        kv_cache_dtypes=("bfloat16", "fp8_ds_mla"), block_sizes=(64, 128), block_stride_rows=True))
    cases = []

    @settings(max_examples=args.cases, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def draw(case):
        cases.append(case)

    start = time.process_time()
    draw()
    ms = {"draw": (time.process_time() - start) * 1000 / len(cases)}

    passes = []
    for _ in range(5):
        start = time.process_time()
        for case in cases:
            materialize_index_inputs(case)
        passes.append((time.process_time() - start) * 1000 / len(cases))
    ms["index"] = min(passes)
    tokens = sum(c.num_tokens for c in cases) / len(cases)
    print(f"{len(cases)} {args.profile} cases ({tokens:.0f} query tokens on average), "
          f"CPU ms per case: " + ", ".join(f"{k} {v:.2f}" for k, v in ms.items()))


if __name__ == "__main__":
    main()
