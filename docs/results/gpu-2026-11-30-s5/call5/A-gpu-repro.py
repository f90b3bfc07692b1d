#!/usr/bin/env python3
"""attnfuzz reproducer layer-88771df0: RuntimeError: sparse_attn_prefill_interface, /workspace/.deps/flashmla-src/csrc/api/sparse_prefill.cpp:188, topk_length must have shape (s_q)

Found by attnfuzz target `vllm.flashmla_sparse.layer` on vLLM 0.33.0, cuda (NVIDIA H200), with the injected bug `remap-full-batch-req-id` (inlined below).
Shrunk case: [P(q=1,ctx=0,valid=128) P(q=2,ctx=0,valid=128)] topk=128 block=64; 16 heads, kv_cache_dtype bfloat16, values normal.
Inputs in tensors.safetensors beside this file; the expected output is attnfuzz's fp32 oracle (after W_UV).
Run:  python repro.py     (torch + vLLM only; exits 1 while the bug is present, 0 once fixed)
"""

import dataclasses
import os
import sys
import tempfile
from types import SimpleNamespace

import torch
from safetensors.torch import load_file

DEVICE = "cuda"
BLOCK_SIZE = 64
BLOCK_STRIDE_ROWS = 64
NUM_BLOCKS = 3
NUM_REQS = 2
NUM_TOKENS = 3
MAX_QUERY_LEN = 2
MAX_SEQ_LEN = 2
ATOL = 0.028497884100691588
RTOL = 0.01
case = SimpleNamespace(topk_width=128, heads=16, kv_cache_dtype='bfloat16', block_size=64,
                       dcp=SimpleNamespace(size=1, interleave=1))
# What attnfuzz saw:
#   error: RuntimeError: sparse_attn_prefill_interface, /workspace/.deps/flashmla-src/csrc/api/sparse_prefill.cpp:188, topk_length must have shape (s_q)


def main():
    _load_vendored()
    runtime = sys.modules["fuzzer.targets.flashmla_runtime"]

    emulated = tuple(dict.fromkeys(runtime.install_standins(DEVICE) + runtime.install_layer_standins(DEVICE)))
    apply()  # the injected bug
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend as Backend
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    T = load_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tensors.safetensors"), device=DEVICE)
    cfg = runtime.configure(runtime.vllm_runtime(DEVICE, tempfile.mkdtemp()), case,
                            max_num_batched_tokens=T["topk_indices_buffer"].shape[0])
    # The paged cache as the layer left it before attention (other rows poisoned), blocks BLOCK_STRIDE_ROWS apart.
    width = T["kv_cache_rows"].shape[-1]
    cache = T["kv_cache_rows"].as_strided((NUM_BLOCKS, BLOCK_SIZE, width), (BLOCK_STRIDE_ROWS * width, width, 1))
    before = cache.clone()
    spec = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                            cache_dtype_str=case.kv_cache_dtype)
    fields = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    cam = CommonAttentionMetadata(**{k: v for k, v in dict(
        query_start_loc=T["query_start_loc"], query_start_loc_cpu=T["query_start_loc"].cpu(),
        seq_lens=T["seq_lens"], seq_lens_cpu=T["seq_lens"].cpu(), seq_lens_cpu_upper_bound=T["seq_lens"].cpu(),
        num_computed_tokens_cpu=T["num_computed_tokens"].cpu(), num_reqs=NUM_REQS, num_actual_tokens=NUM_TOKENS,
        max_query_len=MAX_QUERY_LEN, max_seq_len=MAX_SEQ_LEN, block_table_tensor=T["block_table"],
        slot_mapping=T["slot_mapping"]).items() if k in fields})
    problems, error, route, overruns = [], None, {}, []
    with _NoBoundsCheck() as oob:
        try:
            with set_current_vllm_config(cfg), torch.inference_mode():
                layer = runtime.mla_layer(cfg, case.heads, T["kv_b_weight"], T["topk_indices_buffer"], DEVICE)
                metadata = Backend.get_builder_cls()(spec, [runtime.LAYER], cfg, torch.device(DEVICE)).build(0, cam)
                runtime.record_routes(layer.impl, route)
                check_overrun = runtime.guard_index_group(layer.impl)
                out = torch.full((NUM_TOKENS, case.heads * 128), float("nan"), dtype=torch.bfloat16, device=DEVICE)
                # Decode tokens go to forward_mqa, short prefills to dense MHA: vLLM's own split.
                layer.forward_impl(T["q"], T["kv_c_normed"], T["k_pe"], cache, metadata, out)
                overruns = check_overrun(route.get("mqa_tokens", 0))
        except Exception as e:
            error = e
    problems += [v.describe() for v in oob] + overruns
    if error is not None:
        problems.append(f"raised {type(error).__name__}: {error}")
    else:
        expected = T["expected_out"].float().cpu()
        if out.numel() != expected.numel():
            problems.append(f"output has shape {tuple(out.shape)}; expected {tuple(expected.shape)} (the heads of this rank)")
            out = expected  # nothing more to compare
        out = out.float().cpu().view(expected.shape)
        bad = ~torch.isfinite(out)
        if bad.any():
            t, h, _ = bad.nonzero()[0].tolist()
            problems.append(f"{int(bad.sum())} non-finite outputs, first token {t} head {h}; the fp32 reference is finite")
        err = ((out - expected).abs() / (ATOL + RTOL * expected.abs())).nan_to_num(0)
        if err.max() > 1:
            t, h, d = (err == err.max()).nonzero()[0].tolist()
            problems.append(f"output off by {err.max():.2f}x the tolerance at token {t} head {h} dim {d}: "
                            f"{out[t, h, d]:.4g} vs fp32 reference {expected[t, h, d]:.4g}")
        if not torch.equal(cache.view(torch.uint8), before.view(torch.uint8)):
            problems.append("the KV cache changed during attention")
    print("routes:", route, "| stand-ins for ops this host lacks:", ", ".join(emulated) or "none")
    for p in problems:
        print("BUG:", p)
    print("vLLM", __import__("vllm").__version__, "-", "bug present" if problems else "no bug: fixed")
    return 1 if problems else 0


# ---- the injected bug (remap-full-batch-req-id) ----
"""Rebuild one of vLLM's Triton kernels from its source with edits (shared by the kernel-level mutants)."""

import ast
import importlib
import inspect
import linecache
import textwrap


def mutate_jit(jit, namespace, edits, label):
    """A new Triton kernel: `jit`'s source with `edits` ((old, new) pairs) applied, defined in `namespace`."""
    import triton

    fn = getattr(jit, "fn", jit)
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    tree.body[0].decorator_list = []
    src = ast.unparse(tree)
    for old, new in edits:
        if old not in src:
            raise RuntimeError(f"mutant {label}: `{old}` not found in this vLLM's {fn.__name__}")
        src = src.replace(old, new)
    filename = f"<attnfuzz mutant {label}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)  # Triton reads the source
    scope = dict(namespace)
    exec(compile(src, filename, "exec"), scope)
    return triton.jit(scope[fn.__name__])


def patch_kernel(module_name, kernel_name, edits, label):
    """Replace the module-level kernel `kernel_name`, which its callers look up at call time."""
    module = importlib.import_module(module_name)
    setattr(module, kernel_name, mutate_jit(getattr(module, kernel_name), vars(module), edits, label))


def patch_remap_kernel(edits, label):
    """Replace the sparse-MLA index-remap kernel, wherever the installed release keeps it."""
    from vllm.v1.attention.backends.mla import sparse_utils as su

    holder = getattr(su, "ConvertReqIndexToGlobalIndexKernel", None)  # 0.27+: a warmup-aware wrapper class
    if holder is None:
        patch_kernel(su.__name__, "_convert_req_index_to_global_index_kernel", edits, label)
    else:
        holder.kernel = mutate_jit(holder.kernel, vars(su), edits, label)


def patch_method(module_name, class_name, method_name, edits, label):
    """Replace a method of one of vLLM's classes by its source with `edits` applied."""
    module = importlib.import_module(module_name)
    cls = getattr(module, class_name)
    fn = getattr(cls, method_name)
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    src = ast.unparse(tree)
    for old, new in edits:
        if old not in src:
            raise RuntimeError(f"mutant {label}: `{old}` not found in this vLLM's {class_name}.{method_name}")
        src = src.replace(old, new)
    scope = dict(vars(module))
    exec(compile(src, f"<attnfuzz mutant {label}>", "exec"), scope)
    setattr(cls, method_name, scope[method_name])


