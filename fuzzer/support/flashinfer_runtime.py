"""Setting vLLM's FLASHINFER_MLA_SPARSE_SM90 backend up without a model, for its target and its reproducers (whose
attnfuzz_support.py carries this file): the backend class, the KV-cache spec vLLM's layer gives its builder, and
the engine's objects in the order vLLM makes them (the impl with the layer, then the builder, which looks the
layer up in the forward context and takes its impl's top-k buffer). torch and vLLM only (plus attnfuzz's stand-ins).

The builder's `_SM90State` imports `flashinfer.mla` in its constructor. On a GPU host where real FlashInfer
imports and passes vLLM's own gate (`scripts/gpu-flashinfer.sh`, with ATTNFUZZ_FLASHINFER=real) that import gets
FlashInfer itself; everywhere else (and with ATTNFUZZ_STANDIN_OPS=1) it gets attnfuzz's stand-in of FlashInfer
0.7.2.post1's BatchMLAPagedAttentionWrapper (`fuzzer.support.standins.flashinfer_mla`), for that import only, and
every result names the stand-in. vLLM itself would not pick this backend without FlashInfer
(`has_flashinfer_sm90_nope_mla()` is False there).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from types import SimpleNamespace

import torch

from fuzzer.support.flashmla_runtime import install_layer_standins, mla_layer, record_routes
from fuzzer.support.vllm_setup import HEAD_SIZE, KV_LORA_RANK, LAYER, QK_NOPE, ROPE_DIM, SM_SCALE, impl_topk_kwargs
from fuzzer.support.sparse_mla_steps import metadata_builder, prepare_cpu, prepare_cpu_plumbing
from fuzzer.support.standins import flashinfer_mla
from fuzzer.support.vllm_calls import named_keywords

BACKEND_MODULE = "vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90"
NAME = "FLASHINFER_MLA_SPARSE_SM90"
EMULATED = ("BatchMLAPagedAttentionWrapper (flashinfer.mla: FlashInfer 0.7.2.post1's fa3 planner and SM90 kernel)",)


@functools.cache
def real_flashinfer(device: str) -> str | None:
    """FlashInfer's version where its own BatchMLAPagedAttentionWrapper runs: a GPU host on which `flashinfer.mla`
    imports and vLLM's gate for this backend passes, unless ATTNFUZZ_STANDIN_OPS=1 asks for the stand-ins. None:
    the stand-in runs."""
    if device != "cuda" or os.environ.get("ATTNFUZZ_STANDIN_OPS") == "1":
        return None
    try:
        import flashinfer
        from flashinfer.mla import BatchMLAPagedAttentionWrapper  # noqa: F401
    except Exception:  # absent, or a broken install: the stand-in, named as such
        return None
    return getattr(flashinfer, "__version__", "?") if vllm_gate() else None


@functools.cache
def backend(device: str = "cuda"):
    """(vLLM's FlashInferMLASparseSM90Backend, the stand-ins it runs with here: FlashInfer's wrapper unless the host
    has FlashInfer itself)."""
    return importlib.import_module(BACKEND_MODULE).FlashInferMLASparseSM90Backend, \
        (() if real_flashinfer(device) else EMULATED)


def flashinfer_part(device: str) -> str:
    """How results name FlashInfer's wrapper where it is real."""
    return f"FlashInfer {real_flashinfer(device)}'s BatchMLAPagedAttentionWrapper (fa3 planner, SM90 kernel, JIT-built)"


@functools.cache
def cpu_shims() -> tuple[str, ...]:
    """CPU-only: `_SM90State.plan` asks torch.cuda whether a graph capture is in progress, which a CPU build of torch
    cannot answer (a dummy class raises); with no CUDA there is none. Changes no computation."""
    mod = importlib.import_module(BACKEND_MODULE)
    mod.torch = SimpleNamespace(**{**vars(torch), "cuda": SimpleNamespace(
        **{**vars(torch.cuda), "is_current_stream_capturing": lambda: False})})
    return ("flashinfer_mla_sparse_sm90: torch.cuda.is_current_stream_capturing() -> False (a CPU build of torch "
            "cannot answer; nothing captures on a CPU)",)


def vllm_gate() -> bool:
    """vLLM's own test for this backend's FlashInfer (>= 0.6.18, `ckv_scale_arr` in `run`), as this host answers it
    without the stand-in: what `supports_combination` reports."""
    from vllm.utils.flashinfer import has_flashinfer_sm90_nope_mla

    return has_flashinfer_sm90_nope_mla()


def prepare_sm90_host(device: str):
    """(vLLM's FLASHINFER_MLA_SPARSE_SM90 backend class, the ops attnfuzz's stand-ins replace, the shims), as
    sparse_mla_steps.prepare_host for FlashMLA's; on a CPU no graph capture either. (FlashMLA's kernels, which its
    targets prefill under initcheck, are not on this backend's path; nor are float Triton kernels: the interpreter
    goes uncorrected.)"""
    shims = prepare_cpu_plumbing(device) + (list(cpu_shims()) if device == "cpu" else [])
    backend_cls, emulated = backend(device)
    return backend_cls, emulated, shims


