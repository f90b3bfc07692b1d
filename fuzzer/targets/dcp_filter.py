"""`vllm.dcp_filter`: `triton_filter_and_convert_dcp_index`, one DCP rank's view of the top-k.

Global top-k positions are filtered to the tokens this rank owns (rank (t // I) % N for interleave I) and
mapped to local slots through the rank's own block table. Called as FlashMLA's fp8 mixed-batch path calls
it (in place, no compaction) and as the trtllm-gen path does (valid counts, compacted to the front).
"""

from __future__ import annotations

from fuzzer.targets import vllm_api
from fuzzer.targets.base import WHOLE, RunPlan
from fuzzer.targets.index_remap import IndexRemap
from strategies.batches import IndexFeatures, index_space


class DcpFilter(IndexRemap):  # the same kernel and oracle; another entry point and call site
    name = "vllm.dcp_filter"
    summary = "DCP top-k filter: global positions -> this rank's local KV-cache slots"
    bug_classes = "B C G"
    entry_point = "triton_filter_and_convert_dcp_index"
    real_parts = (entry_point, "the index-remap Triton kernel")

    def unavailable(self) -> str | None:
        why = super().unavailable()
        if why is None and not vllm_api.remap_api().has_dcp_filter:
            why = f"vLLM {vllm_api.remap_api().version} has no {self.entry_point} (added in a later release)"
        return why

    def cases(self, profile, plan: RunPlan = WHOLE):
        # The filter has no prefill-workspace mode and its call sites always slice req_id like topk_indices.
        return index_space(profile, IndexFeatures(
            dcp=True, block_stride_rows=self.api.dcp_has_block_stride_rows,
            prefill_workspace=False, row_contract_breaks=False))

    def kwargs(self, case, a) -> dict:
        compact = case.call.valid_counts
        kw = dict(dcp_size=case.dcp.size, dcp_rank=case.dcp.rank, BLOCK_SIZE=case.block_size,
                  NUM_TOPK_TOKENS=case.topk_width, return_valid_counts=compact, compact_valid_to_front=compact)
        if self.api.dcp_has_interleave:
            kw["cp_kv_cache_interleave_size"] = case.dcp.interleave
        if self.api.dcp_has_block_stride_rows:
            kw["BLOCK_STRIDE_ROWS"] = case.stride_rows
        return kw

    def compacted(self, case) -> bool:
        # DCP size 1 delegates to the plain converter, which compacts only in releases that do so.
        return super().compacted(case) if case.dcp.size == 1 else case.call.valid_counts
