"""attnfuzz's DeepGEMM stand-ins (fuzzer/support/standins/deep_gemm.py) against vLLM 0.33.0's vendored DeepGEMM
(`vllm.third_party.deep_gemm`, 2.8.1) on a GPU host that can import it (an H100/H200: the stand-ins model SM90).
Random indexer-shaped calls, the same inputs to both sides, one table row per case family:
  metadata   get_paged_mqa_logits_metadata compared exactly (the SM90 split of 256-token segments over SMs)
  rows       fp8_fp4_paged_mqa_logits (on the real metadata) within each row's own length context_lens[b, n], as a
             share of the row's largest logit: Hopper's FP8 tensor cores accumulate with ~14 mantissa bits, so the
             kernel and the stand-in's fp32 differ by up to ~4e-3 (H100); a wrong key, scale, weight or Q differs by
             order 1. Over --tol (1e-2) is a difference. The max absolute difference is reported too.
  tails      the same calls past each row's own length up to the kernel's last written split
             (ceil(context_lens[b, -1] / 256) * 256): future tokens, the last page's stale tokens, block 0's
             (informational: how many cases the stand-in's model of that garbage misses)
  prefill    fp8_fp4_mqa_logits' compressed rows within [0, ke - ks)
Families: paged (next_n 1/2/4, heads 32/64, lengths from 0 to a few thousand, partial last pages, padding rows of
length 0 at the end), skip (requests of length 0 between long ones, more 256-token segments than SMs, so one SM's
range crosses them: the case where the kernel's one-request-ahead Q prefetch meets the scheduler's skip) and prefill
(empty rows, ks == ke). Caches are random everywhere, block 0 included, so garbage is comparable.
Exit 0 all equal, 1 a difference, 2 the real DeepGEMM is not importable. `--against standins` (or
`--standin-only`) runs the stand-ins on both sides on the CPU: a check of this script's cases (16 SMs).

  python bench/deep_gemm_check.py [--cases 20] [--seed 0] [--tol 1e-2] [--json FILE] [--against real|standins]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

from fuzzer.env import prepare_check_process

# Read before argparse: the device must be set up before torch is imported.
AGAINST = "standins" if ("standins" in sys.argv or "--standin-only" in sys.argv) else "real"
DEVICE = prepare_check_process("deep_gemm_check", "--standin-only" if "--standin-only" in sys.argv else "standins")
import torch  # noqa: E402

from fuzzer.support.interp.sanitizer import SANITIZER  # noqa: E402
from fuzzer.support.standins import deep_gemm as standin  # noqa: E402

HEAD_DIM, SPLIT = 128, 256
E4M3 = torch.float8_e4m3fn


def real_module():
    """vLLM's vendored DeepGEMM, or with --against standins the stand-ins under its names."""
    if AGAINST == "real":
        return importlib.import_module("vllm.third_party.deep_gemm")
    return standin.standin_module()


class Draw:
    """One case's shapes and contents from a seeded generator."""

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def int(self, lo: int, hi: int) -> int:  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=self.g))

    def choice(self, options):
        return options[self.int(0, len(options) - 1)]

    def fp8(self, *shape):
        return torch.randn(*shape, generator=self.g).to(E4M3)