"""Seed bug 1 at its call sites (class A; vLLM issue 48611, bug 1, from PR 47327): once short prefills leave
for dense MHA, forward_mqa gets only the decode tokens, but FlashMLA's paths (bf16, fp8 mixed batch, fp8
separate) and the index group convert them with the whole batch's req_id_per_token, and the converter has
neither of 0.33's row checks to refuse the call. The remap kernel's grid follows req_id_per_token: it reads
top-k rows past the decode tokens and writes past its output."""

import ast
import inspect
import textwrap


BUG_CLASS = "A"
TARGETS = ("vllm.flashmla_sparse.layer",)


def apply():
    from vllm.model_executor.layers.attention import sparse_mla_attention
    from vllm.v1.attention.backends.mla import flashmla_sparse, index_group, sparse_utils

    fn = sparse_utils.triton_convert_req_index_to_global_index
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))

    row_checks = {"req_id.shape[0]==token_indices.shape[0]", "valid_counts_out.shape==(num_tokens,)"}

    class DropRowCheck(ast.NodeTransformer):
        def visit_Assert(self, node):
            return None if ast.unparse(node.test).replace(" ", "") in row_checks else node

    exec(compile(ast.fix_missing_locations(DropRowCheck().visit(tree)), inspect.getsourcefile(fn), "exec"),
         vars(sparse_utils))
    for module in (index_group, sparse_mla_attention, flashmla_sparse):  # they bound the converter by name at import
        module.triton_convert_req_index_to_global_index = sparse_utils.triton_convert_req_index_to_global_index
    patch_method(index_group.__name__, "SparseMLAIndexGroup", "convert_logical_to_physical_topk",
                 [("attn_metadata.req_id_per_token[:logical_topk_indices.shape[0]]", "attn_metadata.req_id_per_token")],
                 "remap-full-batch-req-id")
    # vLLM's fix sliced req_id_per_token to the MQA tokens in each FlashMLA path: take the slices out again.
    for method in ("_forward_bf16_kv", "_forward_fp8_kv_mixed_batch", "_forward_fp8_kv_separate_prefill_decode"):
        patch_method("vllm.v1.attention.backends.mla.flashmla_sparse", "FlashMLASparseImpl", method,
                     [("attn_metadata.req_id_per_token[:topk_indices.shape[0]]", "attn_metadata.req_id_per_token")],
                     "remap-full-batch-req-id")


class _NoBoundsCheck:  # native GPU: memory errors are compute-sanitizer's to see
    def __enter__(self):
        return []

    def __exit__(self, *exc):
        return False


def _load_vendored():
    """attnfuzz's support modules, inlined below as source text, importable under their own names."""
    import types

    for name, source in VENDORED.items():
        parts = name.split(".")
        for i in range(1, len(parts)):  # the parent packages
            sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i]))).__path__ = []
        module = types.ModuleType(name)
        module.__file__ = f"<attnfuzz {name}>"
        sys.modules[name] = module
        exec(compile(source, module.__file__, "exec"), vars(module))


