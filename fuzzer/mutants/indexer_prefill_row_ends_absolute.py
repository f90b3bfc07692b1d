"""Prefill top-k given absolute row ends (class O): DeepGEMM returns each prefill row's logits compressed, starting
at column 0 with the row's first key (cu_seqlen_ks), so the top-k's end must be cu_seqlen_ke - cu_seqlen_ks; this
passes cu_seqlen_ke, and a row of a chunk's second or later request ranks columns past its own logits (the kernel
leaves them uncleaned)."""

from fuzzer.mutants._kernel_patch import patch_function

BUG_CLASS = "O"
TARGETS = ("vllm.indexer",)


def apply():
    patch_function("vllm.model_executor.layers.sparse_attn_indexer", "sparse_attn_indexer",
                   [("row_ends = cu_seqlen_ke - cu_seqlen_ks", "row_ends = cu_seqlen_ke")],
                   "indexer-prefill-row-ends-absolute")
