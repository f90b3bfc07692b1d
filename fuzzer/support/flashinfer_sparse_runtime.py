"""Setting vLLM's FlashInfer sparse-MLA backends for Blackwell up without a model, for their targets and reproducers:
FLASHINFER_MLA_SPARSE (`FlashInferMLASparseTRTLLMBackend`, SM100, FlashInfer's trtllm-gen kernel) and
FLASHINFER_MLA_SPARSE_SM120 (`FlashInferMLASparseSM120Backend`, SM120, FlashInfer's "sparse" kernel), both in
vllm/v1/attention/backends/mla/flashinfer_mla_sparse.py (SM120's impl in flashinfer_mla_sparse_sm120.py). Each is
named by the compute capability major it runs on (10, 12). torch and vLLM only (plus attnfuzz's stand-ins).

Both impls call FlashInfer's `trtllm_batch_decode_with_kv_cache_mla`: SM100's imports it from `flashinfer.decode`
inside `_forward_mqa_kernel`, SM120's through `vllm.utils.flashinfer`'s lazy wrapper inside `_run_mqa_kernel` (which
answers "not available" where FlashInfer is not installed), and SM120's constructor asks
`has_flashinfer_sparse_mla_sm120()`. No attnfuzz host has FlashInfer with an SM100 or SM120 device, so each engine's
impl gets attnfuzz's stand-in (`fuzzer.support.standins.flashinfer_trtllm_mla`, emulating that device) for the span of
those calls only: the impl's own method runs inside a block that makes the stand-in what it looks up. Nothing else of
vLLM sees a FlashInfer it does not have (`has_flashinfer()` stays False; the layer's other choices are unchanged).

vLLM's platform check would not choose either backend on this host (`supports_compute_capability`: major == 10, == 12;
SM120's `supports_combination` also asks for FlashInfer's sparse API and `index_topk == 2048`): the engines are built
directly, as a host of that device would build them, and every result says so (`PLATFORM_NOTE`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from types import SimpleNamespace

import torch

from fuzzer.support.vllm_setup import HEAD_SIZE, LAYER
from fuzzer.support.sparse_mla_steps import metadata_builder, prepare_cpu, sparse_mla_impl
from fuzzer.support.standins import flashinfer_trtllm_mla
from fuzzer.support.vllm_calls import implemented

BACKEND_MODULE = "vllm.v1.attention.backends.mla.flashinfer_mla_sparse"
NAMES = {10: "FLASHINFER_MLA_SPARSE", 12: "FLASHINFER_MLA_SPARSE_SM120"}
CLASSES = {10: "FlashInferMLASparseTRTLLMBackend", 12: "FlashInferMLASparseSM120Backend"}
EMULATED = {
    10: (f"{flashinfer_trtllm_mla.KERNEL[10]}: FlashInfer 0.7.2.post1's Python API and checks; the kernel is a closed "
         "cubin, its sparse semantics read from its launcher headers and vLLM's call site (what they leave open is "
         "named in the result: not_public)",),
    12: (f"{flashinfer_trtllm_mla.KERNEL[12]}: FlashInfer 0.7.2.post1's Python API and checks, the semantics of its "
         "kernel source (sparse_mla_sm120/kernels/dsv32_fp8, merge.cuh)",),
}
PLATFORM_NOTE = {
    10: "vLLM's FlashInferMLASparseTRTLLMBackend.supports_compute_capability asks for major == 10 (SM100): this host "
        "has none; the engine is built as an SM100 host builds it, FlashInfer's kernel a stand-in",
    12: "vLLM's FlashInferMLASparseSM120Backend asks for major == 12 (supports_compute_capability) and FlashInfer's "
        "sparse MLA API (has_flashinfer_sparse_mla_sm120, also asked by the impl's constructor, answered True there): "
        "this host has neither; the engine is built as an SM120 host builds it, FlashInfer's kernel a stand-in",
}
# What SM120's impl reads of the model to pick FlashInfer's scale format (`_kv_scale_format_for_model`): DeepSeek's
# power-of-two tile scales, GLM's arbitrary fp32 ones.
MODEL_TYPES = {"pow2": "deepseek_v32", "arbitrary": "glm_moe_dsa"}


@functools.cache
def backend(major: int, device: str = "cuda"):
    """(vLLM's backend class for SM`major`x, the ops attnfuzz's stand-ins replace for it). Its impl's module is
    imported too (SM120's lives apart), so that what wraps vLLM's functions before a case finds it."""
    backend_cls = getattr(importlib.import_module(BACKEND_MODULE), CLASSES[major])
    backend_cls.get_impl_cls()
    return backend_cls, EMULATED[major]


def prepare_host(major: int, device: str):
    """(vLLM's backend class, the ops the stand-ins replace, the shims), as sparse_mla_steps.prepare_host."""
    shims = prepare_cpu(device)
    backend_cls, emulated = backend(major, device)
    return backend_cls, emulated, [*shims, PLATFORM_NOTE[major]]


def kv_cache_spec(backend_cls, cfg, kv_cache_dtype: str, block_size: int):
    """MLAAttention.get_kv_cache_spec's spec, customized by the backend as the runner does (blocks whole pages apart):
    a quantized cache is uint8, a bf16 one bf16."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.attention.backend import AttentionBackend
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode

    # The backend's own customize_spec: AttentionBackend's (the spec as it is) answering for it would be another call.
    return implemented(backend_cls, "customize_spec", below=AttentionBackend)(MLAAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=HEAD_SIZE,
        dtype=kv_cache_dtype_str_to_dtype(kv_cache_dtype, cfg.model_config), cache_dtype_str=kv_cache_dtype,
        kv_quant_mode=get_kv_quant_mode(kv_cache_dtype)))


@contextlib.contextmanager
def _sm120_flashinfer():
    """vllm.utils.flashinfer's answers for SM120's impl, for the block: FlashInfer's sparse API present, and its
    lazy wrapper of `trtllm_batch_decode_with_kv_cache_mla` the stand-in's SM120 entry point."""
    fi = importlib.import_module("vllm.utils.flashinfer")
    saved = fi.has_flashinfer_sparse_mla_sm120, fi.flashinfer_trtllm_batch_decode_with_kv_cache_mla
    fi.has_flashinfer_sparse_mla_sm120 = lambda: True
    fi.flashinfer_trtllm_batch_decode_with_kv_cache_mla = flashinfer_trtllm_mla.SM120
    try:
        yield
    finally:
        fi.has_flashinfer_sparse_mla_sm120, fi.flashinfer_trtllm_batch_decode_with_kv_cache_mla = saved


def _kernel_call_under(impl, method: str, block) -> None:
    """impl.`method` (its class's, looked up at each call: a mutant's patch included) run inside `block()`."""
    def call(*args, **kwargs):
        with block():
            return getattr(type(impl), method)(impl, *args, **kwargs)

    setattr(impl, method, call)


def engine(major: int, backend_cls, cfg, spec, heads: int, kv_cache_dtype: str, topk_indices_buffer: torch.Tensor,
           k_scale: float, q_scale: float, device: str, model_type: str = "deepseek_v32"):
    """(impl, layer, builder) as vLLM's model runner holds them. `layer` is what forward_mqa is handed of MLAAttention
    (registered under LAYER in the forward context, where the builder reads its prefill backend: None, every token
    takes forward_mqa): the checkpoint's scales (`_q_scale`, `_k_scale`: 1.0 unless it has them; SM100's impl folds
    them into its kernel's bmm scales) and the layer's fp8 query quantization, which MLAAttention applies before
    forward_mqa for an impl that takes a quantized query over a per-tensor fp8 cache (SM100's). SM120's impl picks
    FlashInfer's scale format from the model's `model_type` (GLM: arbitrary fp32 scales, else power-of-two)."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(cfg), torch.inference_mode():
        return _engine(major, backend_cls, cfg, spec, heads, kv_cache_dtype, topk_indices_buffer, k_scale, q_scale,
                       device, model_type)


def _engine(major, backend_cls, cfg, spec, heads, kv_cache_dtype, topk_indices_buffer, k_scale, q_scale, device,
            model_type):
    text = cfg.model_config.hf_text_config
    was, text.model_type = text.model_type, model_type
    try:
        with _sm120_flashinfer() if major == 12 else contextlib.nullcontext():
            impl = sparse_mla_impl(backend_cls, heads, kv_cache_dtype, topk_indices_buffer)
    finally:
        text.model_type = was
    if major == 12:
        _kernel_call_under(impl, "_run_mqa_kernel", _sm120_flashinfer)
    else:
        _kernel_call_under(impl, "_forward_mqa_kernel", lambda: flashinfer_trtllm_mla.importable(10))
    layer = mla_layer(impl, k_scale, q_scale, device)
    cfg.compilation_config.static_forward_context[LAYER] = layer
    builder = metadata_builder(backend_cls, spec, cfg, device)
    return impl, layer, builder


def mla_layer(impl, k_scale: float, q_scale: float, device: str) -> SimpleNamespace:
    """What forward_mqa reads of MLAAttention: its impl, its fp8 scales and its decode fp8 quantization of the
    concatenated query (the op's own native path where the host lacks the compiled op)."""
    from vllm.model_executor.layers.attention.mla_attention import _DecodeConcatQuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    quant = _DecodeConcatQuantFP8(static=True, group_shape=GroupShape.PER_TENSOR, compile_native=True)
    if not _has_c_op("static_scaled_fp8_quant", device):
        quant._forward_method = quant.forward_native
    f32 = dict(dtype=torch.float32, device=device)
    return SimpleNamespace(impl=impl, prefill_backend=None, hisparse_cache=None,
                           _k_scale=torch.tensor(k_scale, **f32), _k_scale_float=k_scale,
                           _q_scale=torch.tensor(q_scale, **f32), _q_scale_float=q_scale,
                           _decode_concat_quant_fp8_op=quant)


def _has_c_op(name: str, device: str) -> bool:
    """Whether vLLM's compiled `_C.<name>` can run on `device` here: declared with its signature (a library loaded
    beside it may declare the name alone, "() -> ()") and with a kernel for the device's dispatch key."""
    try:
        op = getattr(torch.ops._C, name).default
        return bool(op._schema.arguments) and torch._C._dispatch_has_kernel_for_dispatch_key(
            op.name(), "CUDA" if str(device).startswith("cuda") else "CPU")
    except (AttributeError, RuntimeError):
        return False


def layer_quant_shim(major: int | None, device: str) -> list[str]:
    """What the engine's layer runs in place of a compiled op this host lacks, where the impl takes a quantized query
    (SM100's, ROCm AITER's: major None; its result names it)."""
    if major not in (10, None) or _has_c_op("static_scaled_fp8_quant", device):
        return []
    return ["MLAAttention's fp8 query quantization (_DecodeConcatQuantFP8): QuantFP8.forward_native, vLLM's own "
            "torch path, for the _C.static_scaled_fp8_quant op this host lacks"]


def undocumented() -> list[tuple[str, list[int]]]:
    """What the stand-in's calls since the last look met that the kernel's public contract does not settle; cleared."""
    found = list(flashinfer_trtllm_mla.UNDOCUMENTED)
    flashinfer_trtllm_mla.UNDOCUMENTED.clear()
    return found
