"""Compressed top-k length off by one in V4.1's prefill combine (class N): DeepSeek-V4.1's top-k/SWA combine kernel
counts a prefill token's valid indexer ids as pos // ratio instead of (pos + 1) // ratio, so a token that completes
a compressed state (V4.1 ratio 1: every token; ratio 2: every second one) drops its newest compressed entry from
the prefill's attention. Found by the output check; needs a ratio-1 or ratio-2 prefill."""

from fuzzer.mutants._kernel_patch import patch_kernel_class

BUG_CLASS = "N"
TARGETS = ("vllm.dsv41.flashmla",)


def apply():
    patch_kernel_class("vllm.models.deepseek_v41.common.ops.cache_utils", "CombineTopkSwaIndicesKernel", [(
        "topk_len = tl.maximum(tl.minimum((pos + 1) // COMPRESS_RATIO, TOP_K), 0)",
        "topk_len = tl.maximum(tl.minimum(pos // COMPRESS_RATIO, TOP_K), 0)")], "dsv41-combine-topk-len-off-by-one")
