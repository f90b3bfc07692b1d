"""`vllm.flashmla_sparse.layer.dcp`: vLLM's MLAAttention layer on FLASHMLA_SPARSE under decode context
parallelism, every rank emulated in one process (the seed's production configuration: DCP, fp8_ds_mla,
fewer than 32 heads per rank).

Each rank builds its own MLAAttention (kv_b_proj holding its heads' rows, as TP splits it; the layer makes its
MLADCPManager) and its own fp8_ds_mla cache, written through vLLM's slot mapping with the tokens it owns, and
runs `MLAAttention.forward_impl` on its heads of q and every new token's latent: decode tokens take
forward_mqa (query all-gather, the DCP top-k filter, vLLM's LSE combine), short prefills dense MHA, whose
cached context each rank gathers from its own cache and the DCP group all-gathers
(`_context_parallel_compute_prefill_context`, path `mha.chunked_context.dcp`). The collectives run over
`fuzzer.support.dcp_group`. The ranks' heads together are judged as the layer's output over the whole,
undivided context (`oracles.dcp.undivided`).
"""

from __future__ import annotations

import torch

from fuzzer.repro_spec import Call, Judge, ReproSpec
from fuzzer.support import flashmla_runtime
from fuzzer.support.dcp_steps import (
    dcp_layer_engine,
    direct_dcp_off,
    layer_rank_metadata,
    rank_heads,
    rank_kv_b_weight,
    replay_layer_dcp_ranks,
)
from fuzzer.support.vllm_setup import guard_index_group
from fuzzer.support.sparse_mla_steps import layer_forward
from fuzzer.targets.base import WHOLE, RunPlan
from fuzzer.targets.flashmla_dcp import (
    DcpStep,
    FlashMLASparseDcp,
    RankResult,
    dcp_cache_args,
    dcp_cache_dtypes,
    dcp_constants,
    dcp_report,
    dcp_repro_tensors,
    dcp_setup,
    run_emulated_ranks,
)
from fuzzer.targets.flashmla_layer import FlashMLASparseLayer
from fuzzer.targets.guards import Guards
from fuzzer.targets.harness import step_tensors
from oracles.attention_judge import layer_reference_for, layer_tolerance
from oracles.dcp import judge_layer_dcp, rank_slot_mapping, undivided
from strategies.batches import AttentionFeatures, attention_space
from strategies.tensors import V_HEAD, materialize_layer_inputs


class FlashMLASparseLayerDcp(FlashMLASparseLayer):
    name = "vllm.flashmla_sparse.layer.dcp"
    summary = ("MLAAttention on FLASHMLA_SPARSE under DCP, every rank emulated in one process: decode -> forward_mqa "
               "with the query gather and LSE combine, short prefill -> dense MHA with the DCP context gather")
    bug_classes = "A B C E F G I J"
    oracle = staticmethod(judge_layer_dcp)
    # the layer under DCP on fp8_ds_mla, and from 0.34 on bf16 (`dcp_cache_dtypes`: this release's; on one that
    # refuses bf16 the cases check that it does)
    kv_cache_dtypes = ("fp8_ds_mla", "bfloat16")
    dcp_cache_dtypes: tuple[str, ...] = ("fp8_ds_mla",)
    PLANNED = (*FlashMLASparseLayer.PLANNED, "dcp_cache_dtypes")

    def unavailable(self) -> str | None:
        return super().unavailable() or FlashMLASparseDcp.needs_dcp_manager()

    def prepare(self) -> None:
        direct_dcp_off()  # no symmetric memory over emulated ranks (CUDA would probe for it)
        super().prepare()
        self.real_parts = (*self.real_parts, "MLADCPManager (query gather, LSE combine, context gather)")
        self.dcp_cache_dtypes = dcp_cache_dtypes()

    def cases(self, profile, plan: RunPlan = WHOLE):
        # The mixed-batch path (< 32 heads per rank), gathered heads inside one fp8 envelope (<= 64).
        return attention_space(profile, AttentionFeatures(kv_cache_dtypes=plan.kv_dtypes(self), heads=(8, 16),
                                                          block_sizes=(64, 128), dcp=True, block_stride_rows=False,
                                                          indexer_fills_short_seqs=True, vllm_batch_order=True))

    def run(self, case):
        step = LayerDcpStep(self, case)
        obs = run_emulated_ranks(self, step)
        obs.notes.update(route=step.route, layer_routes=self.routes)
        return obs

    def repro_spec(self, finding) -> ReproSpec:
        """Every rank of the step in one process, as `run` emulates them: each rank's fp8_ds_mla cache as its
        writer left it (its own tokens), its MLAAttention (its heads of q and its rows of kv_b_proj) and builder,
        `forward_impl` over attnfuzz's in-process DCP group. Judged: the ranks' heads, in rank order, against the
        layer's fp32 reference over the undivided context."""
        case, dev = finding.case, finding.host.device
        whole = undivided(case)
        layer_inputs = materialize_layer_inputs(whole, dev)
        inp, slots, topk_buffer = step_tensors(whole, dev, layer_inputs.attention)
        tensors, slot_values = dcp_repro_tensors(self, case, whole, inp, slots, topk_buffer, dev)
        mha_tokens = int(finding.observation.notes.get("route", {}).get("mha_tokens", 0))
        expected, _ = layer_reference_for(whole, layer_inputs, dev, slot_values, mha_tokens)
        atol, rtol = layer_tolerance(whole, layer_inputs)
        new = [inp.slot_of[i][req.context_len:] for i, req in enumerate(whole.requests)]  # the step's own tokens
        new_slots = (torch.cat(new) if new else torch.zeros(0, dtype=torch.int64)).to(dev)
        tensors.update(q=layer_inputs.q, kv_b_weight=layer_inputs.kv_b_weight, kv_c_normed=inp.kv_c[new_slots],
                       k_pe=inp.k_pe[new_slots].unsqueeze(1), expected_out=expected)
        replay = Call(replay_layer_dcp_ranks, dict(backend="backend", spec="spec", cfg="cfg", cam="cam", T="T",
                                                   dcp_size="DCP_SIZE", interleave="INTERLEAVE", heads="HEADS",
                                                   **dcp_cache_args(), device="DEVICE", found="found"),
                      assign="out, route", note="every rank, emulated in one process: its MLAAttention's output")
        return ReproSpec(
            about=f"Shrunk case: {case.summary()}; {case.heads} heads per rank, {case.kv_cache_dtype}, values "
                  f"{case.values}.\nInputs in tensors.safetensors beside this file; the expected output is attnfuzz's "
                  "fp32 oracle of the layer (after W_UV) over the undivided context.",
            constants=dict(dcp_constants(case, whole, topk_buffer), ATOL=atol, RTOL=rtol, LSE_TOL=0.0),
            tensors=tensors,
            prepare=(Call(direct_dcp_off), *self.repro_prepare(layer=True)),
            setup=dcp_setup(self),
            call=(replay,),
            judge=Judge("dcp", dict(out="out", expected='T["expected_out"]', lses="{}", expected_lses="{}",
                                    heads="HEADS", atol="ATOL", rtol="RTOL", lse_tol="LSE_TOL")),
            report=dcp_report(**{"rank 0's routes:": "route"}),
            bounds_checked=dev == "cpu")


