"""attnfuzz's DeepGEMM stand-ins (fuzzer/support/standins/deep_gemm.py) against vLLM 0.33.0's vendored DeepGEMM on a
GPU host that has its extension (scripts/gpu-ops.sh carries it): random indexer-shaped calls of each function, the
same inputs to both; logits compared within each row's keys, as a share of the row's largest logit (Hopper's FP8
tensor cores accumulate with about 14 mantissa bits: the kernels and the stand-in's fp32 differ by up to ~4e-3;
semantics that differ, a wrong key, scale or weight, differ by order 1). Prints a table; exits 1 if any differ by
more than 1e-2.

    python3 bench/deep_gemm_check.py [--cases 40] [--seed 0] [--json FILE]   (scripts/gpu-host.sh sets the path)
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from fuzzer.support.standins import deep_gemm as standin


def paged_case(g, device, heads, next_n, block_size=64, dim=128, max_model_len=4096):
    b = int(torch.randint(1, 9, (1,), generator=g))
    lens = torch.randint(next_n, 3000, (b,), generator=g)
    lens[0] = next_n + int(torch.randint(0, 3, (1,), generator=g))  # a short context: the partial first block
    blocks = int((lens.max() + block_size - 1) // block_size)
    num_blocks = b * blocks + 1
    table = torch.randperm(num_blocks - 1, generator=g)[: b * blocks].view(b, blocks).int() + 1
    values = (torch.randn(num_blocks, block_size, dim, generator=g)).to(torch.float8_e4m3fn).view(torch.uint8)
    scales = torch.exp2(torch.randint(-8, 0, (num_blocks, block_size), generator=g).float())
    cache = torch.cat([values.reshape(num_blocks, -1), scales.view(torch.uint8).reshape(num_blocks, -1)], 1)
    cache = cache.view(num_blocks, block_size, 1, dim + 4)
    q = torch.randn(b, next_n, heads, dim, generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(b * next_n, heads, generator=g)
    ctx = (lens[:, None] - next_n + 1 + torch.arange(next_n)[None, :]).int()
    to = dict(device=device)
    return q.to(**to), cache.to(**to), w.to(**to), ctx.to(**to), table.to(**to), max_model_len


def compare(real, mine, ends) -> float:
    worst = 0.0
    for i, end in enumerate(ends.tolist()):
        a, b = real[i, :end].double(), mine[i, :end].double()
        if end:
            worst = max(worst, float((a - b).abs().max() / (b.abs().max() + 1e-6)))
    return worst


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()
    from vllm.utils import deep_gemm as wrappers  # vLLM's wrappers over the real kernels

    device = "cuda"
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator().manual_seed(args.seed)
    rows, bad = [], 0
    for k in range(args.cases):
        heads, next_n = (64, 32)[k % 2], (1, 2, 4)[k % 3]
        q, cache, w, ctx, table, mml = paged_case(g, device, heads, next_n)
        meta = wrappers.get_paged_mqa_logits_metadata(ctx, cache.shape[1], num_sms)
        real = wrappers.fp8_fp4_paged_mqa_logits((q, None), cache, w, ctx, table, meta, max_model_len=mml)
        mine = standin.fp8_fp4_paged_mqa_logits((q, None), cache, w, ctx, table, meta, mml)
        err = compare(real.float(), mine, ctx.reshape(-1).cpu())
        rows.append(("paged", heads, next_n, int(ctx.max()), err))
        # the prefill form: one request's keys gathered flat, each query row its own causal range
        m, n = int(torch.randint(1, 64, (1,), generator=g)), int(torch.randint(64, 2048, (1,), generator=g))
        kq = torch.randn(n, 128, generator=g).to(torch.float8_e4m3fn).to(device)
        ks_scale = torch.exp2(torch.randint(-8, 0, (n,), generator=g).float()).to(device)
        qq = torch.randn(m, heads, 128, generator=g).to(torch.float8_e4m3fn).to(device)
        ww = torch.randn(m, heads, generator=g).to(device)
        ke = torch.randint(1, n + 1, (m,), generator=g).int()
        ks = (ke - torch.randint(0, 600, (m,), generator=g).int()).clamp(min=0)
        width = int((ke - ks).max())
        real = wrappers.fp8_fp4_mqa_logits((qq, None), (kq, ks_scale), ww, ks.to(device), ke.to(device), width)
        mine = standin.fp8_fp4_mqa_logits((qq, None), (kq, ks_scale), ww, ks.to(device), ke.to(device), width)
        err2 = compare(real.float(), mine, (ke - ks))
        rows.append(("prefill", heads, 1, width, err2))
    print(f"{'form':8} {'heads':>5} {'next_n':>6} {'len':>6} {'max rel diff':>12}")
    for form, heads, next_n, length, err in rows:
        flag = err > 1e-2
        bad += flag
        print(f"{form:8} {heads:5} {next_n:6} {length:6} {err:12.2e}{'  DIFFERS' if flag else ''}")
    print(f"deep_gemm_check: {len(rows)} calls, {bad} differ by more than 1e-2 of the row's largest logit")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"calls": len(rows), "differ": bad, "rows": rows}, f)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
