"""The ROCm V4.1 decode maps top-k ids with the block size in tokens (class N): DeepSeek-V4.1's ROCm
`_decode_topk_ragged` (ROCM_FLASHMLA_SPARSE_DSV41) hands `compute_global_topk_ragged_indices_and_indptr` the
compressed cache's block size in tokens, attn_metadata.block_size, instead of in compressed entries,
block_size // compress_ratio. Ratio 1 is unaffected (the two agree); a C2A decode whose indexer picks an entry past
its first compressed block reads the wrong block's slots (or one past its block table). Found by the output or
memory checks; needs a ratio-2 decode with more compressed entries than a block holds."""

from fuzzer.mutants._kernel_patch import patch_method

BUG_CLASS = "N"
TARGETS = ("vllm.dsv41.rocm",)


def apply():
    patch_method("vllm.models.deepseek_v41.amd.rocm", "DeepseekV41ROCMAiterMLAAttention", "_decode_topk_ragged",
                 [("attn_metadata.block_size // self.compress_ratio", "attn_metadata.block_size")],
                 "dsv41-rocm-decode-topk-block-in-tokens")
