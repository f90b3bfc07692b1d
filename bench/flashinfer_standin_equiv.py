#!/usr/bin/env python3
"""The FlashInfer stand-in's kernel emulation (`fuzzer.support.standins.flashinfer_mla._mla_kernel`) against an
earlier revision's, on the same launches: bit for bit (out, the partial outputs and LSEs in the float workspace) and the
same memory violations (their arguments and the first one; a chunk reports up to 4 of each, and chunks differ).

  cases   the launches `vllm.flashinfer_sparse_sm90` makes on N cases of its strategy (profile cpu, --seed)
  misuse  the wrapper's refusals, argument checks and reported violations (below)
  random  launches on wrappers planned as vLLM's _SM90State plans them, larger than a CPU case (up to 48 tokens,
          128 heads, top-k 2048, bf16 and fp8, clamped kv_end, bad pages)

  PYTHONPATH=. .venv/bin/python bench/flashinfer_standin_equiv.py --old REV cases 200
  PYTHONPATH=. .venv/bin/python bench/flashinfer_standin_equiv.py --old REV random 60 [--device cuda]
  PYTHONPATH=. .venv/bin/python bench/flashinfer_standin_equiv.py --old REV misuse

Every plan() in `cases` and `random` is made by the old wrapper too (PlanShadow): the same exception and message, or
the same plan info, attributes and every int32 word the planner staged in the int workspace. `misuse` calls the
constructor, plan() and run() off vLLM's form or contract, one argument at a time, on both revisions: the same
exception and message, or the same plan state, output bytes and violations.
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
        self.partials_exact, self.ulps, self.rows_off = 0, 0, 0
        self.seconds = {"old": 0.0, "new": 0.0}
        self.kernel = new._mla_kernel

    def __call__(self, launch, q_nope, q_pe, ckv, kpe, out, fp8):
        o_out = out.clone()
        o_launch = dataclasses.replace(launch, float_workspace=launch.float_workspace.clone())
        before = len(SANITIZER.violations)
        t = time.perf_counter()
        self.old._mla_kernel(o_launch, q_nope, q_pe, ckv, kpe, o_out, fp8)
        self.seconds["old"] += time.perf_counter() - t
        old_v = SANITIZER.violations[before:]
        del SANITIZER.violations[before:]
        t = time.perf_counter()
        self.kernel(launch, q_nope, q_pe, ckv, kpe, out, fp8)
        self.seconds["new"] += time.perf_counter() - t
        new_v = SANITIZER.violations[before:]
        pairs = [(out, o_out), (launch.float_workspace, o_launch.float_workspace)]
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
        key = lambda vs: (sorted({(v.argument, v.op) for v in vs}), vs[0].describe() if vs else None)  # noqa: E731
        if key(old_v) != key(new_v):
            self.violation_mismatch.append((key(old_v), key(new_v)))

    def summary(self) -> str:
        return (f"{self.n} launches: {self.exact} bit-identical (out, float workspace), partial outputs "
                f"bit-identical in {self.partials_exact}; elsewhere {self.rows_off} (token, head) rows of out differ, "
                f"by at most {self.ulps} bf16 step(s) (|diff| <= {self.worst:.3g}); "
                f"violation mismatches {len(self.violation_mismatch)}; kernel seconds old {self.seconds['old']:.2f}, "
                f"new {self.seconds['new']:.2f}")


def _outcome(call):
    """(exception type, message) of a call, or None and its result."""
    try:
        return None, call()
    except Exception as e:  # noqa: BLE001 - compared, then raised again
        return (type(e).__name__, str(e)), e


def _plan_state(w) -> tuple:
    """What a plan leaves: the wrapper's and planned backend's plain attributes, and every int32 word the planner
    stages in the int workspace (its arrays end with work_indptr, one entry per cluster and one more)."""
    plain = lambda o: {k: v for k, v in vars(o).items() if not isinstance(v, torch.Tensor)  # noqa: E731
                       and k not in ("_planned_backend", "_warned_positional", "_old_shadow")}
    b = w._planned_backend
    if b is None:
        return plain(w), None, None
    words = b._int_workspace_buffer.view(torch.int32)[: b._plan_info[15] // 4 + b._plan_info[1] + 1]
    return plain(w), plain(b), words.cpu()


class PlanShadow:
    """Every plan() of a new wrapper made again, first, by an old one built from the same arguments (the same
    reserved buffers and float workspace, its own int workspace): the same exception and message, or the same plain
    attributes (plan info, work count, ...) and the same int32 words of the staged int workspace."""

    def __init__(self, old):
        self.n, self.same, self.mismatch = 0, 0, []
        cls, old_cls = new.BatchMLAPagedAttentionWrapper, old.BatchMLAPagedAttentionWrapper
        init, plan = cls.__init__, cls.plan
        shadow = self

        def __init__(w, *args, **kwargs):
            init(w, *args, **kwargs)
            w._old_shadow = old_cls(*args, **kwargs)

        def shadowed_plan(w, *args, **kwargs):
            o = w.__dict__.pop("_old_shadow")
            try:
                old_err, _ = _outcome(lambda: o.plan(*args, **kwargs))
                new_err, result = _outcome(lambda: plan(w, *args, **kwargs))
            finally:
                w._old_shadow = o
            shadow.n += 1
            if old_err != new_err:
                shadow.mismatch.append((old_err, new_err))
            elif new_err is None:
                (ow, ob, owords), (nw, nb, nwords) = _plan_state(o), _plan_state(w)
                same = ow == nw and ob == nb and torch.equal(owords, nwords)
                shadow.same += same
                if not same:
                    shadow.mismatch.append(("plan state", {k: (ow.get(k), nw.get(k)) for k in ow.keys() | nw.keys()
                                                           if ow.get(k) != nw.get(k)}))
            else:
                shadow.same += 1
            if new_err is not None:
                raise result
            return result

        cls.__init__, cls.plan = __init__, shadowed_plan

    def summary(self) -> str:
        return (f"{self.n} plans: {self.same} the same (exception and message, or plan info, attributes and every "
                f"staged int-workspace word); mismatches {len(self.mismatch)}")


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
            w.run(q[..., :512], q[..., 512:], cache[..., :512], cache[..., 512:],
                  **(dict(ckv_scale=[1.0, 0.37, 2.5][r(0, 2)], kpe_scale=1.0) if fp8 else {}))
        del SANITIZER.violations[before:]


def _misuse_scenarios() -> list[tuple[str, dict]]:
    """(name, changes) of calls off vLLM's form or its contract: the constructor's, plan()'s and run()'s arguments
    one at a time, the reserved buffers', the cache's pages and the plan's capacity."""
    out = [("vLLM's form", {}), ("fp8", dict(fp8=True)), ("auto backend", dict(ctor=dict(backend="auto"))),
           ("128 heads", dict(heads=128)), ("causal", dict(plan=dict(causal=True)))]
    out += [(f"ctor {k}", dict(ctor={k: v})) for k, v in (("backend", "fa2"), ("use_cuda_graph", False))]
    out += [(f"ctor reserved {k} None", dict(ctor={k: None})) for k in ("qo_indptr", "kv_indptr", "kv_indices",
                                                                        "kv_len_arr")]
    out += [(f"plan {k}", dict(plan={k: v})) for k, v in (
        ("metadata", object()), ("use_profiler", True), ("lse_mode", "base2"), ("foo", 1), ("page_size", 0),
        ("page_size", True), ("page_size", 1.5), ("page_size", 2), ("num_heads", 0), ("num_heads", -3),
        ("head_dim_ckv", 384), ("head_dim_ckv", 192), ("head_dim_ckv", 256), ("head_dim_kpe", -64),
        ("head_dim_kpe", 32), ("head_dim_kpe", 0), ("q_data_type", torch.float32), ("q_data_type", torch.float16),
        ("kv_data_type", torch.float32), ("kv_data_type", torch.float16), ("kv_indices", None))]
    out += [(f"plan {k} None", dict(plan={k: None})) for k in ("num_heads", "head_dim_ckv", "head_dim_kpe",
                                                               "page_size", "causal", "sm_scale", "q_data_type",
                                                               "kv_data_type", "qo_indptr")]
    out += [("fp8 fp16 q", dict(fp8=True, plan=dict(q_data_type=torch.float16))),
            ("fp8 ckv 256", dict(fp8=True, plan=dict(head_dim_ckv=256))),
            ("fp8 kpe 0", dict(fp8=True, plan=dict(head_dim_kpe=0)))]
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"):
        out += [(f"csr {name} {what}", dict(csr={name: what})) for what in (
            "list", "rank2", "int64", "strided", "empty", "shifted", "decreasing", "negative", "short", "long")]
    out += [(f"reserved {name} {what}", dict(reserved={name: what})) for name in (
        "qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr") for what in (
        "int64", "rank2", "strided", "short", "long", "overlap", "source")]
    out += [("empty rows", dict(lens=[])), ("no rows", dict(lens=[], max_tokens=0)),
            ("tiles past capacity", dict(lens=[0] * 16385, max_tokens=16400)),
            ("works past capacity", dict(lens=[0] * 16300 + [40000] * 3, max_tokens=16400))]
    out += [(f"run {k}", dict(run={k: v})) for k, v in (
        ("out", torch.empty(1)), ("lse", torch.empty(1)), ("return_lse", True), ("return_lse", False),
        ("ckv_scale_arr", torch.ones(1)), ("sinks", torch.zeros(1)), ("query", torch.zeros(1)),
        ("ckv_scale", 1.0), ("kpe_scale", 1.0), ("positional", (None, torch.empty(1))), ("positional", (False,)),
        ("q_pe", None), ("kpe_cache", None), ("q_nope", None), ("ckv_cache", None), ("q_rank", 2),
        ("q_heads", 3), ("q_dtype", torch.float16), ("kpe_dtype", torch.float16), ("q_width", 256),
        ("kpe_width", 32), ("cache_rank", 2), ("before_plan", True))]
    out += [(f"run fp8 {k}", dict(fp8=True, run={k: v})) for k, v in (
        ("ckv_scale", None), ("kpe_scale", None), ("ckv_scale", float("nan")), ("ckv_scale", -1.0),
        ("kpe_scale", 0.0), ("kpe_scale", float("inf")), ("ckv_scale", torch.tensor(2.0)), ("ckv_dtype", "bf16"))]
    out += [("bad pages", dict(pages="bad")), ("rows past q", dict(run=dict(q_tokens=1))),
            ("rows past q split", dict(lens=[2000, 1500, 3], run=dict(q_tokens=1)))]
    return out


