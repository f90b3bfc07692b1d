"""`vllm.dsv32.attention.dcp`: DeepSeek-V3.2 / GLM-5's attention module (`DeepseekV32Attention`) under decode context
parallelism alone (no PCP), every DCP rank emulated in one process, over the steps of a trace.

Each rank holds what its process would: its heads of the module's layer (and of the skip_topk layer after it: their
rows of kv_b_proj, as TP splits them; each layer makes its `MLADCPManager` on the rank's DCP group), its own indexer
(DeepseekV32Indexer, whose op reads the rank and world size), both metadata builders, its index cache and fp8_ds_mla
MLA cache holding only the tokens it owns (vLLM's slot mapping: -1 for another rank's), its persistent top-k buffer
and index group. Every rank runs the module's seam, `_sparse_indexer_and_attn`, as `vllm.dsv32.attention` drives it
(`fuzzer.support.dsv32_runtime`), on the step's CommonAttentionMetadata with its slot mapping and DCP-local sequence
lengths (`get_dcp_local_seq_lens`), so vLLM's DCP code runs on every rank:
  * the indexer: logits and top-k over the rank's shard (local lengths, local prefill bounds), then the global merge
    `_merge_dcp_topk_global` (each rank's candidates packed as (score, global id), all-gathered, the stable top-k),
    which leaves every rank's buffer holding the same global top-k;
  * the module's MQA route: the DCP query gather (`MLADCPManager.query_gather`), `forward_mqa` on FLASHMLA_SPARSE's
    fp8 mixed-batch path (the DCP filter `triton_filter_and_convert_dcp_index`, the rank's LSE, (0, -inf) for a row it
    holds none of), the LSE combine (`cp_lse_ag_out_rs`: all-gather, `correct_attn_out`, reduce-scatter to the
    rank's heads), W_UV; short prefills through MLAAttention.forward_impl's dense MHA with the DCP context gather.
The collectives run over attnfuzz's in-process group (`fuzzer.support.dcp_group`: one rank at a time, each with its
own forward context, workspace manager, static forward context and current config).

Judged as the undivided module (`oracles/dsv32.py` `judge_dsv32_dcp`): the merged top-k from the index cache's bytes
as the ranks wrote them (put back in undivided slots), every rank's buffer alike, each layer's output (every rank's
heads in rank order) against the fp32 reference over the whole context with every rank's heads, from the fp8_ds_mla
entries the ranks wrote. Emulated as in `vllm.dsv32.attention`, plus the collectives; on a host without CuTe-DSL the
merge's two kernels are stand-ins (`fuzzer/support/standins/dcp_indexer.py`). Not driven: PCP (the module under PCP +
DCP with its indexer needs PCP's index-K gather and chunk plans; `vllm.flashmla_sparse.layer.pcp_dcp` drives the
module's PCP path with drawn top-k), the direct (symmetric-memory) DCP collectives, the a2a combine backend.
"""

from __future__ import annotations

import dataclasses

import torch

from fuzzer.env import STATE_DIR
from fuzzer.support import pcp_runtime
from fuzzer.support.dcp_group import installed_groups
from fuzzer.support.dcp_steps import direct_dcp_off, rank_heads, rank_kv_b_weight
from fuzzer.support.dsv32_runtime import SKIP_TOPK_LAYER, clear_topk_rows, dsv32_layer, index_group_builder, module_step
from fuzzer.support.flashmla_runtime import record_routes
from fuzzer.support.vllm_setup import LAYER, guard_index_group, standins_forced
from fuzzer.support.indexer_runtime import (
    ENTRY_BYTES,
    HEAD_DIM,
    index_cache,
    indexer_builder,
    indexer_config,
    indexer_layer,
    logits_budget,
    prepare_dcp_merge,
    write_index_keys,
)
from fuzzer.support.sparse_mla_steps import uninitialized_memory_as_nan
from fuzzer.targets.base import WHOLE, RunPlan
from fuzzer.targets.dsv32_attention import EMULATED, Dsv32Attention, engines_ended
from fuzzer.targets.flashmla_dcp import FlashMLASparseDcp
from fuzzer.targets.harness import (
    index_trace_step,
    max_batched_tokens,
    topk_buffer_for,
    trace_observation,
    with_padded_tokens,
)
from fuzzer.targets.indexer import Indexer
from oracles.dcp import rank_slot_mapping, rank_slots
from oracles.dsv32 import judge_dsv32_dcp, undivided_trace
from oracles.steps import judge_steps
from strategies.indexer_batches import attention_module_dcp_space
from strategies.indexer_tensors import attention_view, key_pool, materialize_indexer_inputs
from strategies.tensors import materialize_layer_inputs, written_slots

