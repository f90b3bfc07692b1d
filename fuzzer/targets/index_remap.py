"""`vllm.index_remap`: `triton_convert_req_index_to_global_index`, every mode the release offers.

Plain remap, valid counts (with compaction where the release compacts), prefill-workspace mode, a
persistent block table through idx_mapping, BLOCK_STRIDE_ROWS above the block size, and call sites that
pass only the MQA subset of topk_indices, including the pre-fix one that left req_id_per_token unsliced.
"""

from __future__ import annotations

import torch

from fuzzer.repro_spec import Call, Judge, ReproSpec
from fuzzer.support.index_remap import remap_topk_indices
from fuzzer.targets import vllm_api
from fuzzer.targets.base import WHOLE, RunPlan, Target
from fuzzer.targets.probes import observe_paths
from oracles.index import expected_remap, judge_remap, remap_args_for
from strategies.batches import IndexFeatures, index_space
from strategies.tensors import materialize_index_inputs

# Tensors a reproducer defines under these names; other keyword arguments are written as literals.
_REPRO_TENSORS = {"idx_mapping", "prefill_workspace_request_ids", "prefill_workspace_starts"}


class IndexRemap(Target):
    name = "vllm.index_remap"
    summary = "sparse-MLA index remap: request-local top-k positions -> global KV-cache slots"
    bug_classes = "A B C"
    oracle = staticmethod(judge_remap)
    entry_point = "triton_convert_req_index_to_global_index"  # in vllm_api.SPARSE_UTILS
    real_parts = (entry_point, "the index-remap Triton kernel")

    def unavailable(self) -> str | None:
        try:
            vllm_api.remap_api()
        except vllm_api.TargetUnavailable as e:
            return str(e)
        return None

    def prepare(self) -> None:
        self.api = vllm_api.remap_api()

    PLANNED = ("api",)

    def cases(self, profile, plan: RunPlan = WHOLE):
        api = self.api
        return index_space(profile, IndexFeatures(block_stride_rows=api.has_block_stride_rows,
                                                  idx_mapping=api.has_idx_mapping))

    def kwargs(self, case, a) -> dict:
        kw = dict(BLOCK_SIZE=case.block_size, NUM_TOPK_TOKENS=case.topk_width,
                  return_valid_counts=case.call.valid_counts)
        if self.api.has_block_stride_rows:
            kw["BLOCK_STRIDE_ROWS"] = case.stride_rows
        if a.idx_mapping is not None:
            kw["idx_mapping"] = a.idx_mapping
        if a.prefill_request_id is not None:
            kw.update(HAS_PREFILL_WORKSPACE=True, prefill_workspace_request_ids=a.prefill_request_id,
                      prefill_workspace_starts=a.prefill_workspace_starts)
        return kw

    def compacted(self, case) -> bool:
        return case.call.valid_counts and self.api.compacts_valid_counts

    def run(self, case):
        a = remap_args_for(case, materialize_index_inputs(case, self.device))
        kw = self.kwargs(case, a)

        def call():
            out, counts = remap_topk_indices(self.entry_point, a.req_id, a.block_table, a.token_indices, **kw)
            return {"out": out, "valid_counts": counts}

        return observe_paths(self.observe, call, {"compacted": self.compacted(case)})


    def repro_spec(self, finding) -> ReproSpec:
        """The call on the step's int tensors, written as literals; judged against the documented remap, or, where
        req_id_per_token and topk_indices cover different tokens, by whether vLLM refuses the call."""
        case = finding.case
        a = remap_args_for(case, materialize_index_inputs(case, "cpu"))
        literals = dict(req_id_per_token=a.req_id, block_table=a.block_table, topk_indices=a.token_indices)
        if a.idx_mapping is not None:
            literals["idx_mapping"] = a.idx_mapping
        if a.prefill_request_id is not None:
            literals.update(prefill_workspace_request_ids=a.prefill_request_id,
                            prefill_workspace_starts=a.prefill_workspace_starts)
        about = f"Shrunk case: {case.summary()}"
        if a.req_id.shape[0] != a.token_indices.shape[0]:
            judge = Judge("index_contract", {"req_id_per_token": "req_id_per_token", "topk_indices": "topk_indices"})
        else:
            literals["expected"] = expected_remap(a).to(torch.int32)
            about += "\n`expected` is the documented remap of topk_indices (attnfuzz's oracle)."
            judge = Judge("index", {"out": "out", "valid_counts": "valid_counts", "expected": "expected",
                                    "compacted": repr(bool(finding.observation.notes.get("compacted", False)))})
        kw = {k: k if k in _REPRO_TENSORS else repr(v) for k, v in self.kwargs(case, a).items()}
        call = Call(remap_topk_indices, dict(entry_point=repr(self.entry_point), req_id_per_token="req_id_per_token",
                                             block_table="block_table", topk_indices="topk_indices", **kw),
                    assign="out, valid_counts")
        return ReproSpec(about=about, call=(call,), judge=judge, literals=literals,
                         bounds_checked=finding.host.device == "cpu")
