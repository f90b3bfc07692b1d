"""Fully masked softmax tile (class I; vLLM issue 48364): the Triton sparse-MLA kernel masks invalid
entries with -inf and starts its running max at -inf, so a row whose first 16-entry tile is all -1
computes exp2(-inf - (-inf)) = NaN and the NaN survives every later tile."""

from fuzzer.mutants._kernel_patch import patch_kernel

BUG_CLASS = "I"
TARGETS = ("vllm.triton_sparse",)


def apply():
    patch_kernel("vllm.v1.attention.ops.xpu_mla_sparse", "_bf16_mla_sparse_kernel",
                 [("qk, -1e+30)", "qk, -float('inf'))"), ("dtype=tl.float32) - 1e+30", "dtype=tl.float32) - float('inf')")],
                 "softmax-masked-tile-nan")