INTERPRETED_COMBINE_ROWS = 768
COLLECTIVES = "DCP collectives (attnfuzz's in-process group: all_gather, all_gather_into_tensor, reduce_scatter)"


class Dsv32AttentionDcp(Dsv32Attention):
    name = "vllm.dsv32.attention.dcp"
    summary = ("DeepSeek-V3.2/GLM-5 attention module under DCP, every rank emulated in one process: the real indexer "
               "(local top-k, global DCP merge) feeding FLASHMLA_SPARSE (query gather, fp8 DCP filter, LSE combine), "
               "dense-MHA split, skip_topk layers, traces")
    bug_classes = "A C D F G H I O"
    oracle = staticmethod(judge_steps(judge_dsv32_dcp))
    real_parts = (*Dsv32Attention.real_parts,
                  ("the indexer's DCP merge (_merge_dcp_topk_global) and DCP-local metadata (get_dcp_local_seq_lens, "
                   "the prefill chunks' local bounds)"),
                  "MLADCPManager (query gather, cp_lse_ag_out_rs combine, context gather)", "correct_attn_out (Triton)",
                  "triton_filter_and_convert_dcp_index", "FlashMLASparseImpl's fp8 mixed-batch path")
    kv_cache_dtypes = ("fp8_ds_mla",)  # vLLM runs FlashMLA sparse under DCP on an fp8_ds_mla cache only
    shardq = False  # the layers ShardQ-eligible, over an emulated TP world (vllm.dsv32.attention.shardq)

    def unavailable(self) -> str | None:
        return super().unavailable() or FlashMLASparseDcp.needs_dcp_manager()

    def captures_graphs(self) -> bool:
        return False  # the emulated ranks are threads meeting in Python collectives: FULL steps run eagerly

    def prepare(self) -> None:
        direct_dcp_off()  # no symmetric memory over emulated ranks
        super().prepare()
        emulated, overrides = prepare_dcp_merge(self.device, standins_forced())
        self.emulated = tuple(dict.fromkeys((*self.emulated, *emulated)))
        self.shims = (*self.shims, *overrides)
        if emulated:  # the merge's kernels are not vLLM's here
            self.real_parts = tuple(p.replace("the indexer's DCP merge (_merge_dcp_topk_global)",
                                              "the indexer's DCP merge (_merge_dcp_topk_global, its kernels stand-ins)")
                                    for p in self.real_parts)

    def cases(self, profile, plan: RunPlan = WHOLE):
        # On a CPU the LSE combine's Triton kernel (correct_attn_out) is interpreted: a program per token and gathered
        # head on every rank, a few ms each. Steps there are cut to 768 such rows a layer (24 tokens at 8 heads a
        # rank x 2 ranks, 2 at 8 x 8 ranks).
        return attention_module_dcp_space(profile, profile.attn_heads,
                                          combine_rows=INTERPRETED_COMBINE_ROWS if self.device == "cpu" else None,
                                          graph_modes=plan.graph_modes(self))

    def run_trace(self, case):  # run by Dsv32Attention.run, under the case's scheduled SMs
        dev, x = self.device, case.indexer
        size, heads = case.dcp.size, x.attention_heads
        steps = case.steps
        whole = undivided_trace(case, heads=False)  # the indexer's steps over the whole context (virtual blocks)
        layers = 2 if x.skip_topk_layer else 1
        views = [undivided_trace(attention_view(case, i), heads=True) for i in range(layers)]  # every rank's heads
        pool = key_pool(whole, dev)  # index keys by undivided slot
        # the case's DCP size and interleave, fp8_ds_mla
        cfg = indexer_config(dev, str(STATE_DIR), case, max_num_batched_tokens=max_batched_tokens(case))
        cfg.model_config.get_num_attention_heads = lambda parallel_config=None: heads  # the MLA heads per rank
        write, write_emulated = self.writer(attention_view(case))
        ranks, groups = pcp_runtime.emulated_world(1, size, size, cfg, dev)  # DCP alone: the DCP group spans them
        state = [RankState(topk=topk_buffer_for(case, dev),
                           index_kv=index_cache(case.pool_blocks, case.block_size, dev),
                           caches=[self.cache(attention_view(case, i), dev) for i in range(layers)])
                 for _ in range(size)]
        emulated = tuple(dict.fromkeys(e for e in (*self.emulated, write_emulated, *EMULATED, COLLECTIVES) if e))
        index_written = torch.zeros(pool.shape[0], dtype=torch.bool, device=dev)
        observed = []
        with installed_groups(_DCP=groups["_DCP"]), engines_ended([st.engine for st in state]):
            for k, step in enumerate(steps):
                shared = StepInputs.of(k, step, whole, views, pool, index_written, dev)

                def call(shared=shared):
                    with logits_budget(shared.case.indexer.max_logits_mb), uninitialized_memory_as_nan():
                        results = ranks.run(lambda r: self.rank_step(r, state[r], cfg, shared, write))
                    return self.merged(shared, results)

                obs = self.observe_step(call, lambda: state[0].routes,
                                        notes={"dcp": f"{size} ranks emulated in one process, interleave "
                                                      f"{case.dcp.interleave}, {heads} heads a rank"})
                if index_trace_step(observed, obs, step, shared.inp, index_written, emulated, self.shims):
                    break
        return trace_observation(observed)

    def rank_step(self, r: int, st: RankState, cfg, s: StepInputs, write) -> dict:
        """Rank r's step, on its thread: what fused_norm_rope leaves before the seam (its tokens' index keys and MLA
        entries written through its slot mapping, the top-k rows cleared), both builders' metadata from the step's
        CommonAttentionMetadata as the rank's runner makes it, then each layer's `_sparse_indexer_and_attn`."""
        from vllm.config import set_current_vllm_config
        from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

        dev, case, inp = self.device, s.case, s.inp
        if not st.engine:  # under TP alone the TP group is an emulated one: kv_b_proj takes the rank's rows as given
            self.new_rank_engine(r, st, cfg, case, s.layer_inputs, disable_tp=self.shardq)
        dr = r if case.dcp.size > 1 else 0  # the rank's DCP rank (TP alone: every rank holds the whole cache)
        with set_current_vllm_config(cfg), torch.inference_mode():
            slots = own_slots(case, inp.slots, dr)  # the rank's slot mapping: -1 for others' tokens and padding
            mine = slots >= 0
            fresh = own_slots(case, s.fresh, dr)
            if bool((fresh >= 0).any()):  # what earlier steps (or a prefix-cache hit) left there
                write_index_keys(s.fresh_keys[fresh >= 0], st.index_kv, fresh[fresh >= 0])
            if bool(mine.any()):
                write_index_keys(inp.k[mine], st.index_kv, slots[mine])
            for ls, li, cache in zip(s.layer_steps, s.layer_inputs, st.caches):
                w = written_slots(ls).to(dev)
                local = own_slots(case, w, dr)
                keep = local >= 0
                if bool(keep.any()):  # an empty write is not launched (see dcp-pcp.md: the emulated ranks)
                    write(li.attention.kv_c[w[keep]], li.attention.k_pe[w[keep]], cache, local[keep])
            clear_topk_rows(st.topk, case.num_actual_tokens)
            before = st.topk.clone()
            cache_before = [c.clone() for c in st.caches]
            for route in st.routes:
                route.clear()
                route.update(mqa_tokens=0, mha_tokens=0)
            check_overrun = guard_index_group(st.engine["layers"][0].impl, poison=s.first)
            common = Indexer.common_metadata(s.whole, inp, dev)
            local_lens = get_dcp_local_seq_lens(common.seq_lens, case.dcp.size, dr, case.dcp.interleave)
            extra = {k: v for k, v in {"dcp_local_seq_lens": local_lens,
                                       "dcp_local_seq_lens_cpu_upper_bound": local_lens.cpu()}.items()
                     if hasattr(common, k)}
            common = dataclasses.replace(common, slot_mapping=slots, **extra)
            indexer_md = st.engine["indexer_builder"].build(0, common)
            mla_md = st.engine["mla_builder"].build(0, common)
            outs = []
            h = case.indexer.attention_heads
            for layer, ls, li in zip(st.engine["layers"], s.layer_steps, s.layer_inputs):
                new = torch.cat([li.attention.slot_of[q][req.context_len:] for q, req in enumerate(ls.requests)]).to(dev)
                outs += module_step(cfg, [layer], indexer_md, mla_md, with_padded_tokens(ls, rank_heads(li.q, h, r)),
                                    with_padded_tokens(ls, li.attention.kv_c[new]),
                                    with_padded_tokens(ls, li.attention.k_pe[new]), inp.q_fp8, inp.weights,
                                    inp.positions, slots, case.cudagraph)
            overruns = [f"rank {r}: {m}" for m in check_overrun(st.routes[0]["mqa_tokens"])]
            changed = [int((c.view(torch.uint8) != b.view(torch.uint8)).any(dim=-1).sum())
                       for c, b in zip(st.caches, cache_before)]
            return {"outs": [o.clone() for o in outs], "topk": st.topk.clone(), "topk_before": before,
                    "index_kv": st.index_kv.clone(), "caches": [c.clone() for c in st.caches], "overruns": overruns,
                    "changed": changed, "shardq": getattr(mla_md, "shardq", None)}

    def new_rank_engine(self, r: int, st: RankState, cfg, case, layer_inputs, disable_tp: bool = False) -> None:
        """What rank r's runner keeps for the engine's life: its indexer and the indexer's builder, its heads of the
        module's layers over its index group (each layer's MLADCPManager on the rank's DCP group), FLASHMLA_SPARSE's
        builder; the dense-MHA context gather as vLLM runs it on the group's device group (torch.distributed's
        all_gather_into_tensor), here the emulated group's. r: the rank whose heads it holds (the TP rank under PCP);
        disable_tp: kv_b_proj outside TP (under PCP the TP group is an emulated one of its own). Made on the rank's
        thread, inside the engine's config: the layers and builders read the parallel sizes there."""
        from vllm.config import set_current_vllm_config

        dev, h = self.device, case.indexer.attention_heads
        indexer = indexer_layer(cfg, st.topk, st.index_kv)
        group = index_group_builder(cfg, st.topk)
        layers = []
        with set_current_vllm_config(cfg), torch.inference_mode():
            for i, li in enumerate(layer_inputs):
                layer = dsv32_layer(cfg, h, rank_kv_b_weight(li.kv_b_weight, h, r), st.topk,
                                    indexer if i == 0 else None, group, dev,
                                    prefix=LAYER if i == 0 else SKIP_TOPK_LAYER, backend=self.backend,
                                    disable_tp=disable_tp, shardq_eligible=self.shardq)
                layer.kv_cache = st.caches[i]
                route: dict = {}
                record_routes(layer.impl, route)
                layers.append(layer)
                st.routes.append(route)
            st.engine["mla_builder"] = self.mla_metadata_builder(case, cfg)
        for layer in layers:
            manager = layer.dcp_manager
            if getattr(manager, "_kv_gather", None) is not None:
                manager._kv_gather = manager.group.all_gather_into_tensor
        st.engine["indexer_builder"] = indexer_builder(cfg, indexer, dev, len(case.block_table[0]))
        st.engine["layers"] = layers

    def topk_rows(self, s: StepInputs, results: list[dict]) -> dict:
        """The step's top-k rows: rank 0's buffer, and the rows where another rank's differs after the DCP merge
        (which must leave every rank the same rows), each as the first rank that differs has it."""
        rows, width = s.case.num_actual_tokens, s.case.topk_width
        differ = torch.zeros(rows, dtype=torch.bool, device=results[0]["topk"].device)
        other = results[0]["topk"].clone()
        for res in results[1:]:  # as sets: the top-k kernels promise no order within a row
            these = (res["topk"][:rows, :width].sort(dim=1).values !=
                     results[0]["topk"][:rows, :width].sort(dim=1).values).any(dim=1)
            other[:rows][these & ~differ] = res["topk"][:rows][these & ~differ]
            differ |= these
        return {"topk_indices_buffer": results[0]["topk"], "dcp_topk_rows_differ": differ.nonzero().flatten(),
                "dcp_topk_other": other}

    def merged(self, s: StepInputs, results: list[dict]):
        """What every rank left, as the undivided step's observation: each layer's output (the ranks' heads side by
        side), the ranks' top-k rows (`topk_rows`), the index cache and the MLA entries of the step's slots read
        back from the ranks that hold them. Returns (outputs, overruns, cache changes)."""
        case, n = s.case, s.case.num_tokens
        out = {"topk_before": results[0]["topk_before"], **self.topk_rows(s, results),
               "index_cache": undivided_index_cache(case, [res["index_kv"] for res in results])}
        for i, (ls, li) in enumerate(zip(s.layer_steps, s.layer_inputs)):
            name = "out" if i == 0 else "out_skip_topk"
            o = torch.cat([res["outs"][i] for res in results], dim=1)  # [rows, ranks x heads x 128]
            out[name], out[name + "_padded"] = o[:n], o[n:]
            slots = torch.unique(torch.cat([li.attention.slot_of[q] for q in range(len(ls.requests))])).to(o.device)
            owner, local = rank_slots(case, slots)
            entries = torch.empty(len(slots), results[0]["caches"][i].shape[-1], dtype=torch.uint8, device=o.device)
            for r, res in enumerate(results):
                sel = owner == r
                entries[sel] = res["caches"][i][local[sel] // case.block_size, local[sel] % case.block_size]
            out[f"{name}.cache_slots"], out[f"{name}.cache_entries"] = slots, entries
        overruns = [m for res in results for m in res["overruns"]]
        changed = [f"rank {r} layer {i}: {c}" for r, res in enumerate(results) for i, c in enumerate(res["changed"]) if c]
        return out, overruns, changed


@dataclasses.dataclass
class RankState:
    """What one rank keeps for the trace: its buffers and caches, its engine (layers, builders) and route counts."""

    topk: torch.Tensor
    index_kv: torch.Tensor
    caches: list
    engine: dict = dataclasses.field(default_factory=dict)
    routes: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class StepInputs:
    """What every rank of a step shares: the DCP step, its undivided form and inputs, each layer's view and inputs."""

    case: object
    whole: object
    inp: object
    fresh: torch.Tensor  # undivided context slots no earlier step of the engine wrote
    fresh_keys: torch.Tensor  # their index keys
    layer_steps: list
    layer_inputs: list
    first: bool

    @classmethod
    def of(cls, k: int, step, whole, views: list, pool: torch.Tensor, index_written: torch.Tensor, device: str):
        """Step k of a trace: `whole` the indexer's undivided trace, `views` each layer's, `pool` the index keys by
        undivided slot, `index_written` the slots an earlier step of the engine wrote."""
        inp = materialize_indexer_inputs(whole.steps[k], pool)  # undivided slots (-1: padding tokens)
        fresh = inp.context_slots[~index_written[inp.context_slots]]
        layer_steps = [v.steps[k] for v in views]
        return cls(case=step, whole=whole.steps[k], inp=inp, fresh=fresh, fresh_keys=pool[fresh],
                   layer_steps=layer_steps, layer_inputs=[materialize_layer_inputs(s, device) for s in layer_steps],
                   first=k == 0)


def own_slots(case, undivided_slots: torch.Tensor, rank: int) -> torch.Tensor:
    """vLLM's slot mapping on `rank` for tokens at `undivided_slots`: the rank-local slot where the rank holds the
    token, -1 where another rank does or the token is padding (slot -1)."""
    local = rank_slot_mapping(case, undivided_slots.clamp(min=0), rank)
    return torch.where(undivided_slots >= 0, local, torch.full_like(local, -1))


def undivided_index_cache(case, rank_caches: list[torch.Tensor]) -> torch.Tensor:
    """The ranks' index caches as one cache of the undivided slots ([blocks, block_size x ranks, 132] uint8, block-
    major: the block's keys' 128 fp8 values, then their fp32 scales): each undivided slot's bytes copied from the
    rank and local slot that hold it, as they were written."""
    nb, block = rank_caches[0].shape[0], case.block_size
    virtual = block * case.dcp.size
    dev = rank_caches[0].device
    out = torch.empty(nb, virtual * ENTRY_BYTES, dtype=torch.uint8, device=dev)
    u = torch.arange(nb * virtual, device=dev)
    owner, local = rank_slots(case, u)
    values, scales = torch.arange(HEAD_DIM, device=dev), torch.arange(ENTRY_BYTES - HEAD_DIM, device=dev)
    for r, cache in enumerate(rank_caches):
        flat = cache.reshape(nb, block * ENTRY_BYTES)
        sel = owner == r
        us, ls = u[sel], local[sel]
        ub, uo, lb, lo = us // virtual, us % virtual, ls // block, ls % block
        out[ub[:, None], uo[:, None] * HEAD_DIM + values] = flat[lb[:, None], lo[:, None] * HEAD_DIM + values]
        out[ub[:, None], virtual * HEAD_DIM + uo[:, None] * 4 + scales] = \
            flat[lb[:, None], block * HEAD_DIM + lo[:, None] * 4 + scales]
    return out.view(nb, virtual, ENTRY_BYTES)
