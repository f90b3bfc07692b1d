"""attnfuzz's stand-ins for vLLM's compiled cache ops against the real ops, on the same inputs (GPU host, with
vLLM's `_C_stable_libtorch` linked in: scripts/gpu-ops.sh). Per op, random in-bounds cases, each run through the
stand-in and through the real op on copies of the same tensors:
  concat_and_cache_mla (bf16 and fp8_ds_mla caches)     the whole cache compared byte for byte
  cp_gather_and_upconvert_fp8_kv_cache                  the workspace compared bit for bit
  gather_and_maybe_dequant_cache (bf16; fp8_ds_mla as   the workspace compared bit for bit (NaN == NaN)
    flat fp8, the misuse behind vLLM issue 48611 bug 2)
  concat_mla_q                                          q_out compared bit for bit
  cp_gather_cache (bf16: DCP's context gather, 0.34)    the workspace compared bit for bit
  concat_and_cache_mla with 0 tokens (fp8_ds_mla, bf16) whether it fails, at once or at the next kernel launch
    (the real op launches a grid of num_tokens blocks with no launch check: an empty grid's launch error surfaces
    at whatever launches next, far from its cause; the stand-in raises at the call)
Caches start as random bytes, outputs as NaN, so a row an op writes and the other does not shows. Out-of-bounds
misuse is not run through the real op (it would corrupt device memory): the stand-ins' bounds checks are tested
on their own in tests/. Prints one row per op; --json FILE writes them. Exit 0 all equal, 1 a difference, 2 the
real ops are not on this host. `--against standins` runs the stand-ins on both sides, on the CPU: a check of
this script's cases, for hosts without the real ops (tests/bench).

  python bench/cache_ops_check.py [--cases 200] [--seed 0] [--json FILE] [--against real|standins] [--only NAME]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from fuzzer.env import prepare_check_process

# Read before argparse: the device must be set up before torch is imported.
AGAINST = "standins" if "standins" in sys.argv else "real"
DEVICE = prepare_check_process("cache_ops_check", "standins")
import torch  # noqa: E402

from fuzzer.support import flashmla_runtime  # noqa: E402
from fuzzer.support.interp.sanitizer import SANITIZER  # noqa: E402
from fuzzer.support.standins import cache_ops, flashmla_ops  # noqa: E402

# The misuse last: should the real op fault on it, the CUDA context is lost for whatever runs after it.
OPS = ("concat_and_cache_mla[bf16]", "concat_and_cache_mla[fp8_ds_mla]", "cp_gather_and_upconvert_fp8_kv_cache",
       "gather_and_maybe_dequant_cache[bf16]", "concat_mla_q", "concat_and_cache_mla[fp8_ds_mla, 0 tokens]",
       "concat_and_cache_mla[bf16, 0 tokens]", "gather_and_maybe_dequant_cache[fp8_ds_mla as flat fp8]",
       "cp_gather_cache[bf16]")
NOPE, ROPE, ENTRY = 512, 64, 656


def real_ops():
    """vLLM's _custom_ops (the compiled ops), or with --against standins the stand-ins under the same names."""
    if AGAINST == "real":
        from vllm import _custom_ops

        return _custom_ops
    from types import SimpleNamespace
    return SimpleNamespace(concat_and_cache_mla=flashmla_ops.concat_and_cache_mla,
                           cp_gather_and_upconvert_fp8_kv_cache=flashmla_ops.cp_gather_and_upconvert_fp8_kv_cache,
                           gather_and_maybe_dequant_cache=cache_ops.gather_and_maybe_dequant_cache,
                           cp_gather_cache=cache_ops.cp_gather_cache,
                           concat_mla_q=flashmla_ops.concat_mla_q)


def random_bytes(shape, g) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(DEVICE)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, str]:
    ua, ub = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    diff = (ua != ub)
    if not diff.any():
        return True, ""
    first = int(diff.reshape(-1).nonzero()[0])
    return False, f"{int(diff.sum())} bytes differ, first at byte {first} of {ua.numel()}"


