"""vLLM's pure-Triton sparse-MLA backend (XPU_MLA_SPARSE) driven for one step as the model runner drives it, without a
model: the calls `vllm.triton_sparse` makes, written once for its run() and the reproducers that show them.
torch and vLLM only."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import torch

from fuzzer.support.builder_config import model_namespace
from fuzzer.support.cpu_host import prepare_cpu_host_for
from fuzzer.support.interp.corrections import correct_floats, correct_index_scalar
from fuzzer.support.vllm_calls import named_keywords, returned

BACKEND_MODULE = "vllm.v1.attention.backends.mla.xpu_mla_sparse"
KV_LORA_RANK, HEAD_SIZE = 512, 576  # DeepSeek-V3.2's MLA: the latent, then 64 RoPE dims, a cached token's row
LAYER = "attnfuzz.layer"


def prepare_triton_host() -> list[str]:
    """A CPU host for the backend's Triton kernels: the interpreter's float corrections (bf16 dot, casts, fp8 codes)
    and scalar indices, no pinned memory; what was installed, in words. Its kernels hold no inline asm (NVFP4's
    writers do: that correction is not theirs)."""
    return prepare_cpu_host_for(correct_floats, correct_index_scalar)


def backend_config(heads: int, topk_width: int, kv_cache_dtype: str, block_size: int, max_num_batched_tokens: int):
    """(config, KV-cache spec) as the backend's metadata builder reads them: a namespace holding the fields it reads,
    as vLLM's unit tests build it (`model_namespace`: DeepSeek-V3.2's MLA dims, the step's heads, top-k width, cache
    dtype and block size), and the layer's bf16 MLA spec."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    step = SimpleNamespace(heads=heads, topk_width=topk_width, kv_cache_dtype=kv_cache_dtype, block_size=block_size)
    spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.bfloat16)
    return model_namespace(step, max_num_batched_tokens=max_num_batched_tokens), spec


def paged_cache_view(rows: torch.Tensor, num_blocks: int, block_size: int, block_stride_rows: int):
    """The paged KV cache [num_blocks, block_size, width] over its saved rows, blocks `block_stride_rows` rows apart
    (other layers' pages between them), as the runner binds it; and a copy to compare with after the call."""
    width = rows.shape[-1]
    cache = rows.as_strided((num_blocks, block_size, width), (block_stride_rows * width, width, 1))
    return cache, cache.clone()


def sparse_attention(cfg, spec, common, heads: int, sm_scale: float, topk_indices_buffer: torch.Tensor,
                     q: torch.Tensor, kv_cache: torch.Tensor, device: str):
    """The layer's step on the backend: its metadata builder (XPUMLASparseMetadataBuilder) on the step's
    CommonAttentionMetadata, its impl (XPUMLASparseImpl) reading the indexer's top-k buffer, and impl.forward_mqa over
    every token (this backend routes prefills through MQA too) on q = (ql_nope | q_pe), split as the layer hands it
    over. Returns (out, lse)."""
    backend = importlib.import_module(BACKEND_MODULE).XPUMLASparseBackend
    metadata = backend.get_builder_cls()(spec, [LAYER], cfg, torch.device(device)).build(0, common)
    # The buffer through an indexer, as the model passes it (0.23's impl accepts nothing else).
    impl_cls = backend.get_impl_cls()
    impl = impl_cls(heads, HEAD_SIZE, sm_scale, 1, None, None, "auto", None, "decoder", None,
                    **named_keywords(impl_cls, impl_cls.__name__,
                                     indexer=SimpleNamespace(topk_indices_buffer=topk_indices_buffer),
                                     kv_lora_rank=KV_LORA_RANK))
    return returned(impl.forward_mqa((q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:]), kv_cache, metadata, None), 2,
                    f"{type(impl).__name__}.forward_mqa")
