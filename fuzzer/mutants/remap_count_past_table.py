"""Wrong valid count (class B): the remap counts every non-negative top-k entry as valid, including
entries it turned into -1 because their block lies past the block table, so a kernel that reads the
first `valid_count` entries (topk_length) attends to -1 slots."""

from fuzzer.mutants._kernel_patch import patch_remap_kernel

BUG_CLASS = "B"
TARGETS = ("vllm.index_remap", "vllm.dcp_filter")


def apply():
    patch_remap_kernel([("(~is_invalid_tok).to(tl.int32)", "(tok >= 0).to(tl.int32)")], "remap-count-past-table")
