"""Index past the block table not becoming -1 (class C): the remap drops its block-table guard from
the validity mask, so an entry whose block lies beyond the table maps to a slot in block 0 (the null
block) instead of -1."""

from fuzzer.mutants._kernel_patch import patch_remap_kernel

BUG_CLASS = "C"
TARGETS = ("vllm.index_remap", "vllm.dcp_filter")


def apply():
    patch_remap_kernel([("is_invalid_tok |= ~valid_block", "is_invalid_tok |= valid_block & ~valid_block")],
                       "remap-past-table-not-invalid")
