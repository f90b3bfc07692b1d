"""`vllm.dcp_filter`: `triton_filter_and_convert_dcp_index`, one DCP rank's view of the top-k.

Global top-k positions are filtered to the tokens this rank owns (rank (t // I) % N for interleave I) and
mapped to local slots through the rank's own block table. Called as FlashMLA's fp8 mixed-batch path calls
it (in place, no compaction) and as the trtllm-gen path does (valid counts, compacted to the front).
"""

from __future__ import annotations

from fuzzer.targets import vllm_api
from fuzzer.targets.base import Target
from oracles.index import judge_remap, remap_args_for
from oracles.materialize import materialize_index_inputs
from strategies.batches import IndexFeatures, index_cases


class DcpFilter(Target):
    name = "vllm.dcp_filter"
    summary = "DCP top-k filter: global positions -> this rank's local KV-cache slots"
    bug_classes = "B C G"
    oracle = staticmethod(judge_remap)
    real_parts = ("triton_filter_and_convert_dcp_index", "sparse_mla_index_remap_kernel (Triton)")

    def unavailable(self) -> str | None:
        try:
            api = vllm_api.remap_api()
        except vllm_api.TargetUnavailable as e:
            return str(e)
        if not api.has_dcp_filter:
            return f"vLLM {api.version} has no triton_filter_and_convert_dcp_index (added after this release)"
        return None

    def prepare(self) -> None:
        self.api = vllm_api.remap_api()

    def cases(self, profile):
        # The filter has no prefill-workspace mode and always slices req_id like topk_indices.
        return index_cases(profile, IndexFeatures(
            dcp=True, block_stride_rows=vllm_api.remap_api().dcp_has_block_stride_rows,
            prefill_workspace=False, row_contract_breaks=False))

    def kwargs(self, case) -> dict:
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
        if case.dcp.size == 1:
            return case.call.valid_counts and self.api.compacts_valid_counts
        return case.call.valid_counts

    def run(self, case):
        a = remap_args_for(case, materialize_index_inputs(case, self.device))
        kw = self.kwargs(case)

        def call():
            su = vllm_api.sparse_utils()
            res = su.triton_filter_and_convert_dcp_index(a.req_id, a.block_table, a.token_indices, **kw)
            out, counts = res if isinstance(res, tuple) else (res, None)
            return {"out": out, "valid_counts": counts}

        return self.observe(call, {"compacted": self.compacted(case)})

    def repro_call(self, case) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs(case).items())
        return (
            "from vllm.v1.attention.backends.mla import sparse_utils\n"
            f"res = sparse_utils.triton_filter_and_convert_dcp_index(req_id_per_token, block_table, topk_indices, {args})\n"
            "out, valid_counts = res if isinstance(res, tuple) else (res, None)\n"
        )
