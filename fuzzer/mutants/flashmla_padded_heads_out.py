"""Head padding (class J; vLLM issue 36616's family): FlashMLA's bf16 kernel needs a multiple of 64 heads,
so vLLM pads q; the mutant returns the kernel's output for the padded head count instead of slicing it back
to the heads this rank owns, so callers get (and index into) heads that do not exist."""

from fuzzer.mutants._kernel_patch import patch_method

BUG_CLASS = "J"
TARGETS = ("vllm.flashmla_sparse",)


def apply():
    patch_method("vllm.v1.attention.backends.mla.flashmla_sparse", "FlashMLASparseImpl", "_bf16_flash_mla_kernel",
                 [("output = output[:, :actual_num_heads, :]", "output = output")], "flashmla-padded-heads-out")
