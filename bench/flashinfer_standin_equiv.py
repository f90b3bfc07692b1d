#!/usr/bin/env python3
"""The FlashInfer stand-in's kernel emulation (`fuzzer.support.standins.flashinfer_mla._mla_kernel`) against an
earlier revision's, on the same launches: bit for bit (out, LSE, the partial outputs in the float workspace) and the
same memory violations (their arguments and the first one; a chunk reports up to 4 of each, and chunks differ).

  cases   the launches `vllm.flashinfer_sparse_sm90` makes on N cases of its strategy (profile cpu, --seed)
  random  launches on wrappers planned as vLLM's _SM90State plans them, larger than a CPU case (up to 48 tokens,
          128 heads, top-k 2048, bf16 and fp8, clamped kv_end, bad pages)

  PYTHONPATH=. .venv/bin/python bench/flashinfer_standin_equiv.py --old REV cases 200
  PYTHONPATH=. .venv/bin/python bench/flashinfer_standin_equiv.py --old REV random 60 [--device cuda]
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fuzzer.support.interp.sanitizer import SANITIZER  # noqa: E402
from fuzzer.support.standins import flashinfer_mla as new  # noqa: E402

PATH = "fuzzer/support/standins/flashinfer_mla.py"


def load_old(rev: str) -> types.ModuleType:
    """The stand-in module of revision `rev` (or of the file `rev`, where no git history travels)."""
    if Path(rev).is_file():
        source = Path(rev).read_text()
    else:
        source = subprocess.run(["git", "show", f"{rev}:{PATH}"], cwd=ROOT, check=True, capture_output=True,
                                text=True).stdout
    module = types.ModuleType("flashinfer_mla_old")
    module.__dict__["__name__"] = "flashinfer_mla_old"
    sys.modules["flashinfer_mla_old"] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:{PATH}", "exec"), module.__dict__)
    return module


class Compare:
    def __init__(self, old):
        self.old, self.n, self.exact, self.worst, self.violation_mismatch = old, 0, 0, 0.0, []
        self.partials_exact, self.ulps, self.lse_worst, self.rows_off = 0, 0, 0.0, 0
        self.seconds = {"old": 0.0, "new": 0.0}
        self.kernel = new._mla_kernel

    def __call__(self, launch, q_nope, q_pe, ckv, kpe, out, lse, lse_base_e, ckv_scale_arr, fp8):
        o_out, o_lse = out.clone(), None if lse is None else lse.clone()
        o_launch = dataclasses.replace(launch, float_workspace=launch.float_workspace.clone())
        before = len(SANITIZER.violations)
        t = time.perf_counter()
        self.old._mla_kernel(o_launch, q_nope, q_pe, ckv, kpe, o_out, o_lse, lse_base_e, ckv_scale_arr, fp8)
        self.seconds["old"] += time.perf_counter() - t
        old_v = SANITIZER.violations[before:]
        del SANITIZER.violations[before:]
        t = time.perf_counter()
        self.kernel(launch, q_nope, q_pe, ckv, kpe, out, lse, lse_base_e, ckv_scale_arr, fp8)
        self.seconds["new"] += time.perf_counter() - t
        new_v = SANITIZER.violations[before:]
        pairs = [(out, o_out), (launch.float_workspace, o_launch.float_workspace)]
        pairs += [(lse, o_lse)] if lse is not None else []
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in pairs)
        self.n += 1
        self.exact += same
        self.partials_exact += torch.equal(launch.float_workspace, o_launch.float_workspace)
        if not same:
            a, b = out.float(), o_out.float()
            both = torch.isfinite(a) & torch.isfinite(b)
            self.worst = max(self.worst, float((a - b)[both].abs().max()) if both.any() else 0.0)
            if not torch.equal(torch.isnan(a), torch.isnan(b)):
                self.worst = float("inf")
            if out.dtype == torch.bfloat16:  # bf16 steps apart (same sign: the int16 patterns' distance)
                ia, ib = out.view(torch.int16).int(), o_out.view(torch.int16).int()
                self.ulps = max(self.ulps, int((ia - ib)[both].abs().max()) if both.any() else 0)
            self.rows_off += int((out.view(torch.int16) != o_out.view(torch.int16)).any(-1).sum())
            if lse is not None:
                fin = torch.isfinite(lse) & torch.isfinite(o_lse)
                self.lse_worst = max(self.lse_worst, float((lse - o_lse)[fin].abs().max()) if fin.any() else 0.0)
                if not torch.equal(torch.isfinite(lse), torch.isfinite(o_lse)):
                    self.lse_worst = float("inf")
        key = lambda vs: (sorted({(v.argument, v.op) for v in vs}), vs[0].describe() if vs else None)  # noqa: E731
        if key(old_v) != key(new_v):
            self.violation_mismatch.append((key(old_v), key(new_v)))

    def summary(self) -> str:
        return (f"{self.n} launches: {self.exact} bit-identical (out, lse, float workspace), partial outputs "
                f"bit-identical in {self.partials_exact}; elsewhere {self.rows_off} (token, head) rows of out differ, "
                f"by at most {self.ulps} bf16 step(s) (|diff| <= {self.worst:.3g}), LSE by <= {self.lse_worst:.3g}; "
                f"violation mismatches {len(self.violation_mismatch)}; kernel seconds old {self.seconds['old']:.2f}, "
                f"new {self.seconds['new']:.2f}")


def run_cases(compare: Compare, n: int, seed: int) -> None:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    from fuzzer.env import prepare_process
    from fuzzer.run.host import import_vllm

    prepare_process("cpu")
    import_vllm()
    from fuzzer.targets.flashinfer_sparse_sm90 import FlashInferMLASparseSM90
    from strategies.profiles import PROFILES

    target = FlashInferMLASparseSM90("cpu")
    target.prepare()
    cases = []

    @hseed(seed)
    @settings(max_examples=n, database=None, suppress_health_check=list(HealthCheck), phases=[Phase.generate],
              deadline=None)
    @given(target.cases(PROFILES["cpu"]).strategy(None))
    def collect(case):
        cases.append(case)

    collect()
    new._mla_kernel = compare
    errors = 0
    for case in cases[:n]:
        obs = target.run(case)
        errors += obs.error_type is not None
    print(f"{len(cases[:n])} cases ({errors} raised)")


def run_random(compare: Compare, n: int, device: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    new._mla_kernel = compare

    def r(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    for _ in range(n):
        tokens, heads = r(1, 48), [8, 16, 32, 64, 128][r(0, 4)]
        width = [128, 256, 512, 1024, 2048][r(0, 4)]
        fp8 = r(0, 1) == 1
        max_tokens = tokens + 8
        ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        bufs = dict(qo_indptr=torch.zeros(max_tokens + 1, dtype=torch.int32, device=device),
                    kv_indptr=torch.zeros(max_tokens + 1, dtype=torch.int32, device=device),
                    kv_indices=torch.zeros(max_tokens * width, dtype=torch.int32, device=device),
                    kv_len_arr=torch.zeros(max_tokens, dtype=torch.int32, device=device))
        w = new.BatchMLAPagedAttentionWrapper(ws, use_cuda_graph=True, backend="fa3", **bufs)
        lens = [r(0, width) for _ in range(tokens)]
        qo = torch.clamp(torch.arange(max_tokens + 1, dtype=torch.int32), max=tokens)
        kv_len = torch.zeros(max_tokens, dtype=torch.int32)
        kv_len[:tokens] = torch.tensor(lens, dtype=torch.int32)
        kv = torch.zeros(max_tokens + 1, dtype=torch.int32)
        kv[1:] = torch.cumsum(kv_len, 0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            w.plan(qo, kv, bufs["kv_indices"][: max(int(kv[-1]), 1)], kv_len, heads, 512, 64, 1, False, 0.1,
                   q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn if fp8 else torch.bfloat16)
        pages = 4096
        total = int(kv[-1])
        idx = torch.randint(0, pages, (total,), generator=g, dtype=torch.int32)
        if r(0, 4) == 0 and total:  # a page outside the cache
            idx[r(0, total - 1)] = pages + 5
        bufs["kv_indices"][:total] = idx.to(device)
        if r(0, 2) == 0:  # vLLM's clamp: kv_end shortened on the device
            info, iws = w._plan_info, w._planned_backend._int_workspace_buffer.view(torch.int32)
            works = int(iws[info[15] // 4 + info[1]])
            end = iws[info[14] // 4: info[14] // 4 + works]
            end.copy_(torch.maximum(end - r(0, 40), iws[info[13] // 4: info[13] // 4 + works]))
        q = torch.randn(tokens, heads, 576, generator=g).bfloat16().to(device)
        cache = (torch.randn(pages, 1, 576, generator=g) * 0.5).to(device)
        cache = cache.to(torch.float8_e4m3fn) if fp8 else cache.bfloat16()
        before = len(SANITIZER.violations)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            w.run(q[..., :512], q[..., 512:], cache[..., :512], cache[..., 512:], return_lse=r(0, 1) == 1,
                  **(dict(ckv_scale=[1.0, 0.37, 2.5][r(0, 2)], kpe_scale=1.0) if fp8 else {}))
        del SANITIZER.violations[before:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="the revision (or file) whose stand-in is the reference")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("mode", choices=("cases", "random"))
    ap.add_argument("n", type=int)
    args = ap.parse_args()
    compare = Compare(load_old(args.old))
    if args.mode == "cases":
        run_cases(compare, args.n, args.seed)
    else:
        run_random(compare, args.n, args.device, args.seed)
    print(compare.summary())
    for old_v, new_v in compare.violation_mismatch[:5]:
        print("  violations differ: old", old_v, "new", new_v)


if __name__ == "__main__":
    main()