class Draw:
    """One case's shapes and contents from a seeded generator."""

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def int(self, lo: int, hi: int) -> int:  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=self.g))

    def choice(self, options):
        return options[self.int(0, len(options) - 1)]

    def normal(self, *shape, scale=1.0):
        return (torch.randn(*shape, generator=self.g) * scale).bfloat16().to(DEVICE)

    def cache_geometry(self):
        block_size = self.choice((16, 64, 128))
        return self.int(2, 40), block_size

    def requests(self, num_blocks, block_size):
        """block_table [b, cols] (distinct blocks per row), each request's length and start (seq_starts)."""
        b = self.int(1, 6)
        cols = self.int(1, num_blocks)
        table = torch.stack([torch.randperm(num_blocks, generator=self.g)[:cols] for _ in range(b)]).int()
        starts = [self.int(0, cols * block_size - 1) for _ in range(b)]
        lens = [self.int(0, cols * block_size - s) for s in starts]
        return table.to(DEVICE), lens, starts


def case_concat_and_cache(d: Draw, dtype: str):
    num_blocks, block_size = d.cache_geometry()
    n = d.int(1, min(200, num_blocks * block_size))
    slots = torch.randperm(num_blocks * block_size, generator=d.g)[:n]
    slots[torch.rand(n, generator=d.g) < 0.1] = -1  # padding tokens
    kv_c, k_pe = d.normal(n, NOPE, scale=d.choice((0.01, 1.0, 30.0))), d.normal(n, ROPE)
    if dtype == "fp8_ds_mla":
        kv_c[d.int(0, n - 1)] = 0  # an all-zero tile: the scale's floor
        cache = random_bytes((num_blocks, block_size, ENTRY), d.g)
    else:
        cache = random_bytes((num_blocks, block_size, (NOPE + ROPE) * 2), d.g).view(torch.bfloat16)
    scale = torch.ones(1, dtype=torch.float32, device=DEVICE)
    slot_mapping = slots.long().to(DEVICE)
    mine, real = cache.clone(), cache.clone()
    flashmla_ops.concat_and_cache_mla(kv_c, k_pe, mine, slot_mapping, dtype, scale)
    ops = real_ops()
    ops.concat_and_cache_mla(kv_c, k_pe, real, slot_mapping, dtype, scale)
    return bits_equal(mine, real), f"{n} tokens, {num_blocks}x{block_size} blocks"


def fp8_cache(d: Draw, num_blocks, block_size) -> torch.Tensor:
    """A cache every entry of which the real writer wrote (valid 656-byte entries)."""
    ops = real_ops()
    cache = torch.empty((num_blocks, block_size, ENTRY), dtype=torch.uint8, device=DEVICE)
    n = num_blocks * block_size
    ops.concat_and_cache_mla(d.normal(n, NOPE, scale=3.0), d.normal(n, ROPE), cache,
                             torch.arange(n, device=DEVICE), "fp8_ds_mla", torch.ones(1, device=DEVICE))
    return cache


def case_cp_gather_fp8(d: Draw):
    ops = real_ops()
    num_blocks, block_size = d.cache_geometry()
    cache = fp8_cache(d, num_blocks, block_size)
    table, lens, starts = d.requests(num_blocks, block_size)
    b = table.shape[0]
    workspace_starts = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)[:-1].tolist()), dtype=torch.int32).to(DEVICE)
    total = sum(lens)
    seq_starts = torch.tensor(starts, dtype=torch.int32).to(DEVICE) if d.int(0, 1) else None
    if seq_starts is None:  # lengths from position 0: keep them inside the table
        lens = [min(n + s, table.shape[1] * block_size) for n, s in zip(lens, starts)]
        workspace_starts = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)[:-1].tolist()),
                                        dtype=torch.int32).to(DEVICE)
        total = sum(lens)
    dst = torch.full((max(total, 1), NOPE + ROPE), float("nan"), dtype=torch.bfloat16, device=DEVICE)[:total]
    mine, real = dst.clone(), dst.clone()
    flashmla_ops.cp_gather_and_upconvert_fp8_kv_cache(cache, mine, table, workspace_starts, b, seq_starts)
    ops.cp_gather_and_upconvert_fp8_kv_cache(cache, real, table, workspace_starts, b, seq_starts)
    return bits_equal(mine, real), f"{b} requests, {total} tokens, seq_starts {'set' if seq_starts is not None else 'none'}"