class LayerDcpStep(DcpStep):
    """One case under DCP at the layer: the undivided layer inputs every rank shares, and one rank's step."""

    def __init__(self, target: FlashMLASparseLayerDcp, case) -> None:
        self.layer_inputs = materialize_layer_inputs(undivided(case), target.device)
        super().__init__(target, case, self.layer_inputs.attention)
        self.route: dict = {}

    def call_rank(self, r: int, res: RankResult, guards: Guards, cache: torch.Tensor, topk_buffer) -> None:
        case, inp, cfg, dev, heads = self.case, self.inputs, self.cfg, self.target.device, self.case.heads
        # The layer makes its MLADCPManager (the DCP group is this rank's) and registers itself as LAYER,
        # where the builder finds it and its prefill backend (which gets the DCP context gather).
        builder, layer, route = dcp_layer_engine(self.target.backend, self.spec, cfg, heads,
                                                 rank_kv_b_weight(self.layer_inputs.kv_b_weight, heads, r), topk_buffer, dev)
        m = self.metadata_in
        metadata = layer_rank_metadata(builder, cfg, m, rank_slot_mapping(case, m.slot_mapping, r), case.dcp.size, r,
                                       case.dcp.interleave)
        new = [inp.slot_of[i][req.context_len:] for i, req in enumerate(self.whole.requests)]
        new_slots = (torch.cat(new) if new else torch.zeros(0, dtype=torch.int64)).to(dev)
        output = guards.empty(f"output (rank {r})", case.num_tokens * heads * V_HEAD, torch.bfloat16, dev).view(
            case.num_tokens, heads * V_HEAD).fill_(float("nan"))
        check_overrun = guard_index_group(layer.impl)
        flashmla_runtime.GATHER_LOG = None  # a rank's gathers read its own cache: judged by the output only
        layer_forward(layer, rank_heads(self.layer_inputs.q, heads, r), inp.kv_c[new_slots],
                      inp.k_pe[new_slots].unsqueeze(1), cache, metadata, output)
        res.merged = output.detach().cpu()
        if overruns := [f"rank {r}: {msg}" for msg in check_overrun(route["mqa_tokens"])]:
            res.problems["buffer_overrun"] = overruns
        if r == 0:
            prefill = getattr(metadata, "prefill", None)
            self.route = dict(route, chunked_context=prefill is not None and prefill.chunked_context is not None)

    def outputs(self, results: list[RankResult]) -> dict:
        self.results = results
        return {"out": torch.cat([res.merged for res in results], dim=1)}  # every rank's heads, in rank order

