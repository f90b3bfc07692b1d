#!/usr/bin/env python3
"""The FlashInfer stand-in's plan() and run() alone (`fuzzer.support.standins.flashinfer_mla`), as vLLM's
FLASHINFER_MLA_SPARSE_SM90 drives them (graph-mode wrapper, one batch row per token, pages of one token), against
an earlier revision's (--old): seconds per call (median of --reps after a warm-up), the torch operators one run()
dispatches (views and allocations not counted: on a GPU those on device tensors are each a launch or a copy), and
on a GPU the host syncs one run() makes.

  PYTHONPATH=. .venv/bin/python bench/flashinfer_standin_bench.py --old REV [--device cuda] [--shapes NAME,...]

--old may name a file (a GPU host gets no git history).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from flashinfer_standin_equiv import load_old  # noqa: E402

from fuzzer.support.standins import flashinfer_mla as new  # noqa: E402

# name: (tokens, heads, top-k width, fp8)
SHAPES = {
    "cpu-case": (12, 32, 256, False),  # the CPU profile's largest step
    "cpu-case-fp8-128h": (12, 128, 256, True),
    "mid-128h": (64, 128, 2048, True),
    "gpu-case": (512, 128, 2048, True),  # the GPU profile's largest step (a GPU only)
}


def setup(module, device, tokens, heads, width, fp8, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_tokens = tokens + 8
    bufs = dict(qo_indptr=torch.zeros(max_tokens + 1, dtype=torch.int32, device=device),
                kv_indptr=torch.zeros(max_tokens + 1, dtype=torch.int32, device=device),
                kv_indices=torch.zeros(max_tokens * width, dtype=torch.int32, device=device),
                kv_len_arr=torch.zeros(max_tokens, dtype=torch.int32, device=device))
    w = module.BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=device),
                                             use_cuda_graph=True, backend="fa3", **bufs)
    lens = torch.randint(width // 2, width + 1, (tokens,), generator=g)
    qo = torch.clamp(torch.arange(max_tokens + 1, dtype=torch.int32), max=tokens)
    kv_len = torch.zeros(max_tokens, dtype=torch.int32)
    kv_len[:tokens] = lens.int()
    kv = torch.zeros(max_tokens + 1, dtype=torch.int32)
    kv[1:] = torch.cumsum(kv_len, 0)
    pages = max(4096, tokens * width // 4)

    def plan():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            w.plan(qo, kv, bufs["kv_indices"][: max(int(kv[-1]), 1)], kv_len, heads, 512, 64, 1, False, 0.1,
                   q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn if fp8 else torch.bfloat16)

    plan()
    n = int(kv[-1])
    bufs["kv_indices"][:n] = torch.randint(0, pages, (n,), generator=g, dtype=torch.int32).to(device)
    q = torch.randn(tokens, heads, 576, generator=g).bfloat16().to(device)
    cache = (torch.randn(pages, 1, 576, generator=g) * 0.5).to(device)
    cache = cache.to(torch.float8_e4m3fn) if fp8 else cache.bfloat16()
    scales = dict(ckv_scale=0.5, kpe_scale=1.0) if fp8 else {}

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return w.run(q[..., :512], q[..., 512:], cache[..., :512], cache[..., 512:], **scales)

    return plan, run


def timed(fn, reps, device):
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# Operators that only make views or allocate: no kernel on a GPU.
VIEWS = {"view", "as_strided", "reshape", "_reshape_alias", "unsqueeze", "squeeze", "slice", "select", "permute",
         "expand", "t", "transpose", "alias", "detach", "empty", "empty_strided", "empty_like", "lift_fresh",
         "resolve_conj", "resolve_neg", "unbind", "split", "narrow", "view_as", "_unsafe_view", "result_type",
         "_local_scalar_dense", "item", "is_nonzero", "size", "stride", "numel", "dim", "to", "flatten", "resize_",
         "as_strided_", "real", "contiguous", "scalar_tensor"}


def operators(fn) -> int:
    """The torch operators one call runs, views and allocations not counted, nor an operator's own callees."""
    from torch.profiler import profile

    with profile() as prof:
        fn()
    def work(e) -> bool:
        return e.name.startswith("aten::") and e.name[6:] not in VIEWS

    return sum(1 for e in prof.events() if work(e) and not any(work(c) for c in e.cpu_children))


def syncs(fn) -> int:
    """Host-device synchronizations in one call (CUDA's sync debug mode warns at each)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shapes", default="cpu-case,cpu-case-fp8-128h,mid-128h")
    ap.add_argument("--gpu-chunks", action="store_true", help="the new stand-in's chunks as large as on a GPU")
    args = ap.parse_args()
    if args.gpu_chunks:
        new.CHUNK_BYTES["cpu"] = new.CHUNK_BYTES["cuda"]
    old = load_old(args.old)
    cuda = args.device == "cuda"
    print("| shape (tokens, heads, top-k, fp8) | plan s old / new | run s old / new | run's torch ops old / new |"
          + (" run's syncs old / new |" if cuda else ""))
    print("|---|---|---|---|" + ("---|" if cuda else ""))
    for name in args.shapes.split(","):
        row = []
        for module in (old, new):
            plan, run = setup(module, args.device, *SHAPES[name])
            row.append((timed(plan, args.reps, args.device), timed(run, args.reps, args.device), operators(run),
                        syncs(run) if cuda else 0))
        (po, ro, oo, so), (pn, rn, on, sn) = row
        print(f"| {name} {SHAPES[name]} | {po:.4f} / {pn:.4f} | {ro:.4f} / {rn:.4f} ({ro / rn:.1f}x) | {oo} / {on} |"
              + (f" {so} / {sn} |" if cuda else ""), flush=True)


if __name__ == "__main__":
    main()
