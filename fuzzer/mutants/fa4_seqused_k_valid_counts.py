"""FA3's call form carried over to FA4's (class B) at FLASH_ATTN_MLA_SPARSE_FA4's own call site
(`FlashAttnMLASparseFA4Impl._forward_mqa_kernel`): FLASH_ATTN_MLA_SPARSE hands FA3 each token's valid count as
`seqused_k` (FA3 reads that many page-table entries), and here the FA4 call does the same. FA4's gather form reads
`seqused_k` as the bound on an entry's VALUE (an entry counts iff 0 <= idx < seqused_k: the flat cache rows, which
vLLM passes), so every selected key whose cache row is at or past the row's valid count is masked: decode tokens
attend to a few low cache rows, or to none (out 0). The call's parent, reached through `super()`, is named outright
so that the method can be rebuilt outside its class (no change of behaviour)."""

from fuzzer.mutants._kernel_patch import patch_method

BUG_CLASS = "B"
TARGETS = ("vllm.flashattn_sparse_fa4",)


def apply():
    patch_method("vllm.v1.attention.backends.mla.flashattn_mla_sparse", "FlashAttnMLASparseFA4Impl",
                 "_forward_mqa_kernel",
                 [("super()._forward_mqa_kernel(", "FlashInferMLASparseImpl._forward_mqa_kernel(self, "),
                  ("seqused_k=seqused_k[:num_tokens]", "seqused_k=valid_counts")],
                 "fa4-seqused-k-valid-counts")
