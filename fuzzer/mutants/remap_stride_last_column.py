"""Packed stride for the last block-table column (class C; vLLM #47783 and #54465's family, sparse-MLA slots
computed with the logical block size where other layers' pages sit between a layer's blocks): in the index
remap's prefill-workspace specialization (the call FlashMLA's fp8 separate path makes for a batch with
prefills, which passes BLOCK_STRIDE_ROWS for blocks of more than 64 tokens), a decode row's index whose block
is in the last column of its block-table row gets `block * BLOCK_SIZE` instead of `block * BLOCK_STRIDE_ROWS`,
so it reads another layer's page. Needs all of: BLOCK_STRIDE_ROWS above the block size (block_stride_rows);
prefill-workspace mode (call.prefill_workspace, a case with a prefill); a decode request whose table row has no
spare column (its last column holds a real block; a spare column holds the null block 0, whose slot is the same
either way); and a selected index of that decode row in that last block."""

from fuzzer.mutants._kernel_patch import patch_remap_kernel

BUG_CLASS = "C"
TARGETS = ("vllm.index_remap",)


def apply():
    patch_remap_kernel([("    if HAS_PREFILL:\n        workspace_start = ",
                         "    if HAS_PREFILL:\n"
                         "        out_val = tl.where(block_id == max_num_blocks_per_req - 1, base * BLOCK_SIZE + inblock_off, "
                         "out_val)\n"
                         "        workspace_start = ")],
                       "remap-stride-last-column")
