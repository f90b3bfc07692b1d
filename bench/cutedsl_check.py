"""vLLM's two DeepSeek-V4 K-cache dequantize-and-gather kernels against each other, on the same inputs (GPU host,
with the CuTe-DSL stack: scripts/gpu-kernels.sh install cutedsl, run with ATTNFUZZ_CUTEDSL=real).

vLLM picks one by `has_cutedsl()`: the CuTe-DSL kernel (deepseek_v4/nvidia/ops/dequant_gather_k_cutedsl.py) where
`cutlass` imports, else the Triton one; attnfuzz's campaigns see whichever the host has. Here both run on copies of
each case: V4's 584-byte record (448 fp8 dims in UE8M0 groups of 64, a bf16 RoPE tail, the scales after the block's
data: the Triton `DequantizeAndGatherKCacheKernel`) and V4.1's 528-byte MXFP8 record (512 fp8 dims in groups of 32,
each token's scales after its data: V4.1's `dequantize_and_gather_k_cache_triton`), with and without `gather_lens`
(the SWA and compressed gathers), page sizes 1-128, offsets into the workspace, empty requests. Caches are bytes whose
every reading (fp8 value, UE8M0 scale, bf16 half) is finite and whose products stay normal in bf16, so the two
kernels must agree bit for bit; the workspace starts as NaN, so a row one writes and the other does not shows.
Exit 0 all equal, 1 a difference, 2 the CuTe-DSL kernel cannot run here. `--against triton` runs the Triton kernel on
both sides, on the CPU under Triton's interpreter: a check of this script's cases, for hosts without CuTe-DSL.

  ATTNFUZZ_CUTEDSL=real scripts/gpu-host.sh python3 bench/cutedsl_check.py [--cases 200] [--seed 0] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from fuzzer.env import prepare_check_process

# Read before argparse: the device must be set up before torch is imported.
DEVICE = prepare_check_process("cutedsl_check", "triton")
import torch  # noqa: E402

HEAD_DIM = 512
RECORDS = {"v4-584": dict(record=584, data=576, fp8_dim=448, group=64),
           "v41-mxfp8-528": dict(record=528, data=528, fp8_dim=512, group=32)}
# Bytes that read as finite everywhere: as e4m3 |x| in [2^6, 448) (0x6b-0x7e, 0xeb-0xf6 negative), as UE8M0 scales
# 2^-20 .. 2^-1 and 2^108 .. 2^119 (products under bf16's max), as bf16 halves no Inf/NaN exponent.
SAFE_BYTES = torch.tensor(list(range(0x6b, 0x7f)) + list(range(0xeb, 0xf7)), dtype=torch.uint8)


def kernels(variant: str, against: str):
    if variant == "v4-584":
        from vllm.models.deepseek_v4.common.ops import cache_utils

        triton_kernel = cache_utils._DEQUANTIZE_AND_GATHER_K_CACHE_KERNEL

        def triton(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset):
            triton_kernel(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, use_fnuz=False)
    else:
        from vllm.models.deepseek_v41.common.ops.cache_utils import dequantize_and_gather_k_cache_triton as triton
    if against == "triton":
        return triton, triton
    from vllm.models.deepseek_v4.nvidia.ops import dequant_gather_k_cutedsl

    cute = dequant_gather_k_cutedsl._DEQUANT_GATHER_K_CACHE_CUTEDSL_KERNEL

    rec = RECORDS[variant]

    def cutedsl(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset):
        cute(out=out, k_cache=k_cache, seq_lens=seq_lens, gather_lens=gather_lens, block_table=block_table,
             block_size=block_size, offset=offset, fp8_dim=rec["fp8_dim"], group_size=rec["group"])
    return cutedsl, triton


def draw_case(g: torch.Generator, variant: str) -> dict:
    def rint(lo, hi):  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    # Triton compiles a kernel per (block size, table width, page stride, offset, gather_lens or not): few widths and
    # offsets keep the compiles to dozens, so each record's cases finish in minutes on the GPU host.
    block_size = (1, 2, 16, 32, 64, 128)[rint(0, 5)]
    reqs, max_blocks = rint(1, 6), (3, 12)[rint(0, 1)]
    seq_lens = [(0, 1, block_size, max_blocks * block_size, None)[rint(0, 4)] for _ in range(reqs)]
    seq_lens = [rint(0, max_blocks * block_size) if s is None else s for s in seq_lens]
    with_gather = bool(rint(0, 1))
    gather = [rint(0, s) for s in seq_lens] if with_gather else None
    offset = (0, 0, 96)[rint(0, 2)]  # 0: the compressed gather; past it: the SWA gather after chunk_N entries
    return {"variant": variant, "block_size": block_size, "reqs": reqs, "max_blocks": max_blocks,
            "num_blocks": reqs * max_blocks + rint(0, 8), "seq_lens": seq_lens, "gather_lens": gather, "offset": offset}


def tensors(c: dict, g: torch.Generator):
    rec = RECORDS[c["variant"]]
    # A page as vLLM lays it out: block_size records, padded to the 576-byte alignment of the cache spec.
    page_bytes = -(-c["block_size"] * rec["record"] // 576) * 576
    raw = SAFE_BYTES[torch.randint(len(SAFE_BYTES), (c["num_blocks"], page_bytes), generator=g)]
    k_cache = torch.as_strided(raw.to(DEVICE), (c["num_blocks"], c["block_size"], rec["record"]),
                               (page_bytes, rec["record"], 1))
    table = torch.stack([torch.randperm(c["num_blocks"], generator=g)[:c["max_blocks"]] for _ in range(c["reqs"])])
    seq = torch.tensor(c["seq_lens"], dtype=torch.int32)
    gathered = torch.tensor(c["gather_lens"] if c["gather_lens"] is not None else c["seq_lens"], dtype=torch.int32)
    tokens = c["offset"] + max(1, int(gathered.max()))
    out = torch.full((c["reqs"], tokens, HEAD_DIM), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    gather = gathered.to(DEVICE) if c["gather_lens"] is not None else None
    return out, k_cache, seq.to(DEVICE), gather, table.to(torch.int32).to(DEVICE)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", type=int, default=200, help="cases per record")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=str)
    p.add_argument("--against", choices=("cutedsl", "triton"), default="cutedsl")
    args = p.parse_args()
    try:
        from vllm.utils.import_utils import has_cutedsl

        if args.against == "cutedsl" and not has_cutedsl():
            raise ImportError("`cutlass` does not import (vLLM's has_cutedsl() is False)")
        impls = {v: kernels(v, args.against) for v in RECORDS}
    except ImportError as e:
        print(f"cutedsl_check: cannot compare: {e}")
        return 2
    g = torch.Generator().manual_seed(args.seed)
    rows, failed = [], False
    for variant, (cutedsl, triton) in impls.items():
        row = {"kernel": f"dequantize_and_gather_k_cache[{variant}]", "cases": 0, "differ": 0, "elements": 0,
               "written": 0, "errors": [], "seconds": 0.0}
        t0 = time.monotonic()
        for _ in range(args.cases):
            c = draw_case(g, variant)
            out, k_cache, seq, gather, table = tensors(c, g)
            outs = {}
            for name, fn in (("triton", triton), ("cutedsl", cutedsl)):
                o = out.clone()
                try:
                    fn(o, k_cache, seq, gather, table, c["block_size"], c["offset"])
                    if DEVICE == "cuda":
                        torch.cuda.synchronize()
                    outs[name] = o
                except Exception as e:  # noqa: BLE001 - one refusing a call the other takes is a difference
                    outs[name] = f"{type(e).__name__}: {e}"[:300]
            row["cases"] += 1
            a, b = outs["triton"], outs["cutedsl"]
            if isinstance(a, str) or isinstance(b, str):
                row["differ"] += 1
                row["errors"].append({**c, "triton": a if isinstance(a, str) else "ok",
                                      "cutedsl": b if isinstance(b, str) else "ok"})
                continue
            same = a.view(torch.int16) == b.view(torch.int16)
            row["elements"] += same.numel()
            row["written"] += int((~a.isnan()).sum())  # gathered, not the NaN the workspace started as
            if not bool(same.all()):
                row["differ"] += 1
                bad = (~same).nonzero()
                row["errors"].append({**c, "elements_differ": int((~same).sum()),
                                      "first": [int(x) for x in bad[0]],
                                      "triton": float(a[tuple(bad[0])]), "cutedsl": float(b[tuple(bad[0])])})
        row["seconds"] = round(time.monotonic() - t0, 1)
        failed |= row["differ"] > 0
        rows.append(row)
        print(f"cutedsl_check: {row['kernel']}: {row['cases']} cases, {row['differ']} differ "
              f"({row['elements']} bf16 elements compared, {row['written']} of them gathered), {row['seconds']} s")
        for e in row["errors"][:3]:
            print(f"  differs: {e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
