"""attnfuzz's stand-ins for the sparse-attention indexer's compiled ops (fuzzer/support/standins/indexer_ops.py)
against the real ones, on the same inputs (GPU host with vLLM's `_C_stable_libtorch` loaded: the ops under
torch.ops._C_cache_ops / torch.ops._C). Per op, a grid of random in-bounds cases, each run through the stand-in and
through the real op on copies of the same tensors:
  indexer_k_quant_and_cache ("ue8m0", "fp32", "mxfp8")  the whole cache compared byte for byte
  cp_gather_indexer_k_quant_cache                       dst_k and dst_scale byte for byte (cache from the real writer)
  top_k_per_row_prefill / top_k_per_row_decode          per row, the written indices as a multiset (order is not
  persistent_topk / cooperative_topk                      promised; -1 fill counts), decode with 1-D and 2-D seq_lens
  indexer_k_quant_and_cache with 0 tokens               whether it fails, at once or at the next kernel launch
Caches start as random bytes, outputs as a sentinel, so a byte one side writes and the other does not shows. Scores
are random (ties improbable, since the kernels' choice among ties is unspecified). Out-of-bounds misuse is not run
through the real ops; the stand-ins' bounds checks are tested in tests/fuzzer/support/test_indexer_ops_standin.py.
Prints one row per op; --json FILE writes them. Exit 0 all equal, 1 a difference, 2 the real ops are not on this
host. --standin-only runs the stand-ins on both sides, on the CPU: a check of this script's cases.

  python bench/indexer_ops_check.py [--cases 50] [--seed 0] [--json FILE] [--standin-only] [--only NAME]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from fuzzer.env import prepare_check_process

# Read before argparse: the device must be set up before torch is imported.
STANDIN_ONLY = "--standin-only" in sys.argv
DEVICE = prepare_check_process("indexer_ops_check", "--standin-only")
import torch  # noqa: E402

from fuzzer.support.interp.sanitizer import SANITIZER  # noqa: E402
from fuzzer.support.standins import indexer_ops  # noqa: E402

HEAD_DIM = 128
REAL_OPS = (("_C_cache_ops", "indexer_k_quant_and_cache"), ("_C_cache_ops", "cp_gather_indexer_k_quant_cache"),
            ("_C", "top_k_per_row_prefill"), ("_C", "top_k_per_row_decode"), ("_C", "persistent_topk"),
            ("_C", "cooperative_topk"))
RADIX_TOPK_WORKSPACE_SIZE = 1024 * 1024


def real(name: str):
    """The compiled op, or with --standin-only the stand-in under the same name."""
    if STANDIN_ONLY:
        return getattr(indexer_ops, name)
    namespace = {n: ns for ns, n in REAL_OPS}[name]
    return getattr(getattr(torch.ops, namespace), name)


def missing_real_ops() -> list[str]:
    missing = []
    for namespace, name in REAL_OPS:
        try:
            getattr(getattr(torch.ops, namespace), name)
        except (AttributeError, RuntimeError):
            missing.append(f"{namespace}.{name}")
    return missing


class Draw:
    """One case's shapes and contents from a seeded generator."""

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def int(self, lo: int, hi: int) -> int:  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=self.g))

    def choice(self, options):
        return options[self.int(0, len(options) - 1)]

    def bytes(self, *shape) -> torch.Tensor:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=self.g).to(DEVICE)

    def keys(self, tokens: int) -> torch.Tensor:
        scale = torch.tensor([self.choice((1e-6, 0.01, 1.0, 30.0, 1000.0)) for _ in range(tokens)])
        return (torch.randn(tokens, HEAD_DIM, generator=self.g) * scale[:, None]).bfloat16().to(DEVICE)

    def scores(self, rows: int, width: int) -> torch.Tensor:
        return torch.randn(rows, width, generator=self.g).to(DEVICE)


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, str]:
    ua, ub = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    diff = ua != ub
    if not diff.any():
        return True, ""
    first = int(diff.reshape(-1).nonzero()[0])
    return False, f"{int(diff.sum())} bytes differ, first at byte {first} of {ua.numel()}"


def rows_equal(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, str]:
    """Each row's indices as a multiset (sorted), -1 fill included."""
    sa, sb = a.sort(1).values, b.sort(1).values
    bad = (sa != sb).any(1)
    if not bad.any():
        return True, ""
    r = int(bad.nonzero()[0])
    return False, (f"{int(bad.sum())} of {a.shape[0]} rows differ, first row {r}: stand-in "
                   f"{sa[r][:8].tolist()}..., real {sb[r][:8].tolist()}...")


