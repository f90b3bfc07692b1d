"""Empty DCP shard not neutral (class G; vLLM #45426's family): a row for which this rank holds none of the
selected tokens gets LSE 0 instead of -inf, so vLLM's LSE merge weighs the rank's zero output as if it had
attended, and shrinks every other rank's contribution to that row."""

import importlib

from fuzzer.mutants._kernel_patch import patch_kernel, patch_method

BUG_CLASS = "G"
TARGETS = ("vllm.flashmla_sparse.dcp", "vllm.flashmla_sparse.layer.dcp")
SPARSE_UTILS = "vllm.v1.attention.backends.mla.sparse_utils"


def apply():
    if hasattr(importlib.import_module(SPARSE_UTILS), "_neutralize_dcp_empty_rows_kernel"):  # 0.34: a Triton kernel
        patch_kernel(SPARSE_UTILS, "_neutralize_dcp_empty_rows_kernel",
                     [("tl.full([NUM_HEADS_PADDED], float('-inf'), lse_ptr.dtype.element_ty)",
                       "tl.full([NUM_HEADS_PADDED], 0.0, lse_ptr.dtype.element_ty)")], "dcp-empty-shard-lse-zero")
        return
    patch_method("vllm.v1.attention.backends.mla.flashmla_sparse", "FlashMLASparseImpl", "_forward_fp8_kv_mixed_batch",
                 [("lse.masked_fill_(empty_rows.view(-1, 1), float('-inf'))",
                   "lse.masked_fill_(empty_rows.view(-1, 1), 0.0)")], "dcp-empty-shard-lse-zero")