def _misuse(mod, name: str, c: dict):
    """One scenario on module `mod`: (exception, message) of the first call that raises, else what it left: plan
    state, out bytes and the violations' arguments."""
    i32, fp8 = torch.int32, c.get("fp8", False)
    g = torch.Generator().manual_seed(7)
    lens = c.get("lens", [3, 200, 1, 50, 0, 120])
    max_tokens, heads = c.get("max_tokens", 8), c.get("heads", 16)
    ws = torch.empty(128 << 20, dtype=torch.uint8)
    kv_indices = torch.zeros(max(max_tokens * 256, sum(lens)) + 8, dtype=i32)
    bufs = dict(qo_indptr=torch.zeros(max_tokens + 1, dtype=i32), kv_indptr=torch.zeros(max_tokens + 1, dtype=i32),
                kv_indices=kv_indices, kv_len_arr=torch.zeros(max_tokens, dtype=i32))
    n = len(lens)
    qo = torch.clamp(torch.arange(max_tokens + 1, dtype=i32), max=n)
    kv_len = torch.zeros(max_tokens, dtype=i32)
    kv_len[:n] = torch.tensor(lens, dtype=i32)
    kv = torch.zeros(max_tokens + 1, dtype=i32)
    kv[1:] = torch.cumsum(kv_len, 0)
    csr = dict(qo_indptr=qo, kv_indptr=kv, kv_indices=bufs["kv_indices"][: max(int(kv[-1]), 1)], kv_len_arr=kv_len)
    for k, what in c.get("csr", {}).items():
        t = csr[k]
        csr[k] = {"list": lambda: t.tolist(), "rank2": lambda: t[None], "int64": lambda: t.long(),
                  "strided": lambda: torch.stack([t, t], 1)[:, 0], "empty": lambda: t[:0],
                  "shifted": lambda: t + 1, "decreasing": lambda: t.flip(0), "negative": lambda: t - 2,
                  "short": lambda: t[:-1], "long": lambda: torch.cat([t, t[-1:] + 1])}[what]()
    for k, what in c.get("reserved", {}).items():
        t = bufs[k]
        bufs[k] = {"int64": lambda: t.long(), "rank2": lambda: t[None], "strided": lambda: torch.stack([t, t], 1)[:, 0],
                   "short": lambda: t[:-1], "long": lambda: torch.cat([t, t[:1]]),
                   "overlap": lambda: bufs["kv_indices"][: t.numel()] if k != "kv_indices" else bufs["qo_indptr"],
                   "source": lambda: t}[what]()
        if what == "source":  # this buffer's plan argument lies in the reserved kv_indices (or qo_indptr)
            other = bufs["kv_indices"] if k != "kv_indices" else bufs["qo_indptr"]
            view = other[: csr[k].numel()] if k != "kv_indices" else other[:0]
            view.copy_(csr[k][: view.numel()])
            csr[k] = view if k != "kv_indices" else csr[k]
            if k == "kv_indices":
                csr["kv_len_arr"] = other[1: 1 + csr["kv_len_arr"].numel()].copy_(csr["kv_len_arr"])
    ctor = {**bufs, "use_cuda_graph": True, "backend": "fa3", **c.get("ctor", {})}
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    p = {**csr, "num_heads": heads, "head_dim_ckv": 512, "head_dim_kpe": 64, "page_size": 1, "causal": False,
         "sm_scale": 0.1, "q_data_type": torch.bfloat16, "kv_data_type": dtype, **c.get("plan", {})}
    positional = [p.pop(k) for k in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr", "num_heads",
                                     "head_dim_ckv", "head_dim_kpe", "page_size", "causal", "sm_scale")]
    r = dict(c.get("run", {}))
    pages = 300
    total = int(kv[-1])
    kv_indices[:total] = torch.randint(0, pages, (total,), generator=g, dtype=i32)
    if c.get("pages") == "bad":
        kv_indices[1] = pages + 3
    q = torch.randn(r.pop("q_tokens", max(n, 1)), heads, 576, generator=g).bfloat16()
    cache = (torch.randn(pages, 1, 576, generator=g) * 0.5).to(dtype)
    qn, qp, ckv, kpe = q[..., :512], q[..., 512:], cache[..., :512], cache[..., 512:]
    for k, f in (("q_rank", lambda: (qn[0], qp[0], ckv, kpe)), ("q_heads", lambda: (qn, qp[:, :3], ckv, kpe)),
                 ("q_dtype", lambda: (qn.half(), qp, ckv, kpe)), ("kpe_dtype", lambda: (qn, qp, ckv, kpe.half())),
                 ("q_width", lambda: (qn[..., :256], qp, ckv, kpe)),
                 ("kpe_width", lambda: (qn, qp, ckv, kpe[..., :32])),
                 ("cache_rank", lambda: (qn, qp, ckv[:, 0], kpe[:, 0])),
                 ("ckv_dtype", lambda: (qn, qp, ckv.bfloat16(), kpe))):
        if k in r:
            r.pop(k)
            qn, qp, ckv, kpe = f()
    args = {"q_nope": qn, "q_pe": qp, "ckv_cache": ckv, "kpe_cache": kpe}
    for k in list(args):
        if k in r:
            args[k] = r.pop(k)
    extra = r.pop("positional", ())
    before_plan = r.pop("before_plan", False)
    run_kw = {**(dict(ckv_scale=1.5, kpe_scale=0.5) if fp8 else {}), **r}
    run_kw = {k: v for k, v in run_kw.items() if not (k in ("ckv_scale", "kpe_scale") and v is None)}
    before = len(SANITIZER.violations)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        err, w = _outcome(lambda: mod.BatchMLAPagedAttentionWrapper(ws, **ctor))
        if err:
            return err
        if not before_plan:
            err, _ = _outcome(lambda: w.plan(*positional, **p))
            if err:
                return err
        err, o = _outcome(lambda: w.run(*args.values(), *extra, **run_kw))
    found = SANITIZER.violations[before:]
    del SANITIZER.violations[before:]
    if err:
        return err
    state = _plan_state(w)
    return state[0], state[1], state[2].tolist(), o.view(torch.uint8).flatten().tolist(), \
        [(v.argument, v.op, v.describe()) for v in found]


