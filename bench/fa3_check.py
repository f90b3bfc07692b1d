"""attnfuzz's FA3 stand-in against vLLM's real FA3 sparse kernel, on the same inputs (GPU host, with vLLM 0.33.0's
vllm_flash_attn and its `_vllm_fa3_C` extension: scripts/gpu-kernels.sh install fa3, run with ATTNFUZZ_FA3=real).

Each case is one call as FLASH_ATTN_MLA_SPARSE's `_forward_mqa_kernel` makes it: one query token a batch
(cu_seqlens_q = arange), q = q_rope [T, H, 64] and q_v = q_nope [T, H, 512], k/v = the cache's rope and latent
columns as pages of one token ([slots, 1, 1, D]), block_table = the token's global top-k slots (-1 past its valid
count), seqused_k = the valid counts, causal, fa_version=3. Drawn: heads 8-128, top-k widths 64-2048, valid counts at
0, 1, top-k - 1, top-k and between, caches up to 64K slots. Compared: the real kernel's bf16 output against the
stand-in's (fp32, rounded to bf16) within attention's bf16 tolerance; rows with no valid key exactly (FA3 stores 0).
Prints one row; --json FILE writes it. Exit 0 all agree, 1 a difference, 2 FA3 cannot run on this host.
`--against standins` runs the stand-in on both sides, on the CPU: a check of this script, for hosts without FA3.

  ATTNFUZZ_FA3=real scripts/gpu-host.sh python3 bench/fa3_check.py [--cases 300] [--seed 0] [--json FILE]
      [--against real|standins]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from fuzzer.env import prepare_check_process

# Read before argparse: the device must be set up before torch is imported.
DEVICE = prepare_check_process("fa3_check", "standins")
import torch  # noqa: E402

from fuzzer.support.standins.flash_attn_ops import flash_attn_varlen_func as standin  # noqa: E402

NOPE, ROPE = 512, 64
ATOL, RTOL = 2e-2, 2e-2  # bf16 output of a softmax-weighted mean: a few ulps of bf16 at |out| ~ 1


def real_kernel():
    try:
        from vllm.vllm_flash_attn import flash_attn_interface as fa
    except ImportError as e:
        return None, f"vllm.vllm_flash_attn does not import: {e}"
    if not fa.FA3_AVAILABLE:
        return None, f"FA3's extension did not load: {getattr(fa, 'FA3_UNAVAILABLE_REASON', None)}"
    return fa.flash_attn_varlen_func, ""


def draw_case(g: torch.Generator, i: int) -> dict:
    def pick(seq):
        return seq[int(torch.randint(len(seq), (1,), generator=g))]

    heads, topk = pick((8, 16, 32, 64, 128)), pick((64, 128, 256, 512, 1024, 2048))
    tokens = pick((1, 2, 3, 7, 16, 33, 64))
    slots = pick((topk, 4096, 65536))
    kinds = (0, 1, topk - 1, topk, None)
    valid = [pick(kinds) for _ in range(tokens)]
    valid = [int(torch.randint(topk + 1, (1,), generator=g)) if v is None else v for v in valid]
    return {"heads": heads, "topk": topk, "tokens": tokens, "slots": slots, "valid": valid, "seed": i}


def tensors(c: dict, g: torch.Generator):
    t, h, k = c["tokens"], c["heads"], c["topk"]
    q_nope = torch.randn(t, h, NOPE, generator=g).to(torch.bfloat16)
    q_rope = torch.randn(t, h, ROPE, generator=g).to(torch.bfloat16)
    kv_rows = torch.randn(c["slots"], NOPE + ROPE, generator=g).to(torch.bfloat16)
    table = torch.randint(c["slots"], (t, k), generator=g, dtype=torch.int32)
    valid = torch.tensor(c["valid"], dtype=torch.int32)
    table[torch.arange(k)[None, :] >= valid[:, None].long()] = -1
    dev = lambda x: x.to(DEVICE)  # noqa: E731
    return dev(q_nope), dev(q_rope), dev(kv_rows), dev(table), dev(valid)


def call(fn, q_nope, q_rope, kv_rows, table, valid):
    """The call FlashAttnMLASparseImpl._forward_mqa_kernel makes (v1/attention/backends/mla/flashattn_mla_sparse.py)."""
    v_cache = kv_rows[:, :NOPE].unsqueeze(1).unsqueeze(1)
    k_cache = kv_rows[:, NOPE:].unsqueeze(1).unsqueeze(1)
    cu_seqlens_q = torch.arange(q_rope.shape[0] + 1, dtype=torch.int32, device=q_rope.device)
    return fn(q=q_rope, k=k_cache, v=v_cache, q_v=q_nope, max_seqlen_q=1, cu_seqlens_q=cu_seqlens_q,
              max_seqlen_k=table.shape[1], seqused_k=valid, block_table=table,
              softmax_scale=(NOPE + ROPE) ** -0.5, causal=True, fa_version=3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=str)
    p.add_argument("--against", choices=("real", "standins"), default="real")
    args = p.parse_args()
    fn, why = (standin, "") if args.against == "standins" else real_kernel()
    if fn is None:
        print(f"fa3_check: cannot compare: {why}")
        return 2
    g = torch.Generator().manual_seed(args.seed)
    row = {"op": "flash_attn_varlen_func (FA3, FLASH_ATTN_MLA_SPARSE's paged QV call)", "cases": 0,
           "differ": 0, "empty_rows": 0, "max_abs_err": 0.0, "worst": None, "errors": []}
    t0 = time.monotonic()
    for i in range(args.cases):
        c = draw_case(g, i)
        q_nope, q_rope, kv_rows, table, valid = tensors(c, g)
        try:
            got = call(fn, q_nope, q_rope, kv_rows, table, valid)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a refusal of a call vLLM makes is a difference too
            row["differ"] += 1
            row["errors"].append({**c, "error": f"{type(e).__name__}: {e}"[:300]})
            row["cases"] += 1
            continue
        want = call(standin, q_nope, q_rope, kv_rows, table, valid)
        empty = valid == 0
        row["empty_rows"] += int(empty.sum())
        err = (got.float() - want.float()).abs()
        over = err > ATOL + RTOL * want.float().abs()
        bad_empty = bool(empty.any()) and not torch.equal(got[empty], want[empty])
        worst = float(err.max()) if err.numel() else 0.0
        if worst > row["max_abs_err"]:
            row["max_abs_err"], row["worst"] = worst, {k: v for k, v in c.items() if k != "valid"}
        if bool(over.any()) or bad_empty or bool(got.isnan().any()):
            row["differ"] += 1
            row["errors"].append({**{k: v for k, v in c.items() if k != "valid"}, "max_abs_err": worst,
                                  "rows_over": int(over.any(-1).any(-1).sum()), "empty_rows_differ": bad_empty})
        row["cases"] += 1
    row["seconds"] = round(time.monotonic() - t0, 1)
    print(f"fa3_check: {row['op']}: {row['cases']} cases, {row['differ']} differ, max |real - stand-in| "
          f"{row['max_abs_err']:.4g} (tolerance {ATOL} + {RTOL} x |out|), {row['empty_rows']} rows with no valid key, "
          f"{row['seconds']} s")
    for e in row["errors"][:5]:
        print(f"  differs: {e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)
    return 1 if row["differ"] else 0


if __name__ == "__main__":
    sys.exit(main())