# ---- support: attnfuzz's set-up code and stand-ins, verbatim ----
VENDORED = {
    "fuzzer.interp.sanitizer": r'''"""Bounds checking for Triton's interpreter (CPU), plus the interpreter corrections kernels need.

The interpreter has no out-of-bounds detection: loads and stores are raw memcpy on host addresses and CPU
tensors are used in place (measured.md, Trap 3). We wrap its memory entry points and check every active
lane's address against the byte ranges of the launched kernel's tensor arguments. An out-of-bounds lane is
recorded and masked off (a load yields `other`, a store is dropped), so the process survives to report it,
much as compute-sanitizer lets a kernel run on after reporting.

Correction applied here: a scalar `mask=` on a scalar pointer reaches the interpreter's native load as a
0-d numpy bool and fails with "mask has unsupported dtype" (Trap 4); masks are broadcast to the pointer
shape as a bool array, which is what the compiled kernel does.
"""

from __future__ import annotations

import inspect
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

MAX_VIOLATIONS = 64  # per case: the first accesses name the bug; thousands more add nothing


@dataclass(frozen=True)
class MemoryViolation:
    kernel: str
    op: str  # load | store | atomic_rmw | atomic_cas
    argument: str  # the tensor argument nearest to the first bad address
    byte_offset: int  # of the first bad address, from that argument's first byte (negative: before it)
    argument_bytes: int  # the argument's extent in bytes
    element_bytes: int
    program_id: tuple[int, int, int]
    lanes: int  # out-of-bounds lanes in this access
    inside_allocation: bool  # True: past the argument's view but inside its storage

    def describe(self) -> str:
        where = "inside its allocation" if self.inside_allocation else "outside every argument's allocation"
        rel = (
            f"{self.byte_offset - self.argument_bytes} bytes after the end of"
            if self.byte_offset >= self.argument_bytes
            else f"{-self.byte_offset} bytes before"
        )
        return (
            f"out-of-bounds {self.op} of {self.element_bytes} bytes in {self.kernel} (program {self.program_id}): "
            f"{self.lanes} lane(s), first {rel} `{self.argument}` ({self.argument_bytes} bytes; {where})"
        )


@dataclass(frozen=True)
class _Arg:
    name: str
    start: int
    end: int  # view extent [start, end)
    alloc_start: int
    alloc_end: int


def _tensor_args(fn, args, kwargs) -> list[_Arg]:
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args))
    bound.update({k: v for k, v in kwargs.items() if k in params})
    out = []
    for name, t in bound.items():
        if not hasattr(t, "data_ptr") or not hasattr(t, "untyped_storage"):
            continue
        es = t.element_size()
        lo = hi = 0
        for size, stride in zip(t.shape, t.stride()):
            if size == 0:
                lo = hi = 0
                break
            span = (size - 1) * stride
            lo, hi = (lo + span, hi) if span < 0 else (lo, hi + span)
        start = t.data_ptr() + lo * es
        end = t.data_ptr() + (hi + 1) * es if t.numel() else start
        st = t.untyped_storage()
        out.append(_Arg(name, start, end, st.data_ptr(), st.data_ptr() + st.nbytes()))
    return out


class InterpreterSanitizer:
    """Install once per process; `collect()` gathers the violations of the calls made inside it."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._installed = False
        self.violations: list[MemoryViolation] = []

    # -- public ---------------------------------------------------------------------------------------
    def install(self) -> "InterpreterSanitizer":
        if self._installed:
            return self
        from triton.runtime import interpreter as interp

        san = self
        grid_call = interp.GridExecutor.__call__

        def call(executor, *args, **kwargs):
            stack = san._stack()
            stack.append((executor.fn.__name__, _tensor_args(executor.fn, args, kwargs)))
            try:
                return grid_call(executor, *args, **kwargs)
            finally:
                stack.pop()

        interp.GridExecutor.__call__ = call
        B = interp.InterpreterBuilder
        masked_load, masked_store = B.create_masked_load, B.create_masked_store
        atomic_rmw, atomic_cas = B.create_atomic_rmw, B.create_atomic_cas

        def create_masked_load(b, ptrs, mask, other, cache_policy, is_volatile):
            return masked_load(b, ptrs, san._check(b, "load", ptrs, mask), other, cache_policy, is_volatile)

        def create_masked_store(b, ptrs, value, mask, cache_policy):
            return masked_store(b, ptrs, value, san._check(b, "store", ptrs, mask), cache_policy)

        def create_atomic_rmw(b, rmw_op, ptr, val, mask, sem, scope):
            return atomic_rmw(b, rmw_op, ptr, val, san._check(b, "atomic_rmw", ptr, mask), sem, scope)

        def create_atomic_cas(b, ptr, cmp, val, sem, scope):
            full = interp.TensorHandle(np.ones(np.shape(ptr.data), dtype=bool), interp.tl.int1)
            if not san._check(b, "atomic_cas", ptr, full).data.all():
                return interp.TensorHandle(np.array(cmp.data, copy=True), cmp.dtype.scalar)  # dropped
            return atomic_cas(b, ptr, cmp, val, sem, scope)

        B.create_masked_load, B.create_masked_store = create_masked_load, create_masked_store
        B.create_atomic_rmw, B.create_atomic_cas = create_atomic_rmw, create_atomic_cas
        self._installed = True
        return self

    @contextmanager
    def collect(self):
        start = len(self.violations)
        found: list[MemoryViolation] = []
        try:
            yield found
        finally:
            found.extend(self.violations[start:])
            del self.violations[start:]

    # -- internals ------------------------------------------------------------------------------------
    def _stack(self) -> list:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def _check(self, builder, op, ptrs, mask):
        from triton.runtime import interpreter as interp

        addr = np.asarray(ptrs.data)
        m = np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape).copy()  # Trap 4 correction
        stack = self._stack()
        if stack and m.any():
            kernel, args = stack[-1]
            es = interp._get_np_dtype(ptrs.get_element_ty()).itemsize
            a = addr.astype(np.uint64)
            ok = np.zeros(addr.shape, dtype=bool)
            for arg in args:
                ok |= (a >= arg.start) & (a + es <= arg.end)
            bad = m & ~ok
            if bad.any():
                self._record(builder, kernel, args, op, a[bad], es, int(bad.sum()))
                m &= ok
        return interp.TensorHandle(m, interp.tl.int1)

    def _record(self, builder, kernel, args, op, bad_addrs, es, lanes):
        if len(self.violations) >= MAX_VIOLATIONS or not args:
            return
        first = int(bad_addrs[0])

        def distance(arg):
            return 0 if arg.start <= first < arg.end else min(abs(first - arg.start), abs(first - arg.end))

        near = min(args, key=distance)
        inside = any(x.alloc_start <= first and first + es <= x.alloc_end for x in args)
        pid = tuple(int(v) for v in (builder.grid_idx or (0, 0, 0)))
        self.violations.append(
            MemoryViolation(kernel, op, near.name, first - near.start, near.end - near.start, es, pid, lanes, inside)
        )


SANITIZER = InterpreterSanitizer()
''',
    "fuzzer.standins.cache_ops": r'''"""Stand-ins for vLLM's compiled KV-cache ops (`torch.ops._C_cache_ops.*`, in `_C_stable_libtorch`)."""

from __future__ import annotations

import torch

from fuzzer.interp.sanitizer import SANITIZER, MemoryViolation


def _violation(op: str, argument: str, index: int, limit: int, elem_bytes: int, access: str = "store") -> None:
    SANITIZER.violations.append(MemoryViolation(
        kernel=f"{op} (attnfuzz stand-in)", op=access, argument=argument, byte_offset=index * elem_bytes,
        argument_bytes=limit * elem_bytes, element_bytes=elem_bytes, program_id=(0, 0, 0), lanes=1,
        inside_allocation=False))


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, kv_cache_dtype: str, scale: torch.Tensor) -> None:
    """`ops.concat_and_cache_mla`: token i's (kv_c | k_pe) goes to cache[slot // block_size, slot % block_size].

    A negative slot is a padding token and is skipped, as in the CUDA kernel. Unquantized caches only
    ("auto"/"bfloat16"/"float16"): the quantized layouts come with the FlashMLA target.
    """
    if kv_cache_dtype not in ("auto", "bfloat16", "float16"):
        raise ValueError(f"attnfuzz's concat_and_cache_mla stand-in does not write kv_cache_dtype={kv_cache_dtype!r}")
    num_blocks, block_size = kv_cache.shape[:2]
    entry = torch.cat([kv_c, k_pe], dim=-1).to(kv_cache.dtype)
    slots = slot_mapping.long()
    capacity = num_blocks * block_size
    for slot in slots[slots >= capacity].tolist()[:8]:  # each one an out-of-bounds write in the real op
        _violation("concat_and_cache_mla", "kv_cache", slot, capacity, kv_cache.shape[-1] * kv_cache.element_size())
    keep = (slots >= 0) & (slots < capacity)
    kv_cache[slots[keep] // block_size, slots[keep] % block_size] = entry[keep]


# vLLM's csrc get_fp8_kv_cache_data_type: these names dispatch the gather's flat e4m3 dequantization. Note
# "fp8_ds_mla" is among them: the op reads a 656-byte entry's first 576 bytes as e4m3 with one global scale
# (the misuse behind vLLM issue 48611, bug 2); only cp_gather_and_upconvert_fp8_kv_cache reads that layout.
_FLAT_FP8 = ("fp8", "fp8_e4m3", "fp8_ds_mla")
_UNQUANTIZED = ("auto", "bfloat16", "float16")


def gather_and_maybe_dequant_cache(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
                                   cu_seq_lens: torch.Tensor, token_to_seq: torch.Tensor, num_tokens: int,
                                   kv_cache_dtype: str, scale: torch.Tensor,
                                   seq_starts: torch.Tensor | None = None) -> None:
    """`ops.gather_and_maybe_dequant_cache` (csrc/cache_kernels.cu): output token t of request b = token_to_seq[t]
    is position t - cu_seq_lens[b] (+ seq_starts[b]) of that request, read through block_table[b] as dst.size(-1)
    elements of the cache's element type from the entry's start; quantized dtypes convert each byte as e4m3
    times `*scale`. A token past its request's end stops the CUDA block (nothing written), as in the kernel."""
    op = "gather_and_maybe_dequant_cache"
    head_dim = dst.shape[-1]
    if head_dim not in (320, 576):
        raise RuntimeError(f"{op} only support the head_dim to 320 or 576 for better performance")
    if kv_cache_dtype not in _FLAT_FP8 + _UNQUANTIZED:
        raise RuntimeError(f"Unsupported fp8 kv cache data type: {kv_cache_dtype}")
    for name, t in (("block_table", block_table), ("cu_seq_lens", cu_seq_lens)) + (
            (("seq_starts", seq_starts),) if seq_starts is not None else ()):
        if t.dtype != torch.int32:
            raise RuntimeError(f"{name} must be int32")
    num_blocks, block_size = src_cache.shape[:2]
    quantized = kv_cache_dtype in _FLAT_FP8
    entry_elems = src_cache.shape[2:].numel()
    if head_dim > entry_elems:  # the kernel reads head_dim elements of each entry, whatever the entry holds
        _violation(op, "src_cache", head_dim, entry_elems, src_cache.element_size(), access="load")
    tts, cu = token_to_seq.long().cpu(), cu_seq_lens.long().cpu()
    starts = seq_starts.long().cpu() if seq_starts is not None else None
    table = block_table.long().cpu()
    flat_table = table.reshape(-1) if table.is_contiguous() else table.contiguous().reshape(-1)
    # Tokens up to the first that stops the kernel: past token_to_seq, a request id outside cu_seq_lens, or past
    # its request's end (`if (token_id >= batch_end) return;`): nothing is written from there on.
    t = torch.arange(min(num_tokens, tts.numel()))
    b = tts[: len(t)]
    stop = (b < 0) | (b >= cu.numel() - 1)
    stop |= t >= cu[(b + 1).clamp(0, cu.numel() - 1)]
    end = int(stop.nonzero()[0]) if stop.any() else len(t)
    t, b = t[:end], b[:end]
    pos = t - cu[b] + (starts[b] if starts is not None else 0)
    at = b * block_table.stride(0) + torch.div(pos, block_size, rounding_mode="floor")
    bad_at = (at < 0) | (at >= flat_table.numel()) | (pos < 0)
    block = torch.where(bad_at, 0, flat_table[at.clamp(0, max(flat_table.numel() - 1, 0))])
    bad_block = ~bad_at & ((block < 0) | (block >= num_blocks))
    bad_dst = ~bad_at & ~bad_block & (t >= dst.shape[0])
    for i in (bad_at | bad_block | bad_dst).nonzero().flatten().tolist():  # each a fault of the real op, in order
        if bad_at[i]:
            _violation(op, "block_table", int(at[i]), flat_table.numel(), 4, access="load")
        elif bad_block[i]:
            _violation(op, "src_cache", int(block[i]) * block_size + int(pos[i]) % block_size, num_blocks * block_size,
                       entry_elems * src_cache.element_size(), access="load")
        else:
            _violation(op, "dst", int(t[i]), dst.shape[0], head_dim * dst.element_size())
    ok = ~(bad_at | bad_block | bad_dst)
    if ok.any():  # each entry's first head_dim elements, whatever the entry holds
        raw = src_cache[block[ok].to(src_cache.device), (pos[ok] % block_size).to(src_cache.device)]
        raw = raw.reshape(int(ok.sum()), -1)[:, :head_dim]
        if quantized:
            value = raw.view(torch.uint8).view(torch.float8_e4m3fn).float() * scale.float().reshape(-1)[0]
        else:
            value = raw
        dst[t[ok].to(dst.device)] = value.to(dst.dtype)
    if end < min(num_tokens, tts.numel()):
        b_stop = int(tts[end])
        if not 0 <= b_stop < cu.numel() - 1:
            _violation(op, "cu_seq_lens", b_stop + 1, cu.numel(), 4, access="load")
    elif num_tokens > tts.numel():
        _violation(op, "token_to_seq", tts.numel(), tts.numel(), 4, access="load")
''',
    "fuzzer.standins.flashmla_ops": r'''"""Torch stand-ins for the compiled ops FlashMLA-sparse calls (`vllm._flashmla_C`, `_C_cache_ops`).

Semantics follow FlashMLA's interface docstrings (vllm/third_party/flashmla/flash_mla_interface.py) and its
reference (deepseek-ai/FlashMLA tests/ref.py): natural-log LSE; a row with nothing to attend to gives
out 0 and LSE +inf. Where the real kernel would read or write outside a tensor, the stand-in records a
MemoryViolation (as the interpreter sanitizer does) and skips that entry instead of reading garbage.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from fuzzer.interp.sanitizer import SANITIZER, MemoryViolation

# fp8_ds_mla entry: 512 fp8 NoPE | 4 fp32 tile scales | 64 bf16 RoPE = 656 bytes
NOPE, TILE, SCALES_AT, ROPE_AT, ENTRY_BYTES, FP8_MAX = 512, 128, 512, 528, 656, 448.0


def _violation(op: str, argument: str, access: str, index: int, limit: int, elem_bytes: int) -> None:
    SANITIZER.violations.append(MemoryViolation(
        kernel=f"{op} (attnfuzz stand-in)", op=access, argument=argument, byte_offset=index * elem_bytes,
        argument_bytes=limit * elem_bytes, element_bytes=elem_bytes, program_id=(0, 0, 0), lanes=1,
        inside_allocation=False))


def _report(op: str, argument: str, bad: torch.Tensor, values: torch.Tensor, limit: int, elem_bytes: int) -> None:
    for v in values[bad].tolist()[:8]:  # the first few name the bug
        _violation(op, argument, "load", int(v), limit, elem_bytes)


def _sparse_attention(q: torch.Tensor, gathered: torch.Tensor, invalid: torch.Tensor, sm_scale: float, d_v: int):
    """q [T, H, D], gathered [T, K, D] (fp32), invalid [T, K] -> out [T, H, d_v] fp32, max_logits, lse [T, H]."""
    gathered = gathered.masked_fill(invalid[..., None], 0.0)  # masked rows may hold the cache's NaN poison
    logits = torch.einsum("thd,tkd->thk", q.float(), gathered) * sm_scale
    logits.masked_fill_(invalid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    max_logits = logits.amax(dim=-1) if logits.shape[-1] else lse.clone()
    empty = lse == float("-inf")
    p = torch.exp(logits - torch.where(empty, float("inf"), lse)[..., None])  # empty row: all weights 0
    out = torch.einsum("thk,tkd->thd", p, gathered[..., :d_v])
    return out, max_logits, lse.masked_fill(empty, float("inf"))


def _topk_length_mask(op: str, topk_length, shape, device) -> torch.Tensor:
    """True past each row's topk_length (the kernel does not look there)."""
    if topk_length is None:
        return torch.zeros(shape, dtype=torch.bool, device=device)
    k = shape[-1]
    lengths = topk_length.reshape(-1).long()
    _report(op, "indices", lengths > k, lengths, k, 4)  # the kernel would read indices past the row
    return torch.arange(k, device=device) >= lengths.view(*shape[:-1], 1)


def flash_mla_sparse_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
                         attn_sink: Optional[torch.Tensor] = None, topk_length: Optional[torch.Tensor] = None,
                         out: Optional[torch.Tensor] = None):
    """`sparse_prefill_fwd`: q [s_q, h_q, d_qk] bf16, kv [s_kv, 1, d_qk] bf16, indices [s_q, 1, topk] int32.
    Indices < 0 or >= s_kv are invalid by contract (masked, not a fault). Returns (out, max_logits, lse)."""
    assert kv.shape[1] == 1 and indices.shape[1] == 1 and d_v == 512, "h_kv must be 1, d_v 512"
    s_kv = kv.shape[0]
    idx = indices[:, 0, :].long()
    invalid = (idx < 0) | (idx >= s_kv) | _topk_length_mask("flash_mla_sparse_fwd", topk_length, idx.shape, idx.device)
    gathered = kv[:, 0][idx.masked_fill(invalid, 0)].float()
    o, max_logits, lse = _sparse_attention(q, gathered, invalid, sm_scale, d_v)
    if attn_sink is not None:
        o = o * torch.sigmoid(lse - attn_sink.float()[None]).nan_to_num(0.0)[..., None]
    if out is None:
        out = torch.empty(q.shape[0], q.shape[1], d_v, dtype=q.dtype, device=q.device)
    out.copy_(o)
    return out, max_logits, lse


@dataclasses.dataclass
class FlashMLASchedMeta:
    """The real one's shape-consistency contract: initialised on first use, reusable only with the same shapes."""

    have_initialized: bool = False
    config: Optional[tuple] = None
    tile_scheduler_metadata: Optional[torch.Tensor] = None
    num_splits: Optional[torch.Tensor] = None


def get_mla_metadata(*args, **kwargs):
    return FlashMLASchedMeta(), None


def dequantize_fp8_ds_mla(entries: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 656] -> bf16 [..., 576]: NoPE = fp8 x its tile's fp32 scale (rounded to bf16), RoPE copied."""
    e = entries.reshape(-1, ENTRY_BYTES).contiguous()
    nope = e[:, :NOPE].view(torch.float8_e4m3fn).float().view(-1, NOPE // TILE, TILE)
    scales = e[:, SCALES_AT:ROPE_AT].view(torch.float32)
    rope = e[:, ROPE_AT:].view(torch.bfloat16)
    out = torch.cat([(nope * scales[..., None]).reshape(-1, NOPE).to(torch.bfloat16), rope], dim=-1)
    return out.view(*entries.shape[:-1], NOPE + rope.shape[-1])


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                           num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None,
                           attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                           extra_topk_length=None, out=None, enable_batch_invariant=False):
    """Sparse fp8 decode (`sparse_decode_fwd`) only: q [b, s_q, h_q, 576], k_cache uint8 [pages, page_size, 1, 656],
    indices [b, s_q, topk] = page * page_size + offset, -1 invalid. Returns out [b, s_q, h_q, 512], lse [b, h_q, s_q]."""
    meta = tile_scheduler_metadata
    assert isinstance(meta, FlashMLASchedMeta) and num_splits is None
    assert indices is not None and is_fp8_kvcache and not causal, "stand-in covers sparse fp8 decode only"
    assert extra_k_cache is None and extra_indices_in_kvcache is None and k_cache.shape[-1] == ENTRY_BYTES
    config = (q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1], k_cache.shape[2], causal, is_fp8_kvcache,
              indices.shape[-1], None, None, enable_batch_invariant)
    if not meta.have_initialized:
        meta.have_initialized, meta.config = True, config
    else:  # the real wrapper asserts the same, field by field
        assert meta.config == config, f"sched_meta reused with other shapes: {meta.config} vs {config}"
    softmax_scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    b, s_q, h_q, d = q.shape
    pages, page_size = k_cache.shape[:2]
    idx = indices.reshape(b * s_q, -1).long()
    # FlashMLA's decode reference masks only -1; anything else outside the cache is a fault.
    oob = (idx != -1) & ((idx < 0) | (idx >= pages * page_size))
    _report("flash_mla_with_kvcache", "k_cache", oob, idx, pages * page_size, ENTRY_BYTES)
    invalid = (idx == -1) | oob | _topk_length_mask("flash_mla_with_kvcache", topk_length, idx.shape, idx.device)
    safe = idx.masked_fill(invalid, 0)
    entries = k_cache[:, :, 0][safe // page_size, safe % page_size]  # honours the page stride of a strided cache
    gathered = dequantize_fp8_ds_mla(entries).float()
    o, _, lse = _sparse_attention(q.reshape(b * s_q, h_q, d), gathered, invalid, softmax_scale, head_dim_v)
    if attn_sink is not None:
        o = o * torch.sigmoid(lse - attn_sink.float()[None]).nan_to_num(0.0)[..., None]
    o = o.view(b, s_q, h_q, head_dim_v)
    if out is None:
        out = torch.empty_like(o, dtype=q.dtype)
    out.copy_(o)
    return out, lse.view(b, s_q, h_q).transpose(1, 2).contiguous()


def concat_mla_q(ql_nope: torch.Tensor, q_pe: torch.Tensor, q_out: torch.Tensor) -> None:
    """`ops.concat_mla_q`: q_out[t, h] = ql_nope[t, h] | q_pe[t, h] for the input's heads (q_out may have more)."""
    t, h, nope = ql_nope.shape
    if q_out.shape[0] < t or q_out.shape[1] < h or q_out.shape[2] != nope + q_pe.shape[-1]:
        _violation("concat_mla_q", "q_out", "store", q_out.numel(), q_out.numel(), q_out.element_size())
        return
    q_out[:t, :h, :nope] = ql_nope
    q_out[:t, :h, nope:] = q_pe


def _gather_request(op, src_cache, dst, block_table, b: int, start: int, pos: torch.Tensor) -> None:
    """Request b's positions `pos`, dequantized, to dst[start + i]; every index it follows bounds-checked."""
    num_blocks, block_size = src_cache.shape[:2]
    if start + len(pos) > dst.shape[0]:
        _violation(op, "dst", "store", start + len(pos) - 1, dst.shape[0], dst.shape[-1] * dst.element_size())
        pos = pos[: max(0, dst.shape[0] - start)]
    col = pos // block_size
    bad_col = col >= block_table.shape[1]
    _report(op, "block_table", bad_col, b * block_table.shape[1] + col, block_table.numel(), 4)
    blocks = block_table[b].long()[col.clamp(max=block_table.shape[1] - 1)]
    bad = ~bad_col & ((blocks < 0) | (blocks >= num_blocks))
    _report(op, "src_cache", bad, blocks * block_size + pos % block_size, num_blocks * block_size, ENTRY_BYTES)
    ok = ~(bad_col | bad)
    first = pos[0] if len(pos) else 0
    dst[start + pos[ok] - first] = dequantize_fp8_ds_mla(src_cache[blocks[ok], (pos % block_size)[ok]]).to(dst.dtype)


def cp_gather_and_upconvert_fp8_kv_cache(src_cache, dst, block_table, workspace_starts, batch_size, seq_starts=None,
                                         host_cache=None, host_row_ids=None, device_row_ids=None) -> None:
    """`ops.cp_gather_and_upconvert_fp8_kv_cache`: request b's positions [0, n_b) (from seq_starts[b]) go, dequantized,
    to dst[workspace_starts[b] + i]; n_b is the gap to the next start (the last one: to dst's end)."""
    assert host_cache is None and host_row_ids is None and device_row_ids is None, "HiSparse host rows not covered"
    starts = workspace_starts[:batch_size].long().tolist() + [dst.shape[0]]
    for b in range(batch_size):
        pos = torch.arange(starts[b + 1] - starts[b], device=dst.device)
        if seq_starts is not None:
            pos = pos + int(seq_starts[b])
        _gather_request("cp_gather_and_upconvert_fp8_kv_cache", src_cache, dst, block_table, b, starts[b], pos)


def _ceil_pow2(s: torch.Tensor) -> torch.Tensor:
    mantissa, exponent = torch.frexp(s)
    return torch.ldexp(torch.ones_like(s), exponent - (mantissa == 0.5).to(exponent.dtype))


def quantize_fp8_ds_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, scale_convention: str = "pow2") -> torch.Tensor:
    """[n, 512] + [n, 64] -> uint8 [n, 656]. "pow2": max(amax/448, 1e-4) rounded up to a power of two (newer CUDA
    and the Triton writer); "arbitrary": max(amax/448, FLT_MIN) unrounded (older CUDA writer)."""
    tiles = kv_c.float().view(-1, NOPE // TILE, TILE)
    s = tiles.abs().amax(dim=-1) / FP8_MAX
    s = _ceil_pow2(s.clamp(min=1e-4)) if scale_convention == "pow2" else s.clamp(min=torch.finfo(torch.float32).tiny)
    fp8 = (tiles / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8).view(-1, NOPE)
    return torch.cat([fp8, s.view(torch.uint8), k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)], dim=-1)


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale, scale_convention="pow2"):
    """`ops.concat_and_cache_mla` for "fp8_ds_mla" (per-entry scales; `scale` is ignored, as in the CUDA op);
    unquantized dtypes go to the plain stand-in."""
    if kv_cache_dtype != "fp8_ds_mla":
        from fuzzer.standins.cache_ops import concat_and_cache_mla as plain

        return plain(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale)
    num_blocks, block_size = kv_cache.shape[:2]
    slots, capacity = slot_mapping.long(), num_blocks * block_size
    for slot in slots[slots >= capacity].tolist()[:8]:
        _violation("concat_and_cache_mla", "kv_cache", "store", slot, capacity, ENTRY_BYTES)
    keep = (slots >= 0) & (slots < capacity)
    kv_cache[slots[keep] // block_size, slots[keep] % block_size] = quantize_fp8_ds_mla(
        kv_c[keep], k_pe[keep], scale_convention)


def cp_gather_and_upconvert_fp8_kv_cache_seq_lens(src_cache, dst, block_table, seq_lens, workspace_starts,
                                                  batch_size) -> None:
    """The op as 0.23 declares it: request b's positions [0, seq_lens[b]) go, dequantized, to
    dst[workspace_starts[b] + i] (later releases take seq_starts and derive each length from the next start)."""
    for b in range(batch_size):
        pos = torch.arange(int(seq_lens[b]), device=dst.device)
        _gather_request("cp_gather_and_upconvert_fp8_kv_cache", src_cache, dst, block_table, b,
                        int(workspace_starts[b]), pos)
''',
    "fuzzer.standins.flash_attn_ops": r'''"""Stand-in for vLLM's compiled FlashAttention varlen kernel (`vllm.vllm_flash_attn.flash_attn_varlen_func`).

Releases before vLLM's CPU_SDPA_MLA prefill backend (0.23, 0.26) choose the FLASH_ATTN MLA prefill backend on a
host that reports no device capability (any CPU); that backend's Python is vLLM's, only the kernel it calls is
this stand-in. Semantics follow vllm_flash_attn's `flash_attn_varlen_func` docstring: q [total_q, H, D],
k [total_k, H_k, D], v [total_k, H_k, D_v]; request b's queries are q[cu_seqlens_q[b]:cu_seqlens_q[b+1]], its keys
k[cu_seqlens_k[b]:cu_seqlens_k[b+1]]; the LSE comes back with `return_softmax_lse` (vllm_flash_attn, CUDA/XPU)
or, as upstream flash_attn's `return_attn_probs` gives it (what vLLM's backend asks for on other platforms), as
(out, lse, None); `causal` aligns the mask to the bottom right (query i of sq sees key j <=
i + sk - sq); natural-log LSE [H, total_q] in fp32. A query row with no key to attend to (an empty context chunk)
is left as the kernel leaves it, undefined: NaN output, LSE -inf (vLLM's `mask_empty_context` neutralizes both).
Rows past cu_seqlens_q[-1] are not written. An offset past q or k is a memory violation, recorded and skipped.
"""

from __future__ import annotations

import torch

from fuzzer.interp.sanitizer import SANITIZER, MemoryViolation

OP = "flash_attn_varlen_func"


def _violation(argument: str, index: int, limit: int, elem_bytes: int) -> None:
    SANITIZER.violations.append(MemoryViolation(
        kernel=f"{OP} (attnfuzz stand-in)", op="load", argument=argument, byte_offset=index * elem_bytes,
        argument_bytes=limit * elem_bytes, element_bytes=elem_bytes, program_id=(0, 0, 0), lanes=1,
        inside_allocation=False))


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_seqlen_q: int,
                           cu_seqlens_q: torch.Tensor, max_seqlen_k: int, cu_seqlens_k: torch.Tensor | None = None,
                           softmax_scale: float | None = None, causal: bool = False,
                           return_softmax_lse: bool = False, return_attn_probs: bool = False,
                           out: torch.Tensor | None = None,
                           output_scale: torch.Tensor | None = None, fa_version: int | None = None, **unused):
    if output_scale is not None:
        raise NotImplementedError(f"attnfuzz's {OP} stand-in writes no quantized output (output_scale)")
    if unused.get("seqused_k") is not None or unused.get("block_table") is not None:
        raise NotImplementedError(f"attnfuzz's {OP} stand-in takes contiguous varlen keys only")
    assert cu_seqlens_k is not None, "varlen keys need cu_seqlens_k"
    heads, d_v = q.shape[1], v.shape[-1]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    if out is None:
        out = torch.empty(q.shape[0], heads, d_v, dtype=q.dtype, device=q.device)
    lse = torch.full((heads, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.long().tolist(), cu_seqlens_k.long().tolist()
    group = heads // k.shape[1]
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 > q.shape[0] or k1 > k.shape[0]:  # the kernel would read past q or k
            if q1 > q.shape[0]:
                _violation("q", q1 * heads * q.shape[-1] - 1, q.numel(), q.element_size())
            if k1 > k.shape[0]:
                _violation("k", k1 * k.shape[1] * k.shape[-1] - 1, k.numel(), k.element_size())
            continue
        sq, sk = q1 - q0, k1 - k0
        if sq <= 0:
            continue
        if sk <= 0:
            out[q0:q1] = float("nan")  # nothing attended: the kernel's rows are undefined
            continue
        qb = q[q0:q1].float().transpose(0, 1)  # [H, sq, D]
        kb = k[k0:k1].float().transpose(0, 1).repeat_interleave(group, dim=0)
        vb = v[k0:k1].float().transpose(0, 1).repeat_interleave(group, dim=0)
        s = torch.matmul(qb, kb.transpose(-2, -1)) * scale
        if causal:
            i = torch.arange(sq, device=q.device)[:, None]
            j = torch.arange(sk, device=q.device)[None, :]
            s = s.masked_fill(j > i + (sk - sq), float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)  # [H, sq]
        p = torch.exp(s - row_lse[..., None])
        o = torch.matmul(p, vb).transpose(0, 1)  # [sq, H, D_v]
        empty = torch.isinf(row_lse).transpose(0, 1)  # causal rows that see no key (sq > sk)
        out[q0:q1] = o.masked_fill(empty[..., None], float("nan")).to(out.dtype)
        lse[:, q0:q1] = row_lse
    if return_attn_probs:  # upstream flash_attn's form (vLLM uses it off CUDA/XPU): (out, softmax_lse, S_dmask)
        return out, lse, None
    return (out, lse) if return_softmax_lse else out
''',
    "fuzzer.targets.flashmla_runtime": r'''"""Setting vLLM up to run the FlashMLA sparse backend without a model, shared by the FlashMLA targets and
their reproducers (which inline this file): the stand-ins bound where the host lacks compiled ops, the CPU
shims, one real VllmConfig, and MLAAttention layers built like a DeepSeek-V3.2 layer. torch and vLLM only
(plus attnfuzz's stand-in modules)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import json
import re
from pathlib import Path
from types import SimpleNamespace

import torch

# DeepSeek-V3.2's MLA dims
KV_LORA_RANK, ROPE_DIM, QK_NOPE, V_HEAD = 512, 64, 128, 128
HEAD_SIZE, SM_SCALE = KV_LORA_RANK + ROPE_DIM, (QK_NOPE + ROPE_DIM) ** -0.5

BACKEND_MODULE = "vllm.v1.attention.backends.mla.flashmla_sparse"
LAYER = "attnfuzz.layer"
FP8_ENTRY_BYTES = 656
MAX_MODEL_LEN = 8192  # fp8 reserves max_model_len x sparse_mla_prefill_workspace_factor rows of 576 bf16
# A small DeepSeek-V3.2-shaped HF config: ModelConfig needs one on disk (no hub); only the MLA dims matter.
HF_CONFIG = dict(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", hidden_size=1024,
                 num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=KV_LORA_RANK, q_lora_rank=None,
                 qk_nope_head_dim=128, qk_rope_head_dim=ROPE_DIM, v_head_dim=128, index_topk=2048, index_n_heads=8,
                 index_head_dim=128, num_hidden_layers=1, vocab_size=1000, intermediate_size=256,
                 moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                 max_position_embeddings=MAX_MODEL_LEN, torch_dtype="bfloat16")


def _has_flashmla_kernels() -> bool:
    return importlib.import_module("vllm.v1.attention.ops.flashmla")._is_flashmla_available()[0]


def _has_op(namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
        return True
    except (AttributeError, RuntimeError):
        return False


def has_cache_op(name: str) -> bool:
    return _has_op("_C_cache_ops", name)


@functools.cache
def install_standins(device: str = "cuda") -> tuple[str, ...]:
    """Bind torch stand-ins where flashmla_sparse looks the compiled ops up: for ops this host lacks, and for
    every compiled op when the tensors live on the CPU (a CPU run on a GPU host: the CUDA kernels cannot
    take them)."""
    from fuzzer.standins import flashmla_ops

    mod, bound = importlib.import_module(BACKEND_MODULE), []
    if device == "cpu" or not _has_flashmla_kernels():
        for name in ("flash_mla_sparse_fwd", "flash_mla_with_kvcache", "get_mla_metadata", "FlashMLASchedMeta"):
            setattr(mod, name, getattr(flashmla_ops, name))
        bound += ["flash_mla_sparse_fwd", "flash_mla_with_kvcache", "get_mla_metadata"]
    missing = [n for n in ("concat_mla_q", "cp_gather_and_upconvert_fp8_kv_cache") if device == "cpu" or not has_cache_op(n)]
    if missing:  # `ops` is vLLM's _custom_ops, bound by name: rebind it to a copy with the stand-ins
        standins = {n: getattr(flashmla_ops, n) for n in missing}
        if "cp_gather_and_upconvert_fp8_kv_cache" in standins and "seq_lens" in inspect.signature(
                mod.ops.cp_gather_and_upconvert_fp8_kv_cache).parameters:  # 0.23's form of the op
            standins["cp_gather_and_upconvert_fp8_kv_cache"] = flashmla_ops.cp_gather_and_upconvert_fp8_kv_cache_seq_lens
        mod.ops = SimpleNamespace(**{**vars(mod.ops), **standins})
        bound += missing
    return tuple(bound)


def _try_import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


@functools.cache
def cpu_shims() -> tuple[str, ...]:
    """CPU-only stand-ins for accelerator plumbing: they change no computation (streams are no-ops there)."""
    import vllm.v1.attention.backends.utils as backend_utils
    import vllm.v1.worker.workspace as workspace

    mod = importlib.import_module(BACKEND_MODULE)
    # Modules that bound PIN_MEMORY by name at import (0.33; older releases lack some of them).
    optional = [_try_import(m) for m in ("vllm.model_executor.layers.attention.mla_attention",
                                         "vllm.model_executor.layers.attention.sparse_mla_attention",
                                         "vllm.v1.attention.backends.mla.index_group")]
    index_group = optional[2]
    for m in (*[m for m in optional[:2] if m is not None], backend_utils, mod):
        if hasattr(m, "PIN_MEMORY"):
            m.PIN_MEMORY = False

    class _NoStream:  # CPU work is synchronous: waits, records and stream scopes order nothing
        def __init__(self, *a, **k): ...
        def wait_event(self, *a): ...
        def wait_stream(self, *a): ...
        def record(self, *a): ...
        def synchronize(self): ...
        def __enter__(self): return self
        def __exit__(self, *a): return False

    mod.num_compute_units = lambda device_id=0: 132  # CPU platform raises NotImplementedError; SM90's count
    if index_group is not None:
        index_group._create_side_stream = lambda device: _NoStream()
        index_group._create_event = lambda: _NoStream()
        index_group.current_stream = lambda: _NoStream()
    mod.current_stream = lambda: _NoStream()
    workspace.torch = SimpleNamespace(**{**vars(torch), "accelerator": SimpleNamespace(empty_cache=lambda: None)})
    _zeros, _empty = torch.zeros, torch.empty
    mod.torch = SimpleNamespace(**{**vars(torch), "zeros": lambda *a, pin_memory=False, **k: _zeros(*a, **k)})
    mla = optional[0]
    pinned_mla = mla is not None and "pin_memory=True" in inspect.getsource(mla)
    if pinned_mla:  # 0.26 allocates the chunked-context metadata pinned, literally (0.33 through PIN_MEMORY)
        mla.torch = SimpleNamespace(**{**vars(torch), "zeros": lambda *a, pin_memory=False, **k: _zeros(*a, **k),
                                       "empty": lambda *a, pin_memory=False, **k: _empty(*a, **k)})
    return (*(("mla_attention: torch.empty/zeros(pin_memory=True) unpinned (chunked-context metadata)",)
              if pinned_mla else ()),
            "PIN_MEMORY=False where (sparse_)mla_attention and backends.utils bound it",
            "flashmla_sparse.num_compute_units=132 (CPU platform raises)",
            "index group side stream / events / current_stream: no-ops (CPU has no streams)",
            "workspace manager: torch.accelerator.empty_cache no-op",
            "flashmla_sparse: torch.zeros(pin_memory=True) unpinned (fp8 separate path)")


# Capability queries some constructors make of vLLM's compiled `_C` (CUTLASS fp8 GEMMs: ModelConfig's
# architecture inspection, the layer's fp8 quant ops). A build without `_C` (the GPU bundle) answers as a
# build without those kernels would: False. Attention computes nothing with them.
_C_QUERIES = ("cutlass_scaled_mm_supports_block_fp8", "cutlass_scaled_mm_supports_fp8")


def define_missing_c_queries() -> tuple[str, ...]:
    missing = []
    for name in _C_QUERIES:
        try:
            getattr(torch.ops._C, name)
        except (AttributeError, RuntimeError):
            missing.append(name)
    if missing:
        if not _LIBS:
            _LIBS.append(torch.library.Library("_C", "FRAGMENT"))
        for name in missing:
            _LIBS[0].define(f"{name}(int cuda_device_capability) -> bool")
            _LIBS[0].impl(name, lambda cap: False, "CompositeExplicitAutograd")
    return tuple(f"torch.ops._C.{name} -> False (not in this build)" for name in missing)


@contextlib.contextmanager
def _inspect_in_process():
    """ModelConfig inspects the architecture by importing DeepSeek's model module in a subprocess, whose
    quantization utils ask vLLM's compiled `_C` whether CUTLASS block-fp8 GEMMs exist. Where `_C` is missing
    (the GPU bundle), inspect in this process, where `define_missing_c_queries` answers."""
    from vllm.model_executor.models import registry

    define_missing_c_queries()
    run_in_subprocess = registry._run_in_subprocess
    registry._run_in_subprocess = lambda fn: fn()
    try:
        yield
    finally:
        registry._run_in_subprocess = run_in_subprocess


_LIBS: list = []


@functools.cache
def vllm_runtime(device: str, state_dir: str, world_size: int = 1, rank: int = 0, init_method: str | None = None):
    """Process-wide: one real VllmConfig (per-case fields are set by `configure`), vLLM's process groups
    (the impl asks for the TP group; by default a world of one, on gloo), and the workspace manager.
    `state_dir` holds the model's config.json and the process group's init file. With `world_size` > 1 this
    process is `rank` of a real group (NCCL on GPUs, gloo on CPUs) whose TP and DCP groups span every rank,
    as DCP reuses the TP ranks."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

    model_dir = (Path(state_dir) / "flashmla-model").resolve()
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(HF_CONFIG))
    with _inspect_in_process():
        model = ModelConfig(model=str(model_dir), tokenizer=None, skip_tokenizer_init=True, dtype="bfloat16",
                            max_model_len=MAX_MODEL_LEN)
    cfg = VllmConfig(model_config=model, device_config=DeviceConfig(device=device))
    with set_current_vllm_config(cfg):
        if parallel_state._TP is None:
            if init_method is None:
                init_file = (Path(state_dir) / "flashmla-dist-init").resolve()
                init_file.unlink(missing_ok=True)
                init_method = f"file://{init_file}"
            backend = "nccl" if world_size > 1 and device == "cuda" else "gloo"
            parallel_state.init_distributed_environment(world_size, rank, init_method, rank, backend)
            parallel_state.initialize_model_parallel(world_size, 1, 1, world_size)
    if not is_workspace_manager_initialized():
        init_workspace_manager(torch.device(device))
    return cfg


def configure(cfg, case, max_num_batched_tokens: int):
    """The case's model/cache/scheduler fields on the shared config, as vLLM's tests patch theirs."""
    cfg.model_config.hf_text_config.index_topk = case.topk_width
    cfg.model_config.get_num_attention_heads = lambda parallel_config=None: case.heads  # TP = 128 / heads
    cfg.cache_config.cache_dtype = case.kv_cache_dtype
    cfg.cache_config.block_size = case.block_size
    cfg.scheduler_config.max_num_batched_tokens = max_num_batched_tokens
    # DCP: every case sets it (the config is shared by every case of the process, DCP or not).
    cfg.parallel_config.decode_context_parallel_size = case.dcp.size
    cfg.parallel_config.cp_kv_cache_interleave_size = case.dcp.interleave
    # A placeholder layer with no prefill backend: every token takes forward_mqa.
    cfg.compilation_config.static_forward_context[LAYER] = SimpleNamespace(prefill_backend=None)
    return cfg




@functools.cache
def install_layer_standins(device: str) -> tuple[str, ...]:
    """The dense-MHA path's compiled ops, where this host lacks them."""
    from fuzzer.standins import cache_ops, flashmla_ops

    mla, bound = importlib.import_module(MLA_MODULE), []
    standins = {"gather_and_maybe_dequant_cache": cache_ops.gather_and_maybe_dequant_cache,
                "cp_gather_and_upconvert_fp8_kv_cache": flashmla_ops.cp_gather_and_upconvert_fp8_kv_cache}
    missing = {name: op for name, op in standins.items() if device == "cpu" or not has_cache_op(name)}
    if missing:  # mla_attention binds vLLM's _custom_ops as `ops`: rebind it to a copy carrying the stand-ins
        mla.ops = SimpleNamespace(**{**vars(mla.ops), **missing})
        bound += list(missing)
    if device != "cpu" and not _has_op("_C", "merge_attn_states"):
        # On CUDA vLLM merges with its compiled kernel; vLLM's own Triton merge (what other platforms use) runs
        # in its place. (A CPU host already takes the Triton merge.)
        import vllm._custom_ops as custom_ops
        from vllm.v1.attention.ops.triton_merge_attn_states import merge_attn_states

        custom_ops.merge_attn_states = merge_attn_states
        bound.append("merge_attn_states (vLLM's Triton merge for the CUDA op)")
    if layer_api().prefill_backend == "FLASH_ATTN":
        # The release's own FlashAttention prefill backend. fa_utils binds the platform's compiled varlen kernel
        # (vllm_flash_attn on CUDA, xpu_ops on XPU) and, on CUDA, FA4's compile API; on a host with neither (a CPU
        # platform) it binds nothing and the backend's module cannot import. Bind the stand-in where fa_utils
        # would, with no compile API (as on XPU and ROCm), and where the backend module bound the kernel.
        from fuzzer.standins.flash_attn_ops import flash_attn_varlen_func

        fa_utils = importlib.import_module("vllm.v1.attention.backends.fa_utils")
        # A GPU host without FA's compiled extensions (the GPU bundle: an import stand-in that raises) lacks it too.
        lacks_kernel = device == "cpu" or not _has_compiled_flash_attn()
        if lacks_kernel or not hasattr(fa_utils, "flash_attn_varlen_func"):
            fa_utils.flash_attn_varlen_func = flash_attn_varlen_func
            if not hasattr(fa_utils, "compile_flash_attn_varlen_func_from_specs"):
                fa_utils.compile_flash_attn_varlen_func_from_specs = None
        fa = importlib.import_module(FLASH_ATTN_PREFILL_MODULE)
        if lacks_kernel or fa.flash_attn_varlen_func is None:  # None: fa_utils says no kernel on this platform
            fa.flash_attn_varlen_func = flash_attn_varlen_func
            bound.append("flash_attn_varlen_func (the FLASH_ATTN MLA prefill backend's kernel)" if layer_api().dense_mha
                         else "flash_attn_varlen_func (bound for the FLASH_ATTN prefill backend the layer builds; "
                              "this release's sparse layer never calls it)")
    return tuple(bound)


def _has_compiled_flash_attn() -> bool:
    """Whether vllm_flash_attn's compiled FA2 or FA3 extension is installed (not merely its Python package)."""
    import importlib.util

    try:
        return any(importlib.util.find_spec(f"vllm.vllm_flash_attn.{ext}") is not None
                   for ext in ("_vllm_fa2_C", "_vllm_fa3_C"))
    except ImportError:
        return False


FLASH_ATTN_PREFILL_MODULE = "vllm.v1.attention.backends.mla.prefill.flash_attn"
CPU_SDPA_PREFILL_MODULE = "vllm.v1.attention.backends.mla.prefill.cpu_sdpa"


@functools.cache
def layer_api() -> SimpleNamespace:
    """How this release's MLAAttention is built and which routes it gives a sparse impl, read from its source.

    0.33: `prefill_backend_cls=` (attnfuzz passes vLLM's CPU_SDPA_MLA), `topk_indices_buffer=`; decode tokens to
    forward_mqa, short prefills (seq_len <= top-k) to the dense-MHA forward_mha. 0.26: no `prefill_backend_cls`
    (the layer picks its prefill backend itself: FLASH_ATTN on a host with no device capability, i.e. any CPU;
    there is no CPU_SDPA_MLA yet), `topk_indices_buffer=`, the same two routes. 0.23: no `topk_indices_buffer`
    (the impl reads it from `indexer=`), and forward_impl sends every token of a sparse impl to forward_mqa:
    there is no dense-MHA route (a FLASH_ATTN prefill backend is built but never called)."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    params = inspect.signature(MLAAttention.__init__).parameters
    dense_mha = "topk_tokens" in inspect.getsource(MLAAttention.forward_impl)  # the short-prefill test
    chosen = "prefill_backend_cls" in params and _try_import(CPU_SDPA_PREFILL_MODULE) is not None
    mla_source = inspect.getsource(importlib.import_module(MLA_MODULE))
    return SimpleNamespace(
        # 0.23/0.26 merge the context into only the first qsl[num_prefills_with_context] prefill tokens: they rely
        # on vLLM's batch order (prefills with context first), which their model runner guarantees.
        relies_on_batch_order=bool(re.search(r"prefill_tokens_with_context\s*=\s*prefill_query_start_loc_cpu\[",
                                             mla_source)),
        prefill_backend="CPU_SDPA_MLA" if chosen else "FLASH_ATTN",  # FLASH_ATTN: the layer's own pick on a CPU
        pass_prefill_backend=chosen,
        topk_buffer_arg="topk_indices_buffer" in params,
        dense_mha=dense_mha,
        routes=("decode -> forward_mqa; short prefill (seq_len <= top-k) -> dense-MHA forward_mha "
                "(+ chunked context)" if dense_mha else
                "every token -> forward_mqa (this release has no dense-MHA route for sparse MLA)"))


MLA_MODULE = "vllm.model_executor.layers.attention.mla_attention"


def mla_layer(cfg, heads: int, kv_b_weight: torch.Tensor, topk_indices_buffer: torch.Tensor, device: str):
    """A fresh MLAAttention on FLASHMLA_SPARSE, built as this release takes it (`layer_api`): with vLLM's
    CPU_SDPA_MLA prefill backend where the release takes one (FlashAttention is not on every host), kv_b_proj
    holding `kv_b_weight`; it registers itself as the forward context's LAYER, which the metadata builder reads.
    Call inside `set_current_vllm_config(cfg)`."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    cfg.compilation_config.static_forward_context.pop(LAYER, None)
    kv_b_proj = ColumnParallelLinear(KV_LORA_RANK, heads * (QK_NOPE + V_HEAD), bias=False, params_dtype=torch.bfloat16,
                                     prefix=f"{LAYER}.kv_b_proj").to(device)
    kv_b_proj.weight.data.copy_(kv_b_weight)
    api = layer_api()  # what this release's constructor takes
    extra = {"topk_indices_buffer": topk_indices_buffer} if api.topk_buffer_arg else {
        "indexer": SimpleNamespace(topk_indices_buffer=topk_indices_buffer)}
    if api.pass_prefill_backend:
        extra["prefill_backend_cls"] = importlib.import_module(CPU_SDPA_PREFILL_MODULE).CPUSDPAMLAPrefillBackend
    layer = MLAAttention(
        num_heads=heads, scale=SM_SCALE, qk_nope_head_dim=QK_NOPE, qk_rope_head_dim=ROPE_DIM, v_head_dim=V_HEAD,
        q_lora_rank=None, kv_lora_rank=KV_LORA_RANK, kv_b_proj=kv_b_proj, cache_config=cfg.cache_config, prefix=LAYER,
        attn_backend=importlib.import_module(BACKEND_MODULE).FlashMLASparseBackend, use_sparse=True, **extra)
    layer.process_weights_after_loading(torch.bfloat16)  # W_UK_T / W_UV from kv_b_proj, as after loading
    return layer


def record_routes(impl, route: dict) -> None:
    """Count the tokens vLLM hands each route (instance attributes shadow the impl's methods)."""
    forward_mqa, forward_mha = impl.forward_mqa, getattr(impl, "forward_mha", None)  # 0.23's sparse impls: no MHA

    def mqa(q, *args, **kwargs):
        route["mqa_tokens"] = route.get("mqa_tokens", 0) + (q[0] if isinstance(q, tuple) else q).shape[0]
        return forward_mqa(q, *args, **kwargs)

    def mha(q, *args, **kwargs):
        route["mha_tokens"] = route.get("mha_tokens", 0) + q.shape[0]
        return forward_mha(q, *args, **kwargs)

    impl.forward_mqa = mqa
    if forward_mha is not None:
        impl.forward_mha = mha


INDEX_GROUP_POISON = 0  # slot 0 of the null block: never a converted index (tables hold blocks >= 1)


def guard_index_group(impl):
    """Poison the index group's persistent physical top-k buffer; returns check(rows_converted) -> messages
    naming rows past the conversion's own that a call wrote (an overrun that stays inside vLLM's
    allocation, invisible to any memory checker)."""
    group = getattr(impl, "index_group", None)
    buffer = getattr(group, "physical_topk_indices", None)
    if buffer is None:
        return lambda rows: []
    buffer.fill_(INDEX_GROUP_POISON)

    def check(rows: int) -> list[str]:
        written = (buffer[rows:] != INDEX_GROUP_POISON).any(dim=-1).nonzero()
        if not len(written):
            return []
        return [f"index group physical_topk_indices: rows {rows + int(written[0])}..{rows + int(written[-1])} written by a "
                f"conversion of {rows} rows ({buffer.shape[0]} allocated): the index remap wrote past its output"]

    return check


# Context gathers of the dense-MHA path, recorded so the oracle can compare what they produced with the
# dequantization of the very cache bytes they read (class E). Recording wraps whatever op is bound (vLLM's
# compiled one or attnfuzz's stand-in) and reads the rows it wrote afterwards.
GATHER_OPS = ("cp_gather_and_upconvert_fp8_kv_cache", "gather_and_maybe_dequant_cache")
GATHER_LOG: list | None = None  # set to a list around one call to record; None: not recording


def _gathered(name: str, kw: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [n] of the cache rows the op read, the rows it wrote [n, D]) from the op's own arguments, by the
    op's contract: request b's position p lives at block_table[b][p // block_size], offset p % block_size."""
    dst, table = kw["dst"], kw["block_table"].long()
    block_size = kw["src_cache"].shape[1]
    starts = kw.get("seq_starts")
    requests, positions, rows = [], [], []
    if name == "cp_gather_and_upconvert_fp8_kv_cache":
        ws = kw["workspace_starts"][: kw["batch_size"]].long().tolist() + [dst.shape[0]]
        for b in range(kw["batch_size"]):
            n = ws[b + 1] - ws[b]
            requests += [b] * n
            positions += [(int(starts[b]) if starts is not None else 0) + i for i in range(n)]
            rows += range(ws[b], ws[b + 1])
    else:
        cu, tts = kw["cu_seq_lens"].long().tolist(), kw["token_to_seq"].long().tolist()
        for t in range(kw["num_tokens"]):
            b = tts[t]
            if t >= cu[b + 1]:
                break
            requests.append(b)
            positions.append(t - cu[b] + (int(starts[b]) if starts is not None else 0))
            rows.append(t)
    b = torch.tensor(requests, dtype=torch.long, device=table.device)
    p = torch.tensor(positions, dtype=torch.long, device=table.device)
    slots = table[b, p // block_size] * block_size + p % block_size if len(requests) else p
    return slots, dst[torch.tensor(rows, dtype=torch.long, device=dst.device)].float()


@functools.cache
def record_gathers() -> None:
    """Wrap the dense-MHA path's context gathers where mla_attention looks them up (once per process)."""
    mla = importlib.import_module(MLA_MODULE)
    wrapped = {}
    for name in GATHER_OPS:
        op = getattr(mla.ops, name)

        def wrapper(*args, _op=op, _name=name, **kwargs):
            _op(*args, **kwargs)
            if GATHER_LOG is not None and not args:  # vLLM calls them by keyword
                GATHER_LOG.append(_gathered(_name, kwargs))

        wrapped[name] = wrapper
    mla.ops = SimpleNamespace(**{**vars(mla.ops), **wrapped})


def impl_topk_kwargs(impl_cls, topk_indices_buffer: torch.Tensor) -> dict:
    """How this release's FlashMLASparseImpl takes the indexer's top-k buffer. With an index group (0.33):
    `topk_indices_buffer=` and no indexer, so the group orders its conversion on the compute stream (an indexer
    would make it wait for an event only a real indexer records). Without one (0.23, 0.26): through `indexer=`,
    which 0.23 requires."""
    if _try_import("vllm.v1.attention.backends.mla.index_group") is not None:
        return {"topk_indices_buffer": topk_indices_buffer, "indexer": None}
    return {"indexer": SimpleNamespace(topk_indices_buffer=topk_indices_buffer)}
''',
}


if __name__ == "__main__":
    sys.exit(main())
