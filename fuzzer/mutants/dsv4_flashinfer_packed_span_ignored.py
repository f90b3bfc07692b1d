"""The packed KV layout read as if unpacked (class N), vLLM issue 47783 put back: DeepSeek-V4's FlashInfer layer
(FLASHINFER_MLA_SPARSE_DSV4) hands `build_flashinfer_mixed_sparse_indices` each pool's block span from
`_packed_block_span` (the per-block stride in rows, longer than block_size under vLLM's packed KV layout, #44577),
which remaps each slot block * block_size + offset to the storage row block * span + offset that FlashInfer's kernel
reads. Here the layer's `_build_sparse_index_metadata` passes the block size instead (the layout before the fix,
#47493), so past a pool's first block every entry of a packed cache lands on the wrong rows: in the page's other
components or another block's. Found by the memory check (GapRead) or the output; needs a packed page (page_pad > 0)
and an entry past block 0 of either pool."""

from fuzzer.mutants._kernel_patch import patch_method

BUG_CLASS = "N"
TARGETS = ("vllm.dsv4.flashinfer",)


def apply():
    patch_method("vllm.models.deepseek_v4.nvidia.flashinfer_sparse", "DeepseekV4FlashInferMLAAttention",
                 "_build_sparse_index_metadata",
                 [(("swa_block_span = _packed_block_span(swa_k_cache)", "swa_block_span = swa_metadata.block_size"),
                   ("swa_block_span = packed_block_span(swa_k_cache)", "swa_block_span = swa_metadata.block_size")),
                  (("compressed_block_span = _packed_block_span(compressed_kv_cache)",
                    "compressed_block_span = compressed_block_size"),  # 0.34 made the helper public
                   ("compressed_block_span = packed_block_span(compressed_kv_cache)",
                    "compressed_block_span = compressed_block_size"))],
                 "dsv4-flashinfer-packed-span-ignored")