def run_misuse(old) -> None:
    same, differ = 0, []
    for name, c in _misuse_scenarios():
        a, b = _misuse(old, name, c), _misuse(new, name, c)
        if a == b:
            same += 1
        else:
            differ.append((name, a if isinstance(a, tuple) and len(a) == 2 else "ran",
                           b if isinstance(b, tuple) and len(b) == 2 else "ran"))
        outcome = b if isinstance(b, tuple) and len(b) == 2 else ("ran", "")
        print(f"  {name}: {outcome[0]} {str(outcome[1])[:90]}")
    print(f"{same + len(differ)} misuse scenarios: {same} the same (exception and message, or plan state, out bytes "
          f"and violations); {len(differ)} differ")
    for d in differ[:10]:
        print("  differs:", d)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="the revision (or file) whose stand-in is the reference")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("mode", choices=("cases", "random", "misuse"))
    ap.add_argument("n", type=int, nargs="?", default=0)
    args = ap.parse_args()
    old = load_old(args.old)
    if args.mode == "misuse":
        return run_misuse(old)
    compare, plans = Compare(old), PlanShadow(old)
    if args.mode == "cases":
        run_cases(compare, args.n, args.seed)
    else:
        run_random(compare, args.n, args.device, args.seed)
    print(compare.summary())
    print(plans.summary())
    for m in plans.mismatch[:5]:
        print("  plans differ:", m)
    for old_v, new_v in compare.violation_mismatch[:5]:
        print("  violations differ: old", old_v, "new", new_v)


if __name__ == "__main__":
    main()
