"""Compaction gap on the multi-tile path (class B; vLLM 0.26.0's topk_length family, a valid entry after a -1
lost on one path, docs/bug-reports/vllm-0.26.0-flashmla-sparse-topk-length-in-place.md): in the COMPACT_TO_FRONT
multi-tile branch of the index remap, each valid lane's destination is the tile's atomic base plus its lane
position instead of the exclusive prefix sum of the tile's valid lanes. A tile whose valid entries come first
is unaffected; a tile with a -1 before a valid entry scatters its entries past the row's valid count, over the
next tile's, or past the row. Needs all of: valid counts (compaction) on; a top-k width the remap tiles
(`_remap_tiling`: with counting, only widths above 4096 that are not a power of two, e.g. 4224); and a -1
before a valid entry inside one 128-wide tile (invalid_at head / scattered / leading_tiles, 0 < valid < width,
or a DCP rank's filtered-out entries). The single-tile path (every width up to 4096) is untouched."""

from fuzzer.mutants._kernel_patch import patch_remap_kernel

BUG_CLASS = "B"
TARGETS = ("vllm.index_remap", "vllm.dcp_filter")


def apply():
    patch_remap_kernel([("base = tl.atomic_add(valid_count_ptr + token_id, tile_valid_count)",
                         "base = tl.atomic_add(valid_count_ptr + token_id, tile_valid_count)\n"
                         "            local_offset = tl.arange(0, BLOCK_N)")],
                       "remap-compact-gap-multitile")
