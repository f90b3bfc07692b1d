"""Each token's ragged top-k length one short (class D) at ROCM_AITER_MLA_SPARSE's own builder: its Triton
`generate_sparse_seqlen_kernel` (vllm/v1/attention/backends/mla/rocm_aiter_mla_sparse.py), which sets how many
entries of each token's top-k row the remap converts and AITER attends to, min(position + 1, index_topk), here takes
min(position, index_topk): the window ends one position early. A token whose context reaches past the top-k width is
unchanged (its row is full either way); any shorter one drops the last valid entry of its row (the indexer fills rows
valid-first), and a sequence's first token gets no entry at all."""

from fuzzer.mutants._kernel_patch import patch_kernel

BUG_CLASS = "D"
TARGETS = ("vllm.rocm_aiter_sparse",)


def apply():
    patch_kernel("vllm.v1.attention.backends.mla.rocm_aiter_mla_sparse", "generate_sparse_seqlen_kernel",
                 [("tl.where(sparse_seqlen + 1 < topk_token, sparse_seqlen + 1, topk_token)",
                   "tl.where(sparse_seqlen < topk_token, sparse_seqlen, topk_token)")],
                 "rocm-sparse-seqlen-excludes-self")