def prepare_sm90_layer_host(device: str):
    """prepare_sm90_host with the interpreter corrected (the dense-MHA path's float kernels), and stand-ins for the
    compiled ops of MLAAttention's dense-MHA path this host lacks (as sparse_mla_steps.prepare_layer_host for
    FlashMLA's)."""
    shims = prepare_cpu(device) + (list(cpu_shims()) if device == "cpu" else [])
    backend_cls, emulated = backend(device)
    return backend_cls, tuple(dict.fromkeys((*emulated, *install_layer_standins(device)))), shims


def kv_cache_spec(cfg, kv_cache_dtype: str, block_size: int):
    """MLAAttention.get_kv_cache_spec's spec for this cache: a per-tensor fp8 cache is uint8 (the builder plans its
    FlashInfer kernel for e4m3 from that), a bf16 one bf16."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode

    return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=HEAD_SIZE,
                            dtype=kv_cache_dtype_str_to_dtype(kv_cache_dtype, cfg.model_config),
                            cache_dtype_str=kv_cache_dtype, kv_quant_mode=get_kv_quant_mode(kv_cache_dtype))


def engine(backend_cls, cfg, spec, heads: int, kv_cache_dtype: str, topk_indices_buffer: torch.Tensor, k_scale: float,
           device: str):
    """(impl, layer, builder) as vLLM's model runner holds them. The layer registered under LAYER in the forward
    context is what the builder reads of MLAAttention: its impl (which must be this backend's), its prefill backend
    (None: every token takes forward_mqa), MLAAttention's own `_use_sparse_mha` (the builder plans the decode prefix
    alone where it says prefills leave for dense MHA), and the kv-cache scale forward_mqa passes FlashInfer (`_k_scale`,
    `_k_scale_float`: 1.0 unless the checkpoint has one)."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(cfg), torch.inference_mode():
        return _engine(backend_cls, cfg, spec, heads, kv_cache_dtype, topk_indices_buffer, k_scale, device)


def _engine(backend_cls, cfg, spec, heads, kv_cache_dtype, topk_indices_buffer, k_scale, device):
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    impl_cls = backend_cls.get_impl_cls()
    # topk_indices_buffer= with indexer=None: the index group orders on the compute stream.
    impl = impl_cls(heads, HEAD_SIZE, SM_SCALE, 1, None, None, kv_cache_dtype, None, "decoder", None,
                    **named_keywords(impl_cls, impl_cls.__name__, **impl_topk_kwargs(impl_cls, topk_indices_buffer),
                                     q_lora_rank=None, kv_lora_rank=KV_LORA_RANK, qk_nope_head_dim=QK_NOPE,
                                     qk_rope_head_dim=ROPE_DIM, qk_head_dim=QK_NOPE + ROPE_DIM, v_head_dim=128,
                                     kv_b_proj=None))
    layer = SimpleNamespace(impl=impl, prefill_backend=None, hisparse_cache=None,
                            _k_scale=torch.tensor(k_scale, dtype=torch.float32, device=device), _k_scale_float=k_scale)
    layer._use_sparse_mha = functools.partial(MLAAttention._use_sparse_mha, layer)
    cfg.compilation_config.static_forward_context[LAYER] = layer
    # _SM90State imports flashinfer.mla here: FlashInfer's own where the host has it, else the stand-in
    with contextlib.nullcontext() if real_flashinfer(device) else flashinfer_mla.importable():
        builder = backend_cls.get_builder_cls()(spec, [LAYER], cfg, torch.device(device))
    return impl, layer, builder


def layer_engine(backend_cls, cfg, spec, heads: int, kv_b_weight: torch.Tensor, topk_indices_buffer: torch.Tensor,
                 k_scale: float, device: str):
    """(builder, MLAAttention layer on this backend, its route counts) as the runner keeps them: vLLM's own layer
    (sparse_mla_steps.mla_attention_engine's, with its prefill backend, so short prefills leave for dense MHA and
    the builder plans the decode prefix alone), its kv-cache scale set as a checkpoint's would be (1.0 unless it
    has one), and the builder made while `flashinfer.mla` imports (FlashInfer's own where the host has it, else
    the stand-in)."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(cfg), torch.inference_mode():
        layer = mla_layer(cfg, heads, kv_b_weight, topk_indices_buffer, device, backend=backend_cls)
        # What the checkpoint's kv-cache scale sets after loading: forward_mqa passes `_k_scale_float` to FlashInfer,
        # the dense-MHA context gather dequantizes with `_k_scale`.
        layer._k_scale.fill_(k_scale)
        layer._k_scale_cpu.fill_(k_scale)
        layer._k_scale_float = k_scale
        with contextlib.nullcontext() if real_flashinfer(device) else flashinfer_mla.importable():
            builder = metadata_builder(backend_cls, spec, cfg, device)
    route: dict = {}
    record_routes(layer.impl, route)
    return builder, layer, route
