"""Setting vLLM's ROCM_AITER_MLA_SPARSE backend (`ROCMAiterMLASparseBackend`,
vllm/v1/attention/backends/mla/rocm_aiter_mla_sparse.py) up without a model or an AMD GPU, for its target and
reproducers. torch and vLLM only (plus attnfuzz's stand-ins).

The backend's builder imports `aiter` (get_mla_metadata_info_v1 and dtypes in __init__, get_mla_metadata_v1 in build)
and its impl reaches AITER's decode through vLLM's custom op `torch.ops.vllm.rocm_aiter_mla_decode_fwd`, whose body
(`vllm._aiter_ops._rocm_aiter_mla_decode_fwd_impl`, vLLM's own) imports `aiter.mla.mla_decode_fwd`. No attnfuzz host
has AITER or an AMD GPU: the engine's builder and impl get attnfuzz's stand-in (`fuzzer.support.standins.aiter_mla`,
an emulated gfx950) for the span of their calls only, and vLLM's op is registered here with vLLM's own body, as
`rocm_aiter_ops.register_ops_once` registers it on a ROCm host with AITER (it registers nothing elsewhere).

What else a gfx950 host answers that this one cannot, each listed in every result's shims (`PLATFORM_NOTE`,
`prepare_host`): vLLM's platform is not ROCm here, so nothing of vLLM would pick the backend; `vllm.platforms.rocm`
(imported by the impl for `on_gfx942` / `on_mi3xx`) resolves the device's arch at import through amdsmi or
torch.cuda, and is imported with that answered "gfx950"; the backend module's `current_platform` answers
`num_compute_units()` with MI355X's 256 CUs and `fp8_dtype()` with gfx950's float8_e4m3fn; on a CPU its
`torch.cuda.current_stream(device).synchronize()` after planning is a no-op (CPU work is synchronous).
"""

from __future__ import annotations

import functools
import importlib
import types
from types import SimpleNamespace

import torch

from fuzzer.support.cpu_host import interpreter_corrections
from fuzzer.support.flashinfer_sparse_runtime import _has_c_op, kv_cache_spec, layer_quant_shim, mla_layer  # noqa: F401  (reproducers call them)
from fuzzer.support.vllm_setup import LAYER
from fuzzer.support.interp.corrections import correct_index_scalar
from fuzzer.support.sparse_mla_steps import metadata_builder, prepare_cpu_plumbing, sparse_mla_impl
from fuzzer.support.standins import aiter_mla, flashmla_ops

BACKEND_MODULE = "vllm.v1.attention.backends.mla.rocm_aiter_mla_sparse"
NAME = "ROCM_AITER_MLA_SPARSE"
ARCH = "gfx950:sramecc+:xnack-"
EMULATED = (f"{aiter_mla.KERNEL}, with {aiter_mla.PLANNER} and get_mla_metadata_info_v1: AITER {aiter_mla.__version__}'s "
            "Python API and checks, test_mla_sparse.py's reference semantics; the ASM kernel and the C++ planner are not "
            "public (what they leave open is named in the result: not_public)",)
PLATFORM_NOTE = ("vLLM's platform is not ROCm here, so nothing of vLLM would pick ROCM_AITER_MLA_SPARSE (gfx942/gfx950 "
                 "with AITER): the engine is built as a gfx950 (MI355X) host builds it, AITER a stand-in; "
                 "vllm.platforms.rocm imported with the device arch answered 'gfx950' (torch.cuda."
                 "get_device_properties during that import only); the backend module's current_platform answers "
                 "num_compute_units()=256 and fp8_dtype()=float8_e4m3fn (gfx950); torch.ops.vllm."
                 "rocm_aiter_mla_decode_fwd registered with vLLM's own _rocm_aiter_mla_decode_fwd_impl, as "
                 "register_ops_once does on a ROCm host with AITER")
CU_NUM = aiter_mla.CU_NUM


class _Gfx950Platform:
    """vLLM's current platform, answering what the backend module asks of a gfx950 device."""

    def __init__(self, platform):
        self._platform = platform

    def num_compute_units(self, device_id: int = 0) -> int:
        return CU_NUM

    def fp8_dtype(self) -> torch.dtype:
        return aiter_mla.FP8

    def __getattr__(self, name):
        return getattr(self._platform, name)


class _NoStream:
    def synchronize(self) -> None: ...


def _import_rocm_platform() -> None:
    """`vllm.platforms.rocm` imported as a gfx950 host imports it (its arch read once, at import)."""
    import sys

    if "vllm.platforms.rocm" in sys.modules:
        return
    saved = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda device=None: SimpleNamespace(gcnArchName=ARCH)
    try:
        importlib.import_module("vllm.platforms.rocm")
    finally:
        torch.cuda.get_device_properties = saved


