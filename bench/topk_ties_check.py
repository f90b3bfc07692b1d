"""The indexer's top-k kernels on rows whose k-th best score is tied: does the same input give the same set again?
In sampler.cu (and the persistent / cooperative kernels) the scores equal to the k-th claim their output slots by
shared-memory atomics, so which of them are taken is arrival order. Per op, rows of scores drawn from a few values
(ties at the k-th best), each row run --repeats times on copies of the same tensors:
  changed   rows whose selected set was not the same in every run
  invalid   runs whose selection is not a top-k (its scores, sorted, are not the k best)
The stand-ins (fuzzer/support/standins/indexer_ops.py `_select`) draw the tie order afresh for every call, so their
rows change by design (3 runs each: a check of their selections); this measures whether the real kernels' do,
which is what that choice rests on. Exit 0 every
selection was a top-k, 1 one was not, 2 the real ops are not on this host.

  python bench/topk_ties_check.py [--rows 64] [--repeats 20] [--seed 0] [--json FILE] [--standin-only]
"""

from __future__ import annotations

import argparse
import json
import sys

from fuzzer.env import prepare_check_process

STANDIN_ONLY = "--standin-only" in sys.argv
DEVICE = prepare_check_process("topk_ties_check", "--standin-only")
import torch  # noqa: E402

from fuzzer.support.standins import indexer_ops  # noqa: E402

RADIX_TOPK_WORKSPACE_SIZE = 1024 * 1024


def op(name: str, standin: bool):
    return getattr(indexer_ops, name) if standin else getattr(torch.ops._C, name)


def tied_scores(g: torch.Generator, rows: int, width: int, k: int, pattern: str) -> torch.Tensor:
    """`levels`: every score one of 4 values; `zeros`: fewer than k positive scores, the rest exactly 0 (the sum of
    relu terms the indexer's logits are when no head's dot product is positive)."""
    if pattern == "levels":
        return torch.randint(0, 4, (rows, width), generator=g).float().to(DEVICE)
    s = torch.zeros(rows, width)
    for r in range(rows):
        pos = torch.randperm(width, generator=g)[:int(torch.randint(1, k, (1,), generator=g))]
        s[r, pos] = torch.rand(len(pos), generator=g) + 0.5
    return s.to(DEVICE)


def run_once(name: str, standin: bool, logits: torch.Tensor, k: int) -> torch.Tensor:
    rows, width = logits.shape
    out = torch.full((rows, k), -7, dtype=torch.int32, device=DEVICE)
    lengths = torch.full((rows,), width, dtype=torch.int32, device=DEVICE)
    f = op(name, standin)
    if name == "top_k_per_row_prefill":
        f(logits, torch.zeros_like(lengths), lengths, out, rows, logits.stride(0), logits.stride(1), k)
    elif name == "top_k_per_row_decode":
        f(logits, 1, lengths, out, rows, logits.stride(0), logits.stride(1), k)
    else:  # persistent_topk / cooperative_topk
        workspace = torch.zeros(RADIX_TOPK_WORKSPACE_SIZE, dtype=torch.uint8, device=DEVICE)
        f(logits, lengths, out, workspace, k, width)
    return out.long().sort(dim=1).values


def check(name: str, standin: bool, logits: torch.Tensor, k: int, repeats: int) -> dict:
    best = logits.topk(k, dim=1).values.sort(dim=1).values
    runs = [run_once(name, standin, logits.clone(), k) for _ in range(repeats)]
    changed = torch.zeros(logits.shape[0], dtype=torch.bool, device=DEVICE)
    invalid = 0
    for ids in runs:
        changed |= (ids != runs[0]).any(dim=1)
        picked = logits.gather(1, ids.clamp_min(0)).sort(dim=1).values
        invalid += int(((ids < 0).any(dim=1) | (picked != best).any(dim=1)).sum())
    kth = logits.topk(k, dim=1).values[:, -1:]
    tied = int(((logits == kth).sum(dim=1) > k - (logits > kth).sum(dim=1)).sum())  # more equal to the k-th than fit
    return dict(changed=int(changed.sum()), invalid=invalid, tied_rows=tied)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    p.add_argument("--standin-only", action="store_true")
    args = p.parse_args()
    sides = [True]
    if not STANDIN_ONLY:
        import vllm._custom_ops  # noqa: F401
        import vllm.platforms.cuda  # noqa: F401  (loads _C_stable_libtorch where it is installed)

        try:
            op("top_k_per_row_prefill", False)
        except (AttributeError, RuntimeError):
            print("topk_ties_check: cannot check: vLLM's compiled top-k ops are not on this host")
            return 2
        sides = [False, True]
    results = []
    print(f"{'op':24s} {'side':8s} {'pattern':7s} {'width':>6s} {'k':>5s} {'rows':>5s} {'tied':>5s} "
          f"{'changed':>8s} {'invalid':>8s}")
    for name in ("top_k_per_row_prefill", "top_k_per_row_decode", "persistent_topk", "cooperative_topk"):
        for pattern in ("levels", "zeros"):
            for width, k in ((4736, 512), (20000, 2048)):  # widths a multiple of 4 (cooperative_topk: TMA)
                g = torch.Generator().manual_seed(args.seed)
                logits = tied_scores(g, args.rows, width, k, pattern)
                for standin in sides:
                    r = dict(op=name, side="stand-in" if standin else "real", pattern=pattern, width=width, k=k,
                             rows=args.rows, **check(name, standin, logits, k, min(args.repeats, 3) if standin else args.repeats))
                    results.append(r)
                    print(f"{name:24s} {r['side']:8s} {pattern:7s} {width:6d} {k:5d} {args.rows:5d} "
                          f"{r['tied_rows']:5d} {r['changed']:8d} {r['invalid']:8d}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(seed=args.seed, repeats=args.repeats, torch=torch.__version__, results=results,
                           device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"), f, indent=1)
    return 1 if any(r["invalid"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
