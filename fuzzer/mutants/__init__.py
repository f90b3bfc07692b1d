"""Injected bugs: each file patches vLLM the way a real bug would and names its bug class.

A mutant module is standalone (torch, triton and vLLM only) so that a reproducer can inline it; it
defines BUG_CLASS, TARGETS and `apply()`, and may define `unavailable(device)`: why no case on this host can
reach the code it breaks (None: it can). Add one: a file here, one line in MUTANTS.
`--inject` also takes any Python file; it runs after vLLM is imported and may patch anything.
"""

from __future__ import annotations

import importlib
import runpy
import traceback
from pathlib import Path
from types import ModuleType

# This package's own module is never inlined into a reproducer (`source()` inlines a mutant's file and
# _kernel_patch.py only), so it may import attnfuzz's errors; the mutant files may not.
from fuzzer.errors import MutantError  # noqa: F401 (re-exported: `from fuzzer.mutants import MutantError`)

MUTANTS: dict[str, str] = {
    "remap-no-length-check": "fuzzer.mutants.remap_no_length_check",
    "remap-no-length-check-plain": "fuzzer.mutants.remap_no_length_check_plain",
    "remap-no-length-check-valid-counts": "fuzzer.mutants.remap_no_length_check_valid_counts",
    "remap-no-length-check-compaction": "fuzzer.mutants.remap_no_length_check_compaction",
    "remap-no-length-check-prefill-workspace": "fuzzer.mutants.remap_no_length_check_prefill_workspace",
    "remap-no-length-check-idx-mapping": "fuzzer.mutants.remap_no_length_check_idx_mapping",
    "remap-no-length-check-block-stride": "fuzzer.mutants.remap_no_length_check_block_stride",
    "remap-count-past-table": "fuzzer.mutants.remap_count_past_table",
    "remap-past-table-not-invalid": "fuzzer.mutants.remap_past_table_not_invalid",
    "dcp-owner-ignores-interleave": "fuzzer.mutants.dcp_owner_ignores_interleave",
    "softmax-masked-tile-nan": "fuzzer.mutants.softmax_masked_tile_nan",
    "flashmla-padded-heads-out": "fuzzer.mutants.flashmla_padded_heads_out",
    "remap-full-batch-req-id": "fuzzer.mutants.remap_full_batch_req_id",
    "mha-context-flat-fp8-gather": "fuzzer.mutants.mha_context_flat_fp8_gather",
    "flashmla-topk-length-dropped": "fuzzer.mutants.flashmla_topk_length_dropped",
    "dcp-empty-shard-lse-zero": "fuzzer.mutants.dcp_empty_shard_lse_zero",
    "dcp-lse-base2-as-natural": "fuzzer.mutants.dcp_lse_base2_as_natural",
    "remap-compact-gap-multitile": "fuzzer.mutants.remap_compact_gap_multitile",
    "remap-stride-last-column": "fuzzer.mutants.remap_stride_last_column",
    "remap-workspace-second-prefill": "fuzzer.mutants.remap_workspace_second_prefill",
    "flashmla-mtp-padded-decode": "fuzzer.mutants.flashmla_mtp_padded_decode",
    "flashmla-fp8-uncompacted-topk-length": "fuzzer.mutants.flashmla_fp8_uncompacted_topk_length",
    "remap-full-batch-req-id-fp8-separate": "fuzzer.mutants.remap_full_batch_req_id_fp8_separate",
    "flashmla-req-id-buffer-grow-only": "fuzzer.mutants.flashmla_req_id_buffer_grow_only",
    "flashmla-graph-block-table-copied": "fuzzer.mutants.flashmla_graph_block_table_copied",
    "flashattn-draft-update-last-token": "fuzzer.mutants.flashattn_draft_update_last_token",
    "flashattn-mqa-full-batch-req-id": "fuzzer.mutants.flashattn_mqa_full_batch_req_id",
    "sm90-plan-reused-for-fewer-tokens": "fuzzer.mutants.sm90_plan_reused_for_fewer_tokens",
    "sm100-draft-update-last-token": "fuzzer.mutants.sm100_draft_update_last_token",
    "rocm-sparse-seqlen-excludes-self": "fuzzer.mutants.rocm_sparse_seqlen_excludes_self",
    "sm120-block-stride-in-elements": "fuzzer.mutants.sm120_block_stride_in_elements",
    "fa4-seqused-k-valid-counts": "fuzzer.mutants.fa4_seqused_k_valid_counts",
    "dsv4-swa-window-block-edge": "fuzzer.mutants.dsv4_swa_window_block_edge",
    "dsv4-c128a-topk-past-row": "fuzzer.mutants.dsv4_c128a_topk_past_row",
    "dsv4-compressed-slot-partial-state": "fuzzer.mutants.dsv4_compressed_slot_partial_state",
    "dsv41-ratio1-swa-only": "fuzzer.mutants.dsv41_ratio1_swa_only",
    "dsv4-flashinfer-packed-span-ignored": "fuzzer.mutants.dsv4_flashinfer_packed_span_ignored",
    "shardq-req-id-decode-offset-dropped": "fuzzer.mutants.shardq_req_id_decode_offset_dropped",
    "dsv41-flashinfer-prefill-cu-not-rebased": "fuzzer.mutants.dsv41_flashinfer_prefill_cu_not_rebased",
    "dsv41-combine-topk-len-off-by-one": "fuzzer.mutants.dsv41_combine_topk_len_off_by_one",
    "dsv41-mega-prefill-positions-unsliced": "fuzzer.mutants.dsv41_mega_prefill_positions_unsliced",
    "dsv41-nvfp4-scales-permuted": "fuzzer.mutants.dsv41_nvfp4_scales_permuted",
    "flashmla-nvfp4-fp8-upconvert": "fuzzer.mutants.flashmla_nvfp4_fp8_upconvert",
    "dsv4-rocm-inverse-rope-positions-unshifted": "fuzzer.mutants.dsv4_rocm_inverse_rope_positions_unshifted",
    "dsv41-rocm-decode-topk-block-in-tokens": "fuzzer.mutants.dsv41_rocm_decode_topk_block_in_tokens",
    "dsv41-mxfp8-scales-not-interleaved": "fuzzer.mutants.dsv41_mxfp8_scales_not_interleaved",
    "pcp-dcp-shard-rows-own-rank": "fuzzer.mutants.pcp_dcp_shard_rows_own_rank",
    "pcp-dcp-chunk-rows-paired": "fuzzer.mutants.pcp_dcp_chunk_rows_paired",
    "pcp-dcp-indexer-gather-rank-major": "fuzzer.mutants.pcp_dcp_indexer_gather_rank_major",
    "indexer-prefill-row-ends-absolute": "fuzzer.mutants.indexer_prefill_row_ends_absolute",
    "indexer-mtp-seq-lens-off-by-one": "fuzzer.mutants.indexer_mtp_seq_lens_off_by_one",
    "indexer-flattened-seq-lens-off-by-one": "fuzzer.mutants.indexer_flattened_seq_lens_off_by_one",
    "indexer-cache-scale-not-ue8m0": "fuzzer.mutants.indexer_cache_scale_not_ue8m0",
    "indexer-buffer-clear-past-step": "fuzzer.mutants.indexer_buffer_clear_past_step",
    "indexer-prefill-weights-from-row-zero": "fuzzer.mutants.indexer_prefill_weights_from_row_zero",
    "dsv32-dense-mha-skip-with-decodes": "fuzzer.mutants.dsv32_dense_mha_skip_with_decodes",
    "dsv32-dense-mha-split-ignores-context": "fuzzer.mutants.dsv32_dense_mha_split_ignores_context",
    "dsv32-dcp-no-query-gather-merge": "fuzzer.mutants.dsv32_dcp_no_query_gather_merge",
    "step5-summary-position-off-by-one": "fuzzer.mutants.step5_summary_position_off_by_one",
}


