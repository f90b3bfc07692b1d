"""The FlashMLA sparse backend (and FLASH_ATTN_MLA_SPARSE) set up on a host, shared by their targets and reproducers
(whose attnfuzz_support.py carries what their path reaches): the stand-ins bound where the host lacks compiled ops, the
backend module's CPU shims, and MLAAttention layers built like a DeepSeek-V3.2 layer; vLLM itself is set up by
vllm_setup. torch and vLLM only (plus attnfuzz's stand-in modules)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import weakref
from pathlib import Path
from types import SimpleNamespace

import torch

from fuzzer.support.errors import OffPath
from fuzzer.support.standins import cache_ops, flashmla_ops
from fuzzer.support.standins.flash_attn_ops import flash_attn_varlen_func
from fuzzer.support.standins.importable import importable_as
from fuzzer.support.vllm_setup import (KV_LORA_RANK, LAYER, QK_NOPE, ROPE_DIM, SM_SCALE, V_HEAD, NoStream, has_cache_op,
                                       has_op, standins_forced, try_import)


BACKEND_MODULE = "vllm.v1.attention.backends.mla.flashmla_sparse"
FP8_ENTRY_BYTES = 656


def _has_flashmla_kernels() -> bool:
    if standins_forced():
        return False
    return importlib.import_module("vllm.v1.attention.ops.flashmla")._is_flashmla_available()[0]


# flashmla_sparse's compiled ops by the path of the backend that calls them, each path's stand-ins as {op: stand-in}
# (`mod`: the backend module). A campaign binds every path's; a reproducer those of its case's path only, decided
# from the case when it is rendered, and every other op refuses there (`off_path`).
def bf16_kernel(mod) -> dict:
    """A bf16 cache (_forward_bf16_kv): FlashMLA's sparse prefill kernel over the cache's rows."""
    return dict(flash_mla_sparse_fwd=flashmla_ops.flash_mla_sparse_fwd)


def fp8_decode(mod) -> dict:
    """A quantized cache's decode (every token on the mixed-batch path): FlashMLA's sparse decode kernel, its
    planner (the builder's get_mla_metadata) and its scheduler metadata."""
    return dict(flash_mla_with_kvcache=flashmla_ops.flash_mla_with_kvcache, get_mla_metadata=flashmla_ops.get_mla_metadata,
                FlashMLASchedMeta=flashmla_ops.FlashMLASchedMeta)


def fp8_prefill(mod) -> dict:
    """A quantized cache's prefill on the separate prefill/decode path: the upconverting gather into the bf16
    workspace, then the bf16 kernel."""
    gather = flashmla_ops.cp_gather_and_upconvert_fp8_kv_cache
    if "seq_lens" in inspect.signature(mod.ops.cp_gather_and_upconvert_fp8_kv_cache).parameters:  # 0.23's form
        gather = flashmla_ops.cp_gather_and_upconvert_fp8_kv_cache_seq_lens
    return dict(cp_gather_and_upconvert_fp8_kv_cache=gather, **bf16_kernel(mod))


def q_concat(mod) -> dict:
    """forward_mqa handed the query as (ql_nope, q_pe), as MLAAttention hands it (every path): concatenated into the
    padded buffer."""
    return dict(concat_mla_q=flashmla_ops.concat_mla_q)


KERNELS = ("flash_mla_sparse_fwd", "flash_mla_with_kvcache", "get_mla_metadata", "FlashMLASchedMeta")  # FlashMLA's
CACHE_OPS = ("concat_mla_q", "cp_gather_and_upconvert_fp8_kv_cache")  # vLLM's _custom_ops


def off_path(op: str, paths: tuple):
    """What is bound for an op none of `paths` calls: it refuses (exit 2), so a path decided too narrowly stops the
    reproducer instead of reaching vLLM's compiled op."""

    def refuse(*args, **kwargs):
        raise OffPath(f"{op}: not in this reproducer's path ({', '.join(p.__name__ for p in paths)}), so no stand-in "
                      "was installed for it: the case took a path its reproducer was not rendered for")

    return refuse


@functools.cache
def install_standins(device: str, paths: tuple) -> tuple[str, ...]:
    """Bind torch stand-ins where flashmla_sparse looks the compiled ops up, those `paths` call: for ops this host
    lacks, and for every compiled op when the tensors live on the CPU (a CPU run on a GPU host: the CUDA kernels
    cannot take them). An op this host lacks that no path calls refuses."""
    install_standins.cache_clear()  # the module holds one binding: after another, an earlier one must bind again
    mod, bound = importlib.import_module(BACKEND_MODULE), []
    standins = {name: op for path in paths for name, op in path(mod).items()}
    if device == "cpu" or not _has_flashmla_kernels():
        for name in KERNELS:
            setattr(mod, name, standins.get(name) or off_path(name, paths))
        bound += [n for n in KERNELS if n in standins and n != "FlashMLASchedMeta"]
    missing = {n: standins.get(n) or off_path(n, paths) for n in CACHE_OPS if device == "cpu" or not has_cache_op(n)}
    if missing:  # `ops` is vLLM's _custom_ops, bound by name: rebind it to a copy with the stand-ins
        mod.ops = SimpleNamespace(**{**vars(mod.ops), **missing})
        bound += [n for n in missing if n in standins]
    return tuple(bound)


def flashmla_sparse_backend(device: str = "cuda"):
    """(vLLM's FLASHMLA_SPARSE backend class, the stand-ins bound for it here: every path's, `install_standins`)."""
    return flashmla_sparse_backend_for(device, (bf16_kernel, fp8_decode, fp8_prefill, q_concat))


def flashmla_sparse_backend_for(device: str, paths: tuple):
    """flashmla_sparse_backend with the stand-ins of `paths` only (a reproducer's: its case's path)."""
    return importlib.import_module(BACKEND_MODULE).FlashMLASparseBackend, install_standins(device, paths)


FLASH_ATTN_SPARSE_MODULE = "vllm.v1.attention.backends.mla.flashattn_mla_sparse"
FLASH_ATTN_INTERFACE = "vllm.vllm_flash_attn.flash_attn_interface"


@functools.cache
def flash_attn_sparse_backend(device: str = "cuda"):
    """(vLLM's FLASH_ATTN_MLA_SPARSE backend class, the stand-ins bound for it here). Its module imports FA3's
    `flash_attn_varlen_func` from vllm_flash_attn at import time. On a host whose vllm_flash_attn cannot load its
    compiled extension (any CPU; a GPU without it), or with tensors on the CPU, the module is imported with
    attnfuzz's stand-in in that import's place: only for that import, so that nothing else of vLLM sees a
    flash-attention it does not have."""
    if device != "cpu":
        with contextlib.suppress(ImportError):
            return importlib.import_module(FLASH_ATTN_SPARSE_MODULE).FlashAttnMLASparseBackend, ()
    import sys
    import types

    package, interface = types.ModuleType(FLASH_ATTN_INTERFACE.rsplit(".", 1)[0]), types.ModuleType(FLASH_ATTN_INTERFACE)
    package.__path__ = []
    interface.flash_attn_varlen_func = flash_attn_varlen_func
    sys.modules.pop(FLASH_ATTN_SPARSE_MODULE, None)  # a failed import above leaves nothing, but be sure
    with importable_as({m.__name__: m for m in (package, interface)}):
        module = importlib.import_module(FLASH_ATTN_SPARSE_MODULE)
    return module.FlashAttnMLASparseBackend, ("flash_attn_varlen_func",)


# vLLM's name of each sparse-MLA backend of this family -> its loader, (backend class, stand-ins) = loader(device).
# One function per backend, so that a reproducer (which is handed its target's loader) carries that backend's
# stand-ins only.
SPARSE_BACKENDS = {"FLASHMLA_SPARSE": flashmla_sparse_backend, "FLASH_ATTN_MLA_SPARSE": flash_attn_sparse_backend}


def prefilled_out(fn, out_shape):
    """`fn` (a FlashMLA entry point with an `out` parameter), its `out` filled with NaN first: vLLM's buffer if
    vLLM passes one, else one of `out_shape(arguments)` in q's dtype."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if a.get("out") is None:
            a["out"] = torch.full(out_shape(a), float("nan"), dtype=a["q"].dtype, device=a["q"].device)
        else:
            a["out"].fill_(float("nan"))
        return fn(*bound.args, **bound.kwargs)
    return call


@functools.cache
def prefill_outputs_under_initcheck(device: str) -> tuple[str, ...]:
    """Under compute-sanitizer initcheck only: FlashMLA's output buffers are filled with NaN before each call.

    FlashMLA's SM90 kernels store their outputs through the TMA unit, which initcheck does not see: every later
    read of an output (vLLM's copy into its own buffer, the oracle's) was reported as uninitialized although
    the values match the fp32 reference. A fill is a write initcheck sees; an element the
    kernel then leaves unwritten stays NaN, which the oracle reports natively (class H/I). Whether vLLM passes
    `out` or FlashMLA allocates it, the call FlashMLA gets is otherwise vLLM's."""
    if device != "cuda" or os.environ.get("ATTNFUZZ_SANITIZER") != "initcheck" or not _has_flashmla_kernels():
        return ()
    mod = importlib.import_module(BACKEND_MODULE)

    done = []
    if hasattr(mod, "flash_mla_sparse_fwd") and "out" in inspect.signature(mod.flash_mla_sparse_fwd).parameters:
        mod.flash_mla_sparse_fwd = prefilled_out(mod.flash_mla_sparse_fwd, lambda a: (*a["q"].shape[:2], a["d_v"]))
        done.append("flash_mla_sparse_fwd")
    if hasattr(mod, "flash_mla_with_kvcache") and "out" in inspect.signature(mod.flash_mla_with_kvcache).parameters:
        mod.flash_mla_with_kvcache = prefilled_out(mod.flash_mla_with_kvcache, lambda a: (*a["q"].shape[:3], a["head_dim_v"]))
        done.append("flash_mla_with_kvcache")
    return tuple(f"initcheck: {name}'s out filled with NaN before the call (FlashMLA writes it through TMA, "
                 f"which initcheck does not see)" for name in done)


@functools.cache
def flashmla_cpu_shims() -> tuple[str, ...]:
    """The FlashMLA backend module's CPU-only stand-ins (vllm_setup.cpu_shims has vLLM's own): its SM count, device
    index, stream and pinned allocation, which change no computation."""
    mod = importlib.import_module(BACKEND_MODULE)
    if hasattr(mod, "PIN_MEMORY"):
        mod.PIN_MEMORY = False
    mod.num_compute_units = lambda device_id=0: 132  # CPU platform raises NotImplementedError; SM90's count
    mod.current_stream = lambda: NoStream()
    _zeros = torch.zeros
    accelerator = SimpleNamespace(**{**vars(torch.accelerator), "current_device_index": lambda: 0})
    mod.torch = SimpleNamespace(**{**vars(torch), "zeros": lambda *a, pin_memory=False, **k: _zeros(*a, **k),
                                   "accelerator": accelerator})  # 0.34's impl asks for its SM count by device index
    return ("flashmla_sparse.num_compute_units=132 (CPU platform raises)",
            "flashmla_sparse: torch.zeros(pin_memory=True) unpinned (fp8 separate path)",
            "flashmla_sparse: torch.accelerator.current_device_index() -> 0 (a CPU build of torch raises)")


@functools.cache
def install_layer_standins(device: str) -> tuple[str, ...]:
    """The dense-MHA path's compiled ops, where this host lacks them."""

    mla, bound = importlib.import_module(MLA_MODULE), []
    standins = {"gather_and_maybe_dequant_cache": cache_ops.gather_and_maybe_dequant_cache,
                "cp_gather_cache": cache_ops.cp_gather_cache,  # DCP's context gather on a bf16 cache (0.34)
                "cp_gather_and_upconvert_fp8_kv_cache": flashmla_ops.cp_gather_and_upconvert_fp8_kv_cache}
    missing = {name: op for name, op in standins.items() if device == "cpu" or not has_cache_op(name)}
    if missing:  # mla_attention binds vLLM's _custom_ops as `ops`: rebind it to a copy carrying the stand-ins
        mla.ops = SimpleNamespace(**{**vars(mla.ops), **missing})
        bound += list(missing)
    if device != "cpu" and not has_op("_C", "merge_attn_states"):
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

        fa_utils = importlib.import_module("vllm.v1.attention.backends.fa_utils")
        # A GPU host without FA's compiled extensions (the GPU bundle: an import stand-in that raises) lacks it too.
        lacks_kernel = device == "cpu" or not has_compiled_flash_attn()
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


@functools.cache  # asked per case (FLASH_ATTN's targets refuse graph capture without it): one look on disk
def has_compiled_flash_attn() -> bool:
    """Whether vllm_flash_attn's compiled FA2 or FA3 extension is installed (not merely its Python package), seen
    on disk: the campaign's parent process asks before it imports vLLM."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(any((Path(d) / "vllm_flash_attn").glob(f"{ext}*.so")) for d in spec.submodule_search_locations
               for ext in ("_vllm_fa2_C", "_vllm_fa3_C"))


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
    chosen = "prefill_backend_cls" in params and try_import(CPU_SDPA_PREFILL_MODULE) is not None
    return SimpleNamespace(
        prefill_backend="CPU_SDPA_MLA" if chosen else "FLASH_ATTN",  # FLASH_ATTN: the layer's own pick on a CPU
        pass_prefill_backend=chosen,
        topk_buffer_arg="topk_indices_buffer" in params,
        dense_mha=dense_mha,
        routes=("decode -> forward_mqa; short prefill (seq_len <= top-k) -> dense-MHA forward_mha "
                "(+ chunked context)" if dense_mha else
                "every token -> forward_mqa (this release has no dense-MHA route for sparse MLA)"))


MLA_MODULE = "vllm.model_executor.layers.attention.mla_attention"


def mla_layer(cfg, heads: int, kv_b_weight: torch.Tensor, topk_indices_buffer: torch.Tensor, device: str,
              backend=None):
    """A fresh MLAAttention on `backend` (default FLASHMLA_SPARSE's class), built as this release takes it (`layer_api`): with vLLM's
    CPU_SDPA_MLA prefill backend where the release takes one (FlashAttention is not on every host), kv_b_proj
    holding `kv_b_weight`; it registers itself as the forward context's LAYER, which the metadata builder reads.
    Call inside `set_current_vllm_config(cfg)`."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.linear import ColumnParallelLinear
    from vllm.utils.torch_utils import set_default_torch_dtype

    cfg.compilation_config.static_forward_context.pop(LAYER, None)
    kv_b_proj = ColumnParallelLinear(KV_LORA_RANK, heads * (QK_NOPE + V_HEAD), bias=False, params_dtype=torch.bfloat16,
                                     prefix=f"{LAYER}.kv_b_proj").to(device)
    kv_b_proj.weight.data.copy_(kv_b_weight)
    api = layer_api()  # what this release's constructor takes
    extra = {"topk_indices_buffer": topk_indices_buffer} if api.topk_buffer_arg else {
        "indexer": SimpleNamespace(topk_indices_buffer=topk_indices_buffer)}
    if api.pass_prefill_backend:
        extra["prefill_backend_cls"] = importlib.import_module(CPU_SDPA_PREFILL_MODULE).CPUSDPAMLAPrefillBackend
    # Under the device and the model's dtype, as vLLM's model loader builds its layers: their scales (`_k_scale`,
    # read by the compiled cache ops) live on the GPU there, and 0.34 takes the layer's act_dtype from the default.
    with torch.device(device), set_default_torch_dtype(torch.bfloat16):
        layer = MLAAttention(
            num_heads=heads, scale=SM_SCALE, qk_nope_head_dim=QK_NOPE, qk_rope_head_dim=ROPE_DIM, v_head_dim=V_HEAD,
            q_lora_rank=None, kv_lora_rank=KV_LORA_RANK, kv_b_proj=kv_b_proj, cache_config=cfg.cache_config, prefix=LAYER,
            attn_backend=backend or importlib.import_module(BACKEND_MODULE).FlashMLASparseBackend, use_sparse=True,
            **extra)
    after_loading(layer)
    return layer


def after_loading(layer) -> None:
    """MLAAttention.process_weights_after_loading (W_UK_T / W_UV from kv_b_proj), as the model loader calls it: with
    the activation dtype up to 0.33, without it from 0.34 (the layer keeps the dtype it was built under)."""
    takes_dtype = "act_dtype" in inspect.signature(layer.process_weights_after_loading).parameters
    layer.process_weights_after_loading(*((torch.bfloat16,) if takes_dtype else ()))


def _weakly(method):
    """A callable returning `method`: a bound method held without its object (a plain function or None as it is)."""
    return weakref.WeakMethod(method) if inspect.ismethod(method) else (lambda: method)


def record_routes(impl, route: dict) -> None:
    """Count the tokens vLLM hands each route (instance attributes shadow the impl's methods). The counters hold
    the impl's own methods weakly: the impl holds the counters, and a bound method would make it a reference cycle."""
    forward_mqa, forward_mha = _weakly(impl.forward_mqa), _weakly(getattr(impl, "forward_mha", None))  # 0.23: no MHA

    def mqa(q, *args, **kwargs):
        route["mqa_tokens"] = route.get("mqa_tokens", 0) + (q[0] if isinstance(q, tuple) else q).shape[0]
        return forward_mqa()(q, *args, **kwargs)

    def mha(q, *args, **kwargs):
        route["mha_tokens"] = route.get("mha_tokens", 0) + q.shape[0]
        return forward_mha()(q, *args, **kwargs)

    impl.forward_mqa = mqa
    if forward_mha() is not None:
        impl.forward_mha = mha


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


