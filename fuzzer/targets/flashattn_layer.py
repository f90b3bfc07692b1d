"""`vllm.flashattn_sparse.layer`: vLLM's MLAAttention layer on FLASH_ATTN_MLA_SPARSE, whole.

The layer target's split (`vllm.flashmla_sparse.layer`: decode tokens through W_UK absorption to forward_mqa,
short prefills to dense MHA with chunked context) on FlashAttention's sparse backend: its builder's
head-count-dependent reorder threshold (16/32 heads: queries of up to 128 tokens count as decodes; otherwise 256)
decides which requests leave for dense MHA, and `SparseMLACommonImpl.forward_mqa` converts the MQA tokens' top-k
with `req_id_per_token[:num_tokens]`, the call site the seed bug's fix names ("exactly as the FlashInfer and
FlashAttn sparse backends already do"). bf16 caches only (the backend refuses fp8). FA3's paged kernel is
attnfuzz's stand-in where vllm_flash_attn's extension is not installed (every CPU, the GPU bundle), named in every
result.
"""

from __future__ import annotations

from fuzzer.targets.flashattn_sparse import FlashAttnMLASparse
from fuzzer.targets.flashmla_layer import FlashMLASparseLayer


class FlashAttnMLASparseLayer(FlashMLASparseLayer):
    name = "vllm.flashattn_sparse.layer"
    summary = "MLAAttention on FLASH_ATTN_MLA_SPARSE: decode -> forward_mqa (FA3), short prefill -> dense MHA + chunked context"
    bug_classes = "A B C F H I J K"
    real_parts = ("MLAAttention.forward_impl (the decode/MHA split, W_UK/W_UV)", "FlashAttnMLASparseMetadataBuilder",
                  "FlashAttnMLASparseImpl.forward_mqa / forward_mha", "chunked-context metadata",
                  "CPU_SDPA_MLA prefill backend", "SparseMLAIndexGroup", "the index-remap Triton kernel",
                  "merge_attn_states")
    kv_cache_dtypes = ("bfloat16",)
    vllm_backend = "FLASH_ATTN_MLA_SPARSE"
    real_parts_here = FlashAttnMLASparse.real_parts_here