APPLIED: list[str] = []  # what `inject` applied in this process (a multi-process target replays it in its ranks)


def unavailable_on(mod: ModuleType, device: str) -> str | None:
    """Why the mutant cannot be found on this host (its own `unavailable(device)`), or None."""
    hook = getattr(mod, "unavailable", None)
    return hook(device) if hook else None


def load(name: str) -> ModuleType:
    return importlib.import_module(MUTANTS[name])


def inject(name_or_file: str) -> str:
    """Apply a built-in mutant or run a user's Python file; returns a label for reports."""
    if name_or_file in MUTANTS:
        load(name_or_file).apply()
        APPLIED.append(name_or_file)
        return name_or_file
    path = Path(name_or_file)
    if not path.is_file():
        raise MutantError(f"--inject {name_or_file!r}: neither a built-in mutant ({', '.join(MUTANTS)}) nor a file")
    try:
        ns = runpy.run_path(str(path))
        if callable(ns.get("apply")):
            ns["apply"]()
    except Exception as e:  # the user's file: where it raised, in one line
        frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename).resolve() == path.resolve()]
        where = f"{path}:{frames[-1].lineno}" if frames else str(path)
        raise MutantError(f"--inject {where}: {type(e).__name__}: {e}") from e
    APPLIED.append(str(path.resolve()))
    return str(path)


def source(name_or_file: str) -> str:
    """The mutant's source, for inlining into a reproducer."""
    path = Path(name_or_file) if name_or_file not in MUTANTS else Path(load(name_or_file).__file__)
    text = path.read_text()
    for line in [ln for ln in text.splitlines() if ln.startswith("from fuzzer.mutants._kernel_patch import")]:
        # inline the shared helper so the reproducer needs no attnfuzz
        text = (Path(__file__).parent / "_kernel_patch.py").read_text() + "\n\n" + text.replace(line + "\n", "")
    return text
