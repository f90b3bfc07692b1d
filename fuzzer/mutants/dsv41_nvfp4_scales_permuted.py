"""V3.2's NVFP4 scale order read from V4.1's NVFP4 record (class N, as its sibling dsv41-mxfp8-scales-not-interleaved: the DeepSeek-V4 oracle names a misread record N): vLLM's Triton gather of the 288-byte compressed
record (`_dequantize_and_gather_k_nvfp4_kernel`, the mega layer's prefill under nvfp4_ds_mla) reads block s's scale at
byte 8 * (s & 3) + (s >> 2), the permuted order of DeepSeek-V3.2's 352-byte nvfp4_ds_mla entry, where V4.1's record
keeps its 32 scales in natural order. Found by the output check; needs a prefill over a compressed NVFP4 cache."""

from fuzzer.mutants._kernel_patch import patch_kernel

BUG_CLASS = "N"
TARGETS = ("vllm.dsv41.flashmla_mega",)


def apply():
    patch_kernel("vllm.models.deepseek_v41.common.ops.cache_utils", "_dequantize_and_gather_k_nvfp4_kernel", [(
        "sf = tl.load(token_ptr + packed_bytes + tl.arange(0, scale_dim))",
        "sf = tl.load(token_ptr + packed_bytes + 8 * (tl.arange(0, scale_dim) % 4) + tl.arange(0, scale_dim) // 4)")],
        "dsv41-nvfp4-scales-permuted")
