"""Flattened decode lengths one short (class D): where SM90's paged logits cannot take a request's next_n query rows
(next_n 3), the builder's PrepareUniformDecodeKernel flattens each decode into one-row requests of lengths
L - next_n + j + 1; this kernel drops the + 1."""

from fuzzer.mutants._kernel_patch import patch_kernel_class

BUG_CLASS = "D"
TARGETS = ("vllm.indexer",)


def apply():
    patch_kernel_class("vllm.v1.attention.backends.mla.indexer", "PrepareUniformDecodeKernel",
                       [("seq_len - max_decode_len + local_idx + 1", "seq_len - max_decode_len + local_idx")],
                       "indexer-flattened-seq-lens-off-by-one")
