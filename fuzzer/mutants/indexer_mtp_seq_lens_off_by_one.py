"""Native MTP decode lengths one short (class D; the family of vLLM PR 34552, MTP with sparse MLA): the builder
gives decode token j of a request of length L the context L - next_n + j + 1; this drops the + 1, so every MTP
row's top-k misses its own position."""

from fuzzer.mutants._kernel_patch import patch_method

BUG_CLASS = "D"
TARGETS = ("vllm.indexer",)


def apply():
    patch_method("vllm.v1.attention.backends.mla.indexer", "DeepseekV32IndexerMetadataBuilder",
                 "_prepare_decode_tensors", [("- max_decode_len + 1 +", "- max_decode_len +")],
                 "indexer-mtp-seq-lens-off-by-one")
