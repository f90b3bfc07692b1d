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

import dataclasses
import importlib

import torch

from fuzzer.support import flashmla_runtime
from fuzzer.support.flashmla_runtime import (
    BACKEND_MODULE,
    LAYER,
    guard_index_group,
    mla_layer,
    record_routes,
)
from fuzzer.targets.flashmla_dcp import DcpStep, FlashMLASparseDcp, RankResult, run_emulated_ranks
from fuzzer.targets.flashmla_layer import FlashMLASparseLayer
from fuzzer.targets.guards import Guards
from oracles.dcp import judge_layer_dcp, rank_slot_mapping, rank_slots, undivided
from strategies.batches import AttentionFeatures, attention_space
from strategies.tensors import QK_NOPE, V_HEAD, materialize_layer_inputs


class FlashMLASparseLayerDcp(FlashMLASparseLayer):
    name = "vllm.flashmla_sparse.layer.dcp"
    summary = ("MLAAttention on FLASHMLA_SPARSE under DCP, every rank emulated in one process: decode -> forward_mqa "
               "with the query gather and LSE combine, short prefill -> dense MHA with the DCP context gather")
    bug_classes = "A B C E F G I J"
    oracle = staticmethod(judge_layer_dcp)
    kv_cache_dtypes = ("fp8_ds_mla",)  # vLLM runs FlashMLA sparse under DCP on an fp8_ds_mla cache only

    def unavailable(self) -> str | None:
        return super().unavailable() or FlashMLASparseDcp.needs_dcp_manager()

    def prepare(self) -> None:
        import os

        for name in ("VLLM_USE_DIRECT_DCP_Q_GATHER", "VLLM_USE_DIRECT_DCP_KV_GATHER", "VLLM_USE_DIRECT_DCP_A2A"):
            os.environ.setdefault(name, "0")  # no symmetric memory over emulated ranks (CUDA would probe for it)
        super().prepare()
        self.real_parts = (*self.real_parts, "MLADCPManager (query gather, LSE combine, context gather)")

    def cases(self, profile):
        # The mixed-batch path (< 32 heads per rank), gathered heads inside one fp8 envelope (<= 64).
        return attention_space(profile, AttentionFeatures(kv_cache_dtypes=self.kv_cache_dtypes, heads=(8, 16),
                                                          block_sizes=(64, 128), dcp=True, block_stride_rows=False,
                                                          indexer_fills_short_seqs=True, vllm_batch_order=True))

    def run(self, case):
        step = LayerDcpStep(self, case)
        obs = run_emulated_ranks(self, step)
        obs.notes.update(route=step.route, layer_routes=self.routes)
        return obs

    def repro_spec(self, finding):
        return None  # the campaign keeps the finding (case.json, finding.json); no standalone script yet


class LayerDcpStep(DcpStep):
    """One case under DCP at the layer: the undivided layer inputs every rank shares, and one rank's step."""

    def __init__(self, target: FlashMLASparseLayerDcp, case) -> None:
        self.layer_inputs = materialize_layer_inputs(undivided(case), target.device)
        super().__init__(target, case, self.layer_inputs.attention)
        self.route: dict = {}

    def run_rank(self, r: int) -> RankResult:
        from vllm.config import set_current_vllm_config
        from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

        case, inp, cfg, dev, heads = self.case, self.inputs, self.cfg, self.target.device, self.case.heads
        res, guards = RankResult(), Guards()
        cache = self.target.cache(case, dev, guards, name=f"kv_cache (rank {r})")
        shape = self.topk_buffer.shape  # each rank has its own indexer buffer
        topk_buffer = guards.empty(f"topk_indices_buffer (rank {r})", shape.numel(), torch.int32, dev).view(shape)
        topk_buffer.copy_(self.topk_buffer)
        rows = slice(r * heads * (QK_NOPE + V_HEAD), (r + 1) * heads * (QK_NOPE + V_HEAD))  # this rank's kv_b_proj
        with set_current_vllm_config(cfg), torch.inference_mode():
            # The rank's cache holds its own tokens: vLLM's slot mapping is -1 for the others'.
            self.write(inp.kv_c[self.slots], inp.k_pe[self.slots], cache, rank_slot_mapping(case, self.slots, r))
            before = cache.clone()
            owner, rslot = rank_slots(case, self.slots)
            res.entries = before[rslot[owner == r] // case.block_size, rslot[owner == r] % case.block_size].cpu()
            # The layer makes its MLADCPManager (the DCP group is this rank's) and registers itself as LAYER,
            # where the builder finds it and its prefill backend (which gets the DCP context gather).
            layer = mla_layer(cfg, heads, self.layer_inputs.kv_b_weight[rows], topk_buffer, dev)
            route: dict = {"mqa_tokens": 0, "mha_tokens": 0}
            record_routes(layer.impl, route)
            builder = importlib.import_module(BACKEND_MODULE).FlashMLASparseBackend.get_builder_cls()(
                self.spec, [LAYER], cfg, torch.device(dev))
            manager = layer.dcp_manager
            if getattr(manager, "_kv_gather", None) is not None:
                # vLLM's gather is torch.distributed.all_gather_into_tensor on the group's device_group, which
                # the emulated group has none of: the same collective over the emulated ranks.
                manager._kv_gather = manager.group.all_gather_into_tensor
            m = self.metadata_in
            local = get_dcp_local_seq_lens(m.seq_lens, case.dcp.size, r, case.dcp.interleave)
            extra = {k: v for k, v in dict(dcp_local_seq_lens=local, dcp_local_seq_lens_cpu_upper_bound=local.cpu()).items()
                     if hasattr(m, k)}
            metadata = builder.build(0, dataclasses.replace(
                m, slot_mapping=rank_slot_mapping(case, m.slot_mapping, r), **extra))
            new = [inp.slot_of[i][req.context_len:] for i, req in enumerate(self.whole.requests)]
            new_slots = (torch.cat(new) if new else torch.zeros(0, dtype=torch.int64)).to(dev)
            output = guards.empty(f"output (rank {r})", case.num_tokens * heads * V_HEAD, torch.bfloat16, dev).view(
                case.num_tokens, heads * V_HEAD).fill_(float("nan"))
            check_overrun = guard_index_group(layer.impl)
            flashmla_runtime.GATHER_LOG = None  # a rank's gathers read its own cache: judged by the output only
            q = self.layer_inputs.q[:, r * heads:(r + 1) * heads].contiguous()  # this rank's heads (TP split)
            layer.forward_impl(q, inp.kv_c[new_slots], inp.k_pe[new_slots].unsqueeze(1), cache, metadata, output)
            res.merged = output.detach().cpu()
            if overruns := [f"rank {r}: {msg}" for msg in check_overrun(route["mqa_tokens"])]:
                res.problems["buffer_overrun"] = overruns
            if r == 0:
                prefill = getattr(metadata, "prefill", None)
                self.route = dict(route, chunked_context=prefill is not None and prefill.chunked_context is not None)
        if dev == "cuda":
            torch.cuda.synchronize()
        res.cache_changed = int((cache.view(torch.uint8) != before.view(torch.uint8)).any(dim=-1).sum())
        if guard := guards.check():
            res.problems["guard"] = [f"rank {r}: {g}" for g in guard]
        return res

    def outputs(self, results: list[RankResult]) -> dict:
        self.results = results
        return {"out": torch.cat([res.merged for res in results], dim=1)}  # every rank's heads, in rank order