def case_write(d: Draw, scale_fmt: str):
    num_blocks, block_size = d.int(1, 40), d.choice((16, 64))
    n = d.int(1, min(300, num_blocks * block_size))
    slots = torch.randperm(num_blocks * block_size, generator=d.g)[:n]
    slots[torch.rand(n, generator=d.g) < 0.1] = -1
    k, cache = d.keys(n), d.bytes(num_blocks, block_size, HEAD_DIM + 4)
    mine, theirs = cache.clone(), cache.clone()
    slot_mapping = slots.to(DEVICE)
    indexer_ops.indexer_k_quant_and_cache(k, mine, slot_mapping, HEAD_DIM, scale_fmt)
    real("indexer_k_quant_and_cache")(k, theirs, slot_mapping, HEAD_DIM, scale_fmt)
    return bytes_equal(mine, theirs), f"{n} tokens, {num_blocks}x{block_size} blocks, scale_fmt {scale_fmt!r}"


def case_gather(d: Draw):
    num_blocks, block_size = d.int(2, 40), d.choice((16, 64))
    cache = torch.empty(num_blocks, block_size, HEAD_DIM + 4, dtype=torch.uint8, device=DEVICE)
    real("indexer_k_quant_and_cache")(d.keys(num_blocks * block_size), cache,
                                      torch.arange(num_blocks * block_size, device=DEVICE), HEAD_DIM, "ue8m0")
    b, cols = d.int(1, 6), d.int(1, num_blocks)
    table = torch.stack([torch.randperm(num_blocks, generator=d.g)[:cols] for _ in range(b)]).int().to(DEVICE)
    lens = [d.int(0, cols * block_size) for _ in range(b)]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32).to(DEVICE)
    total = sum(lens) + d.int(0, 8)  # vLLM's workspace may hold more rows than cu_seq_lens covers
    if total == 0:
        total = 1
    dst_k, dst_s = d.bytes(total, HEAD_DIM), d.bytes(total, 4)
    mine_k, mine_s, real_k, real_s = dst_k.clone(), dst_s.clone(), dst_k.clone(), dst_s.clone()
    indexer_ops.cp_gather_indexer_k_quant_cache(cache, mine_k, mine_s, table, cu)
    real("cp_gather_indexer_k_quant_cache")(cache, real_k, real_s, table, cu)
    same_k, why_k = bytes_equal(mine_k, real_k)
    same_s, why_s = bytes_equal(mine_s, real_s)
    return (same_k and same_s, f"dst_k: {why_k} dst_scale: {why_s}"), f"{b} requests, {sum(lens)} of {total} rows"


def case_prefill(d: Draw):
    rows, width, k = d.int(1, 40), d.choice((600, 3000, 20000)), d.choice((512, 2048))
    starts = torch.tensor([d.int(0, width - 1) for _ in range(rows)])
    ends = torch.tensor([d.int(int(s), width) for s in starts])
    logits = d.scores(rows, width)
    out = torch.full((rows, k), -7, dtype=torch.int32, device=DEVICE)
    mine, theirs = out.clone(), out.clone()
    args = (logits, starts.int().to(DEVICE), ends.int().to(DEVICE))
    indexer_ops.top_k_per_row_prefill(*args, mine, rows, logits.stride(0), logits.stride(1), k)
    real("top_k_per_row_prefill")(*args, theirs, rows, logits.stride(0), logits.stride(1), k)
    return rows_equal(mine, theirs), f"{rows} rows of {width}, k={k}"


def case_decode(d: Draw, two_d: bool):
    batch, next_n, width, k = d.int(1, 16), d.choice((1, 2, 4)), d.choice((600, 3000, 20000)), d.choice((512, 2048))
    rows = batch * next_n
    seq_lens = torch.tensor([d.int(0, width) for _ in range(batch)], dtype=torch.int32)
    if two_d:
        n = torch.arange(next_n)
        seq_lens = (seq_lens[:, None] - next_n + n + 1).clamp_min(0).int()
    logits = d.scores(rows, width)
    out = torch.full((rows, k), -7, dtype=torch.int32, device=DEVICE)
    mine, theirs = out.clone(), out.clone()
    lens = seq_lens.to(DEVICE)
    indexer_ops.top_k_per_row_decode(logits, next_n, lens, mine, rows, logits.stride(0), logits.stride(1), k)
    real("top_k_per_row_decode")(logits, next_n, lens, theirs, rows, logits.stride(0), logits.stride(1), k)
    return rows_equal(mine, theirs), f"{batch}x{next_n} rows of {width}, {'2-D' if two_d else '1-D'}, k={k}"


