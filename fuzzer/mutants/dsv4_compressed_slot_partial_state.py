"""Compressed-state slot mapping wrong for a partly filled state (class N): DeepSeek-V4's compressed slot mapping
kernel also maps a sequence's last token to its compressed entry's slot when that entry's state is only partly
filled (seq_len % compress_ratio != 0), so the compressor would write an incomplete compressed entry into the
compressed K cache. Found by the exact check of the compressed slot mapping; needs a C4 or C128 step whose last
token ends a partly filled state."""

from fuzzer.mutants._kernel_patch import patch_kernel_class

BUG_CLASS = "N"
TARGETS = ("vllm.dsv4.flashmla",)


def apply():
    patch_kernel_class("vllm.v1.attention.backends.mla.compressor_utils", "CompressedSlotMappingKernel", [(
        "is_valid = ((pos + 1) % COMPRESS_RATIO == 0) & (slot != PAD_ID)",
        "is_valid = (((pos + 1) % COMPRESS_RATIO == 0) | (pos == seq_len - 1)) & (slot != PAD_ID)")],
        "dsv4-compressed-slot-partial-state")