def case_gather_dequant(d: Draw, dtype: str):
    ops = real_ops()
    num_blocks, block_size = d.cache_geometry()
    table, lens, starts = d.requests(num_blocks, block_size)
    b = table.shape[0]
    if dtype == "fp8_ds_mla":
        cache, scale = fp8_cache(d, num_blocks, block_size), torch.tensor([d.choice((1.0, 0.5, 2.0))], device=DEVICE)
    else:
        cache = d.normal(num_blocks, block_size, NOPE + ROPE)
        scale = torch.ones(1, device=DEVICE)
    use_starts = d.int(0, 1)
    if not use_starts:
        lens = [min(n + s, table.shape[1] * block_size) for n, s in zip(lens, starts)]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    total = int(cu[-1])
    token_to_seq = torch.repeat_interleave(torch.arange(b, dtype=torch.int32), torch.tensor(lens)).to(DEVICE)
    num_tokens = total - d.int(0, min(total, 3))  # vLLM may gather fewer tokens than the map holds
    dst = torch.full((total + d.int(0, 4), NOPE + ROPE), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    mine, real = dst.clone(), dst.clone()
    seq_starts = torch.tensor(starts, dtype=torch.int32).to(DEVICE) if use_starts else None
    args = (table, cu.to(DEVICE), token_to_seq, num_tokens, dtype if dtype != "bf16" else "auto", scale, seq_starts)
    cache_ops.gather_and_maybe_dequant_cache(cache, mine, *args)
    ops.gather_and_maybe_dequant_cache(cache, real, *args)
    return bits_equal(mine, real), f"{b} requests, {num_tokens} of {total} tokens"


def case_cp_gather(d: Draw):
    """DCP's bf16 context gather: each request's rows at cu_seq_lens, its positions from seq_starts (or 0)."""
    ops = real_ops()
    num_blocks, block_size = d.cache_geometry()
    table, lens, starts = d.requests(num_blocks, block_size)
    cache = d.normal(num_blocks, block_size, NOPE + ROPE)
    use_starts = d.int(0, 1)
    if not use_starts:
        lens = [min(n + s, table.shape[1] * block_size) for n, s in zip(lens, starts)]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32).to(DEVICE)
    total = int(cu[-1])
    dst = torch.full((total + d.int(0, 4), NOPE + ROPE), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    mine, real = dst.clone(), dst.clone()
    seq_starts = torch.tensor(starts, dtype=torch.int32).to(DEVICE) if use_starts else None
    cache_ops.cp_gather_cache(cache, mine, table, cu, table.shape[0], seq_starts)
    ops.cp_gather_cache(cache, real, table, cu, table.shape[0], seq_starts)
    return bits_equal(mine, real), f"{table.shape[0]} requests, {total} tokens"


def case_concat_mla_q(d: Draw):
    ops = real_ops()
    t, h = d.int(1, 300), d.choice((1, 8, 16, 32, 64, 128))
    heads_out = h if d.int(0, 2) else d.choice((64, 128)) if h < 64 else h  # FlashMLA pads q to 64/128 heads
    # vLLM hands the bmm's output transposed (non-contiguous) and q_pe a slice of q
    ql_nope = d.normal(h, t, NOPE).transpose(0, 1)
    q_pe = d.normal(t, h, 128 + ROPE)[..., 128:]
    q_out = torch.full((t, heads_out, NOPE + ROPE), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    mine, real = q_out.clone(), q_out.clone()
    flashmla_ops.concat_mla_q(ql_nope, q_pe, mine)
    ops.concat_mla_q(ql_nope, q_pe, real)  # as FlashMLA sparse calls it: q_out its head-padded buffer
    return bits_equal(mine, real), f"{t} tokens, {h} heads into {heads_out}"


def after_empty_write(write, kv_cache_dtype: str) -> str:
    """What a write of 0 tokens leads to: '' if nothing, else the error and where it came (the write itself, as
    the stand-in raises, or the first kernel launch after it: PyTorch checks the last launch error after each of
    its own launches, so a pending one from the write surfaces there)."""
    num_blocks, block_size = 2, 64
    if kv_cache_dtype == "fp8_ds_mla":
        cache = torch.zeros((num_blocks, block_size, ENTRY), dtype=torch.uint8, device=DEVICE)
    else:
        cache = torch.zeros((num_blocks, block_size, NOPE + ROPE), dtype=torch.bfloat16, device=DEVICE)
    empty = torch.zeros(0, NOPE + ROPE, dtype=torch.bfloat16, device=DEVICE)
    try:
        write(empty[:, :NOPE], empty[:, NOPE:], cache, torch.zeros(0, dtype=torch.long, device=DEVICE),
              kv_cache_dtype, torch.ones(1, device=DEVICE))
    except Exception as e:  # refused outright: as clear as it gets
        return f"the write raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    try:
        torch.zeros(4, dtype=torch.int32, device=DEVICE).add_(1)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    except Exception as e:
        return f"the next launch raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return ""


def case_empty_concat_and_cache(d: Draw, kv_cache_dtype: str):
    """Equal when both fail or neither does: the stand-in cannot leave a launch error pending, so it raises at once."""
    mine = after_empty_write(flashmla_ops.concat_and_cache_mla, kv_cache_dtype)
    real = after_empty_write(real_ops().concat_and_cache_mla, kv_cache_dtype)
    return (bool(mine) == bool(real), f"stand-in: {mine or 'nothing'}; real: {real or 'nothing'}"), "0 tokens"


CASES = {
    OPS[0]: lambda d: case_concat_and_cache(d, "auto"),
    OPS[1]: lambda d: case_concat_and_cache(d, "fp8_ds_mla"),
    OPS[2]: case_cp_gather_fp8,
    OPS[3]: lambda d: case_gather_dequant(d, "bf16"),
    OPS[4]: case_concat_mla_q,
    OPS[5]: lambda d: case_empty_concat_and_cache(d, "fp8_ds_mla"),
    OPS[6]: lambda d: case_empty_concat_and_cache(d, "auto"),
    OPS[7]: lambda d: case_gather_dequant(d, "fp8_ds_mla"),
    OPS[8]: case_cp_gather,
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", type=int, default=200, help="cases per op")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=str)
    p.add_argument("--against", choices=("real", "standins"), default="real")
    p.add_argument("--only", default="", help="only the ops whose row name contains this")
    args = p.parse_args()
    if AGAINST == "real":
        import vllm.platforms.cuda  # noqa: F401  (loads _C_stable_libtorch where it is installed)

        missing = [n for n in ("concat_and_cache_mla", "cp_gather_and_upconvert_fp8_kv_cache",
                               "gather_and_maybe_dequant_cache", "concat_mla_q") if not flashmla_runtime.has_cache_op(n)]
        if missing:
            print(f"cache_ops_check: cannot compare: vLLM's compiled ops missing: {', '.join(missing)} "
                  "(scripts/gpu-ops.sh)")
            return 2
    rows = []
    for k, (op, case) in enumerate(CASES.items()):
        if args.only not in op:
            continue
        t0, differ, first, errors = time.time(), 0, "", 0
        for i in range(args.cases):
            d = Draw(args.seed * 1_000_003 + k * 10_007 + i)
            SANITIZER.violations.clear()
            try:
                (same, why), what = case(d)
                if SANITIZER.violations:  # this script's case was out of bounds: the comparison means nothing
                    same, why = False, f"the stand-in saw an out-of-bounds access: {SANITIZER.violations[0]}"
            except Exception as e:  # an op refusing a case the other took is a difference too
                same, why, what, errors = False, f"{type(e).__name__}: {e}"[:300], f"case {i}", errors + 1
            if not same:
                differ += 1
                first = first or f"case {i} ({what}): {why}"
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        rows.append(dict(op=op, cases=args.cases, differ=differ, errors=errors, first=first,
                         seconds=round(time.time() - t0, 1)))
        print(f"{op:58s} {args.cases:5d} cases  {differ:4d} differ  {time.time() - t0:6.1f} s  {first}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(seed=args.seed, rows=rows, torch=torch.__version__,
                           against=AGAINST, device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"),
                      f, indent=1)
    return 1 if any(r["differ"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