def case_workspace(d: Draw, name: str):
    rows = d.int(1, 64 if name == "cooperative_topk" else 100)
    width, k = d.choice((1024, 4096, 40000)), d.choice((512, 1024, 2048))
    lengths = torch.tensor([d.int(0, width) for _ in range(rows)], dtype=torch.int32).to(DEVICE)
    logits = d.scores(rows, width)
    out = torch.full((rows, k), -7, dtype=torch.int32, device=DEVICE)
    mine, theirs = out.clone(), out.clone()
    workspace = torch.zeros(RADIX_TOPK_WORKSPACE_SIZE, dtype=torch.uint8, device=DEVICE)
    max_seq_len = int(lengths.max())
    getattr(indexer_ops, name)(logits, lengths, mine, workspace.clone(), k, max_seq_len)
    real(name)(logits, lengths, theirs, workspace.clone(), k, max_seq_len)
    return rows_equal(mine, theirs), f"{rows} rows of {width}, k={k}"


def after_empty_write(write) -> str:
    """'' if a write of 0 tokens leads to nothing, else the error and where it came (the write, or the next launch)."""
    cache = torch.zeros(2, 16, HEAD_DIM + 4, dtype=torch.uint8, device=DEVICE)
    try:
        write(torch.zeros(0, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE), cache,
              torch.zeros(0, dtype=torch.long, device=DEVICE), HEAD_DIM, "ue8m0")
    except Exception as e:
        return f"the write raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    try:
        torch.zeros(4, dtype=torch.int32, device=DEVICE).add_(1)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    except Exception as e:
        return f"the next launch raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return ""


def case_empty_write(d: Draw):
    mine = after_empty_write(indexer_ops.indexer_k_quant_and_cache)
    theirs = after_empty_write(real("indexer_k_quant_and_cache"))
    return (bool(mine) == bool(theirs), f"stand-in: {mine or 'nothing'}; real: {theirs or 'nothing'}"), "0 tokens"


# The misuse last: should the real op leave a launch error, whatever runs after it fails.
CASES = {
    "indexer_k_quant_and_cache[ue8m0]": lambda d: case_write(d, "ue8m0"),
    "indexer_k_quant_and_cache[fp32 scale]": lambda d: case_write(d, "none"),
    "indexer_k_quant_and_cache[mxfp8]": lambda d: case_write(d, "mxfp8"),
    "cp_gather_indexer_k_quant_cache": case_gather,
    "top_k_per_row_prefill": case_prefill,
    "top_k_per_row_decode[1-D seq_lens]": lambda d: case_decode(d, False),
    "top_k_per_row_decode[2-D seq_lens]": lambda d: case_decode(d, True),
    "persistent_topk": lambda d: case_workspace(d, "persistent_topk"),
    "cooperative_topk": lambda d: case_workspace(d, "cooperative_topk"),
    "indexer_k_quant_and_cache[0 tokens]": case_empty_write,
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", type=int, default=50, help="cases per op")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=str)
    p.add_argument("--standin-only", action="store_true", help="the stand-ins on both sides, on the CPU")
    p.add_argument("--only", default="", help="only the ops whose row name contains this")
    args = p.parse_args()
    if not STANDIN_ONLY:
        import vllm._custom_ops
        import vllm.platforms.cuda  # noqa: F401  (loads _C_stable_libtorch where it is installed)

        missing = missing_real_ops()
        if missing:
            print(f"indexer_ops_check: cannot compare: vLLM's compiled ops missing: {', '.join(missing)}")
            return 2
    rows = []
    print(f"{'op':42s} {'cases':>5s}  {'differ':>6s}  {'time':>8s}  first difference")
    for n, (op, case) in enumerate(CASES.items()):
        if args.only not in op:
            continue
        t0, differ, first, errors = time.time(), 0, "", 0
        count = 1 if op.endswith("[0 tokens]") else args.cases
        for i in range(count):
            d = Draw(args.seed * 1_000_003 + n * 10_007 + i)
            SANITIZER.violations.clear()
            try:
                (same, why), what = case(d)
                if SANITIZER.violations:  # the case itself was out of bounds: the comparison means nothing
                    same, why = False, f"the stand-in saw an out-of-bounds access: {SANITIZER.violations[0]}"
            except Exception as e:  # one side refusing what the other took is a difference too
                same, why, what, errors = False, f"{type(e).__name__}: {e}"[:300], f"case {i}", errors + 1
            if not same:
                differ += 1
                first = first or f"case {i} ({what}): {why}"
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        seconds = time.time() - t0
        rows.append(dict(op=op, cases=count, differ=differ, errors=errors, first=first, seconds=round(seconds, 1)))
        print(f"{op:42s} {count:5d}  {differ:6d}  {seconds:6.1f} s  {first}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(seed=args.seed, rows=rows, torch=torch.__version__, standin_only=STANDIN_ONLY,
                           source=indexer_ops.INDEXER_OPS_SOURCE,
                           device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"), f, indent=1)
    return 1 if any(r["differ"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