@functools.cache
def backend(device: str = "cuda"):
    """(vLLM's ROCMAiterMLASparseBackend, the ops attnfuzz's stand-ins replace for it). Its module is patched once
    a process: its platform a gfx950's (`_Gfx950Platform`), on a CPU its stream sync a no-op and `ops.concat_mla_q`
    the stand-in of vLLM's compiled op; vLLM's AITER decode op registered (`_register_decode_op`)."""
    _import_rocm_platform()
    mod = importlib.import_module(BACKEND_MODULE)
    mod.current_platform = _Gfx950Platform(mod.current_platform)
    emulated = list(EMULATED)
    if device == "cpu":
        mod.torch = types.SimpleNamespace(**{**vars(torch), "cuda": SimpleNamespace(
            **{**{n: getattr(torch.cuda, n) for n in dir(torch.cuda) if not n.startswith("__")},
               "current_stream": lambda device=None: _NoStream()})})
    if device == "cpu" or not _has_c_op("concat_mla_q", device):
        mod.ops = SimpleNamespace(**{**vars(mod.ops), "concat_mla_q": flashmla_ops.concat_mla_q})
        emulated.append("concat_mla_q")
    _register_decode_op(device)
    return mod.ROCMAiterMLASparseBackend, tuple(emulated)


@functools.cache
def _register_decode_op(device: str) -> None:
    """vLLM's `rocm_aiter_mla_decode_fwd` custom op with vLLM's own body, for the device's dispatch key (what
    `rocm_aiter_ops.register_ops_once` does on a ROCm host with AITER; here it registers nothing)."""
    from vllm import _aiter_ops
    from vllm.utils.torch_utils import direct_register_custom_op

    if hasattr(torch.ops.vllm, "rocm_aiter_mla_decode_fwd"):
        return
    direct_register_custom_op(op_name="rocm_aiter_mla_decode_fwd", op_func=_aiter_ops._rocm_aiter_mla_decode_fwd_impl,
                              mutates_args=["o"], dispatch_key="CPU" if device == "cpu" else "CUDA")


# The interpreter corrections the route's Triton kernels need: they are integer ones (generate_sparse_seqlen_kernel, the
# ragged remap), which no float correction touches; the query's fp8 quantization and AITER's stand-in are torch.
CORRECTIONS = (correct_index_scalar,)


def prepare_host(device: str, corrections: tuple = CORRECTIONS):
    """(vLLM's backend class, the ops the stand-ins replace, the shims), as sparse_mla_steps.prepare_host; on a CPU,
    Triton's interpreter corrected by `corrections` (a campaign: every correction, EVERY)."""
    shims = prepare_cpu_plumbing(device)
    if device == "cpu":
        shims += interpreter_corrections(*corrections)
    backend_cls, emulated = backend(device)
    return backend_cls, emulated, [*shims, PLATFORM_NOTE]


def _call_under(obj, method: str, block) -> None:
    """obj.`method` (its class's, looked up at each call: a mutant's patch included) run inside `block()`."""
    def call(*args, **kwargs):
        with block():
            return getattr(type(obj), method)(obj, *args, **kwargs)

    setattr(obj, method, call)


def engine(backend_cls, cfg, spec, heads: int, kv_cache_dtype: str, topk_indices_buffer: torch.Tensor,
           k_scale: float, q_scale: float, device: str):
    """(impl, layer, builder) as vLLM's model runner holds them for a DeepSeek-V3.2 layer (it owns its indexer, so
    its impl remaps the top-k rows at every call: `owns_indexer`). `layer` is what forward_mqa is handed of
    MLAAttention: the checkpoint's scales (`_q_scale`, `_k_scale`: 1.0 unless it has them) and the layer's fp8 query
    quantization, which the impl applies itself to a query over an fp8 cache. The builder (made after the impl: it
    asks the layer's impl whether it has sinks) and the impl's `_forward_mla` see the AITER stand-in."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(cfg), torch.inference_mode():
        return _engine(backend_cls, cfg, spec, heads, kv_cache_dtype, topk_indices_buffer, k_scale, q_scale, device)


def _engine(backend_cls, cfg, spec, heads, kv_cache_dtype, topk_indices_buffer, k_scale, q_scale, device):
    impl = sparse_mla_impl(backend_cls, heads, kv_cache_dtype, topk_indices_buffer)
    impl.owns_indexer = True  # DeepSeek-V3.2: every layer has its indexer (MLAAttention passes it as `indexer`)
    _call_under(impl, "_forward_mla", aiter_mla.importable)
    layer = mla_layer(impl, k_scale, q_scale, device)
    cfg.compilation_config.static_forward_context[LAYER] = layer
    with aiter_mla.importable():
        builder = metadata_builder(backend_cls, spec, cfg, device)
    _call_under(builder, "build", aiter_mla.importable)
    return impl, layer, builder


def undocumented() -> list[tuple[str, list[int]]]:
    """What the stand-in's calls since the last look met that AITER's public contract does not settle; cleared."""
    found = list(aiter_mla.UNDOCUMENTED)
    aiter_mla.UNDOCUMENTED.clear()
    return found

