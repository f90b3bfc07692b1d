"""The cache's block stride handed to the index remap in elements instead of rows (class C) at
FLASHINFER_MLA_SPARSE_SM120's own call site (`FlashInferMLASparseSM120Impl.forward_mqa`): the remap turns each
request-local position into a flat cache row, block id x BLOCK_STRIDE_ROWS + offset, for the kernel's 64-row page
view of the cache. Given `kv_c_and_k_pe_cache.stride(0)` (the 656-byte entries' bytes a block apart, the slip
`flat_kv_row_view`'s assert warns of) every block but block 0 lands 656 times too far: FlashInfer's kernel reads
rows past the cache (it bounds no index from above)."""

from fuzzer.mutants._kernel_patch import patch_method

BUG_CLASS = "C"
TARGETS = ("vllm.flashinfer_sparse_sm120",)


def apply():
    patch_method("vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm120", "FlashInferMLASparseSM120Impl",
                 "forward_mqa", [("BLOCK_STRIDE_ROWS=block_stride_rows", "BLOCK_STRIDE_ROWS=kv_c_and_k_pe_cache.stride(0)")],
                 "sm120-block-stride-in-elements")
