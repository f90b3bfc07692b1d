"""Fully masked softmax tile (class I; vLLM issue 48364): the Triton sparse-MLA kernel masks invalid
entries with -inf and starts its running max at -inf, so a row whose first 16-entry tile is all -1
computes exp2(-inf - (-inf)) = NaN and the NaN survives every later tile. It breaks XPU_MLA_SPARSE alone: beside
the other backends (`vllm.sparse_mla.all`) it is the one out of line."""

from fuzzer.mutants._kernel_patch import patch_kernel

BUG_CLASS = "I"
TARGETS = ("vllm.triton_sparse", "vllm.sparse_mla.all")


def apply():
    patch_kernel("vllm.v1.attention.ops.xpu_mla_sparse", "_bf16_mla_sparse_kernel",
                 [("qk, -1e+30)", "qk, -float('inf'))"), ("dtype=tl.float32) - 1e+30", "dtype=tl.float32) - float('inf')")],
                 "softmax-masked-tile-nan")
