"""How often the DeepSeek-V3.2 module's DCP cases (`vllm.dsv32.attention.dcp`'s strategy, or with `--space pcp`
`vllm.dsv32.attention.pcp_dcp`'s: its DCP ranks, the PCP split not modelled) meet DeepGEMM's SM90
zero-length-request bug (docs/bug-reports/vllm-0.33.0-deepgemm-sm90-paged-logits-zero-length-request.md): a decode
entry with more keys than the top-k, scored right after an entry with none on some DCP rank, by an SM whose share of
the paged-logits schedule crosses from the entry before. The schedule is the DeepGEMM stand-in's (checked equal to
the real metadata kernel, bench/deep_gemm_check.py); nothing runs vLLM. `--sms 0` keeps every case on the device's
132 SMs (what the strategy drew before IndexerStep.num_sms).

  python bench/zero_length_reach.py [--profile cpu|gpu] [--cases 600] [--sms 0] [--space dcp|pcp] [--seed N]

Hypothesis's draws are not independent samples (it mutates what it drew before): read one run's count as one
sample, and compare strategies over several `--seed`s (default: derandomized, the same draws every run).
"""

from __future__ import annotations

import argparse
import dataclasses

from hypothesis import HealthCheck, given, seed, settings

from fuzzer.support.standins import deep_gemm as dg
from oracles.dcp import local_length, paged_logits_entries
from strategies.indexer_batches import attention_module_dcp_space, attention_module_pcp_space
from strategies.profiles import PROFILES

DEVICE_SMS = 132


def crossed(lengths: list[int], sms: int) -> list[int]:
    """Entries an SM reaches right after skipping a zero-length one (the schedule of get_paged_mqa_logits_metadata,
    walked as SM90PagedMQALogitsScheduler does)."""
    import torch

    dg.set_num_sms(sms)
    meta = dg.get_paged_mqa_logits_metadata(torch.tensor(lengths, dtype=torch.int32)[:, None], 64, sms).tolist()
    blocks = lambda i: -(-lengths[i] // 64) if i < len(lengths) else None  # noqa: E731
    out = []
    for c in range(sms):
        before = None
        for b, _kv, _n in dg._walk(c, meta[c], meta[c + 1], len(lengths), blocks, dg._Faults("reach")):
            if before is not None and b != before + 1:
                out.append(b)
            before = b
    return out


def meets_bug(case) -> bool:
    lengths, _ = paged_logits_entries(case)
    if not lengths:
        return False
    sms = case.indexer.num_sms or DEVICE_SMS
    if 1 + case.indexer.num_speculative_tokens == 4:
        sms //= 2  # clusters of 2 SMs
    for rank in range(case.dcp.size):
        local = [local_length(n, case.dcp, rank) for n in lengths]
        if any(lengths[b] > case.topk_width and local[b] for b in crossed(local, sms)):
            return True
    return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="cpu", choices=sorted(PROFILES))
    ap.add_argument("--cases", type=int, default=600)
    ap.add_argument("--sms", type=int, nargs="*", help="the SM counts drawn (default: the profile's)")
    ap.add_argument("--space", default="dcp", choices=("dcp", "pcp"), help="the target's strategy: .dcp or .pcp_dcp")
    ap.add_argument("--seed", type=int, help="Hypothesis's seed (default: derandomized)")
    args = ap.parse_args()
    p = PROFILES[args.profile]
    if args.sms is not None:
        p = dataclasses.replace(p, indexer=dataclasses.replace(p.indexer, sms=tuple(args.sms)))
    seen = {"cases": 0, "meet": 0}
    space = attention_module_dcp_space if args.space == "dcp" else attention_module_pcp_space

    @settings(max_examples=args.cases, database=None, suppress_health_check=list(HealthCheck), deadline=None,
              derandomize=args.seed is None)
    @given(space(p, p.attn_heads, combine_rows=768).strategy())
    def draw(case):
        seen["cases"] += 1
        seen["meet"] += meets_bug(case)

    (draw if args.seed is None else seed(args.seed)(draw))()
    print(f"{args.space} strategy, {args.profile} profile, seed {args.seed}, SMs drawn from {p.indexer.sms}: "
          f"{seen['meet']} of {seen['cases']} drawn cases meet DeepGEMM's zero-length-request bug")


if __name__ == "__main__":
    main()
