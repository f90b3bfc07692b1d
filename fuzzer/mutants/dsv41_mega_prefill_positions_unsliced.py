"""The mega layer's prefill roped at the step's first positions (class N): DeepSeek-V4.1's
`DeepseekV4MegaAttnAttention.forward_mqa` hands its prefill route the whole step's positions instead of those past
the decode tokens, so each prefill token's query (which the mega kernel ropes itself) and its output's inverse RoPE
take the position of a token num_decode_tokens rows earlier. Found by the output check; needs a step with decode
tokens before a prefill whose positions differ from theirs."""

from fuzzer.mutants._kernel_patch import patch_method

BUG_CLASS = "N"
TARGETS = ("vllm.dsv41.flashmla_mega",)


def apply():
    patch_method("vllm.models.deepseek_v41.nvidia.flash_mla_mega_attn", "DeepseekV4MegaAttnAttention", "forward_mqa",
                 [("positions_int32[num_decode_tokens:],", "positions_int32,")],  # the prefill call's argument
                 "dsv41-mega-prefill-positions-unsliced")
