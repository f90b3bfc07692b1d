"""V4.1's interleaved record read with V4's page layout (class N): DeepSeek-V4.1's MXFP8 dequantizing gather looks
for a token's 16 scale bytes where V4's page keeps its scale rows, after every record's data
(block_size * 512 + i * 16), instead of right after the token's own 512 data bytes (i * 528 + 512), so it scales
each block by bytes of other records. Found by the output check; needs a prefill (the gather runs there) of a
V4.1 step with the 528-byte record (SM100's)."""

from fuzzer.mutants._kernel_patch import patch_kernel

BUG_CLASS = "N"
TARGETS = ("vllm.dsv41.flashmla",)


def unavailable(device: str) -> str | None:
    if device == "cuda":
        import torch

        if torch.cuda.get_device_capability()[0] != 10:
            return ("the 528-byte MXFP8 record is SM100's: vLLM writes it on SM100 only (`_use_v41_mxfp8_kv_record`), "
                    "so no case on this GPU reaches the gather")
    return None


def apply():
    patch_kernel("vllm.models.deepseek_v41.common.ops.cache_utils", "_dequantize_and_gather_k_mxfp8_kernel", [(
        "token_scale_ptr = token_data_ptr + head_dim",
        "token_scale_ptr = cache_block_ptr + cache_block_size * head_dim + pos_in_block * scale_dim")],
        "dsv41-mxfp8-scales-not-interleaved")
