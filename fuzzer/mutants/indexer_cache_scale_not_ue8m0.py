"""Index keys cached with fp32 scales (class K): DeepSeek-V3.2's indexer caches its keys with ue8m0 (power-of-two)
scales, the format DeepGEMM's readers on SM100 assume; this call site passes no scale format, so the writer stores
amax / 448 as it comes."""

from fuzzer.mutants._kernel_patch import patch_function

BUG_CLASS = "K"
TARGETS = ("vllm.indexer",)


def apply():
    patch_function("vllm.model_executor.layers.sparse_attn_indexer", "sparse_attn_indexer",
                   [("'mxfp8' if mqa_logits_use_mx_scales() else scale_fmt", "'mxfp8' if mqa_logits_use_mx_scales() else ''")],
                   "indexer-cache-scale-not-ue8m0")