def paged_inputs(d: Draw, lens: list[int], next_n: int, heads: int, block_size: int, max_model_len: int):
    """q, kv_cache (block-major: values, then one fp32 scale per token), weights, 2-D context_lens as vLLM builds
    them (request length L: rows L - next_n + 1 + n, floored at 0), block_table (distinct blocks >= 1)."""
    b = len(lens)
    width = max(1, max(-(-n // block_size) for n in lens))
    num_blocks = b * width + 1 + d.int(0, 4)
    values = d.fp8(num_blocks, block_size, HEAD_DIM).view(torch.uint8).reshape(num_blocks, -1)
    scales = torch.exp2(torch.randint(-8, 1, (num_blocks, block_size), generator=d.g).float())
    cache = torch.cat([values, scales.view(torch.uint8).reshape(num_blocks, -1)], 1)
    cache = cache.view(num_blocks, block_size, 1, HEAD_DIM + 4)
    table = (torch.randperm(num_blocks - 1, generator=d.g)[: b * width] + 1).view(b, width).int()
    q = d.fp8(b, next_n, heads, HEAD_DIM)
    w = torch.randn(b * next_n, heads, generator=d.g)
    ctx = (torch.tensor(lens)[:, None] - next_n + 1 + torch.arange(next_n)[None, :]).clamp(min=0).int()
    return [t.to(DEVICE) for t in (q, cache, w, ctx, table)] + [max_model_len]


def draw_paged(d: Draw):
    next_n, heads, block_size = d.choice((1, 2, 4)), d.choice((32, 64)), 64
    lens = [d.choice((0, d.int(1, 64), d.int(1, 700), d.int(65, 3000), 64 * d.int(1, 20)))
            for _ in range(d.int(1, 10))]
    lens += [0] * d.int(0, 2)  # padding requests at the end, as CUDA-graph padding makes them
    mml = max(max(lens), 1) + d.choice((0, d.int(1, 300)))
    return next_n, heads, block_size, lens, mml


def draw_skip(d: Draw):
    """Long requests with empty ones between: more segments than SMs, so an SM's range crosses an empty request."""
    next_n, heads = d.choice((1, 2, 4)), d.choice((32, 64))
    long = (4000, 16000) if AGAINST == "real" else (800, 3000)
    lens = []
    for _ in range(d.int(4, 8)):
        lens += [d.int(*long), 0] if d.int(0, 3) else [d.int(*long)]
    return next_n, heads, 64, lens, max(lens) + d.int(0, 100)


def rel(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a - b| / max |b|, max |a - b|) over the elements given."""
    if a.numel() == 0:
        return 0.0, 0.0
    diff = float((a.double() - b.double()).abs().max())
    return diff / (float(b.double().abs().max()) + 1e-6), diff


def case_paged(d: Draw, draw, tol: float) -> dict:
    next_n, heads, block_size, lens, mml = draw(d)
    q, cache, w, ctx, table, mml = paged_inputs(d, lens, next_n, heads, block_size, mml)
    real = real_module()
    slots = standin.NUM_SMS // (2 if next_n == 4 else 1)  # vLLM's _paged_mqa_logits_schedule_slots on SM90
    meta_real = real.get_paged_mqa_logits_metadata(ctx, block_size, slots)
    meta_mine = standin.get_paged_mqa_logits_metadata(ctx, block_size, slots)
    out = dict(what=f"next_n {next_n}, {heads} heads, lengths {lens}, max_model_len {mml}",
               metadata_same=bool(torch.equal(meta_real.cpu(), meta_mine.cpu())))
    got_real = real.fp8_fp4_paged_mqa_logits((q, None), cache, w, ctx, table, meta_real, mml).float()
    got_mine = standin.fp8_fp4_paged_mqa_logits((q, None), cache, w, ctx, table, meta_real, mml)
    worst, worst_abs, tail_worst, first_row = 0.0, 0.0, 0.0, None
    for row, own in enumerate(ctx.reshape(-1).tolist()):
        last = int(ctx[row // next_n, -1])
        r, a = rel(got_real[row, :own], got_mine[row, :own])
        if r > worst:
            worst, worst_abs = r, a
        if r > tol and first_row is None:
            first_row = f"row {row} (request {row // next_n}, length {own}): {r:.2e} of its largest logit"
        end = min(-(-last // SPLIT) * SPLIT, mml)
        tail_worst = max(tail_worst, rel(got_real[row, own:end], got_mine[row, own:end])[0])
    out.update(rows_rel=worst, rows_abs=worst_abs, rows_same=worst <= tol, tails_rel=tail_worst,
               tails_same=tail_worst <= tol, first=first_row or "")
    return out


def case_prefill(d: Draw, tol: float) -> dict:
    heads = d.choice((32, 64))
    m, n = d.int(1, 64), d.int(1, 4096)
    q, kv, w = d.fp8(m, heads, HEAD_DIM), d.fp8(n, HEAD_DIM), torch.randn(m, heads, generator=d.g)
    sf = torch.exp2(torch.randint(-8, 1, (n,), generator=d.g).float())
    ke = torch.randint(0, n + 1, (m,), generator=d.g)
    ks = (ke - torch.randint(0, 700, (m,), generator=d.g)).clamp(min=0)
    empty = torch.rand(m, generator=d.g) < 0.15
    ks[empty] = ke[empty]  # ks == ke: rows without keys
    width = max(int((ke - ks).max()), 1)
    args = [t.to(DEVICE) for t in (q, kv, sf, w, ks.int(), ke.int())]
    real = real_module().fp8_fp4_mqa_logits((args[0], None), (args[1], args[2]), args[3], args[4], args[5], width)
    mine = standin.fp8_fp4_mqa_logits((args[0], None), (args[1], args[2]), args[3], args[4], args[5], width)
    worst, worst_abs, first = 0.0, 0.0, ""
    for i, length in enumerate((ke - ks).tolist()):
        r, a = rel(real.float()[i, :length], mine[i, :length])
        if r > worst:
            worst, worst_abs = r, a
        if r > tol and not first:
            first = f"row {i} (keys [{int(ks[i])}, {int(ke[i])})): {r:.2e} of its largest logit"
    return dict(what=f"{m} rows, {heads} heads, {n} keys, max_seqlen_k {width}", metadata_same=True, rows_rel=worst,
                rows_abs=worst_abs, rows_same=worst <= tol, tails_rel=0.0, tails_same=True, first=first)


FAMILIES = {
    "paged": lambda d, tol: case_paged(d, draw_paged, tol),
    "skip": lambda d, tol: case_paged(d, draw_skip, tol),
    "prefill": case_prefill,
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", type=int, default=20, help="cases per family")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=1e-2, help="largest difference, as a share of a row's largest logit")
    p.add_argument("--json", type=str)
    p.add_argument("--against", choices=("real", "standins"), default="real")
    p.add_argument("--standin-only", action="store_true", help="the same as --against standins")
    p.add_argument("--only", default="", help="only the families whose name contains this")
    args = p.parse_args()
    if AGAINST == "real":
        try:
            real = real_module()
        except Exception as e:  # no GPU extension on this host
            print(f"deep_gemm_check: cannot compare: vllm.third_party.deep_gemm does not import: {e}")
            return 2
        standin.set_num_sms(real.get_num_sms())
        device = torch.cuda.get_device_name()
    else:
        standin.set_num_sms(16)  # more segments than SMs with CPU-sized contexts
        device = "cpu (stand-ins on both sides)"
    print(f"deep_gemm_check: {device}, {standin.NUM_SMS} SMs, tolerance {args.tol:g} of a row's largest logit")
    print(f"{'family':8} {'cases':>5} {'meta≠':>5} {'rows≠':>5} {'max rel':>9} {'max abs':>9} {'tails≠':>6} "
          f"{'errors':>6} {'s':>6}  first difference")
    rows, failed = [], False
    for k, (family, case) in enumerate(FAMILIES.items()):
        if args.only not in family:
            continue
        t0 = time.time()
        meta_bad = rows_bad = tails_bad = errors = 0
        worst_rel = worst_abs = 0.0
        first = ""
        for i in range(args.cases):
            d = Draw(args.seed * 1_000_003 + k * 10_007 + i)
            SANITIZER.violations.clear()
            try:
                r = case(d, args.tol)
                if SANITIZER.violations:  # this script's case was out of bounds: the comparison means nothing
                    r["rows_same"], r["first"] = False, f"the stand-in saw {SANITIZER.violations[0].describe()}"
            except Exception as e:  # one side refusing or failing a case the other took is a difference too
                errors += 1
                first = first or f"case {i}: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
                continue
            meta_bad += not r["metadata_same"]
            rows_bad += not r["rows_same"]
            tails_bad += not r["tails_same"]
            worst_rel, worst_abs = max(worst_rel, r["rows_rel"]), max(worst_abs, r["rows_abs"])
            if not (r["metadata_same"] and r["rows_same"]) and not first:
                first = f"case {i} ({r['what']}): " + (r["first"] or "metadata differ")
        failed |= bool(meta_bad or rows_bad or errors)
        rows.append(dict(family=family, cases=args.cases, metadata_differ=meta_bad, rows_differ=rows_bad,
                         max_rel=worst_rel, max_abs=worst_abs, tails_differ=tails_bad, errors=errors, first=first,
                         seconds=round(time.time() - t0, 1)))
        print(f"{family:8} {args.cases:5d} {meta_bad:5d} {rows_bad:5d} {worst_rel:9.2e} {worst_abs:9.2e} "
              f"{tails_bad:6d} {errors:6d} {time.time() - t0:6.1f}  {first}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(seed=args.seed, tol=args.tol, against=AGAINST, device=device, num_sms=standin.NUM_SMS,
                           torch=torch.__version__, rows=rows), f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
