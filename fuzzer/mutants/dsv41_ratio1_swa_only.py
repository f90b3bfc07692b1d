"""V4's sliding-window test left in V4.1's layer (class N): DeepSeek-V4.1's `forward_mqa` decides a layer is
sliding-window only with V4's `compress_ratio <= 1` (V4's ratio 1 was its SWA layer) instead of V4.1's
`compress_ratio == 0` where it calls its decode route, so a V4.1 ratio-1 (C1A) layer's decode tokens attend over
their window only: the compressed cache and the indexer's top-k are never read (its prefill route decides for
itself and stays right). Found by the
output check; needs a ratio-1 step with a decode token that has a visible compressed entry."""

from fuzzer.mutants._kernel_patch import patch_method

BUG_CLASS = "N"
TARGETS = ("vllm.dsv41.flashmla",)


def apply():
    patch_method("vllm.models.deepseek_v41.nvidia.flashmla", "DeepseekV4FlashMLAAttention", "forward_mqa",
                 [("swa_only=swa_only,", "swa_only=self.compress_ratio <= 1,")],  # the decode call's argument
                 "dsv41-ratio1-swa-only")
