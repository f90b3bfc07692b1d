"""`vllm.dsv32.attention.pcp_dcp`: DeepSeek-V3.2 / GLM-5's attention module (`DeepseekV32Attention`) with its real
indexer under prefill context parallelism (PCP) x DCP (x TP), every rank of the PCP x TP world emulated in one
process, over the steps of a trace.

Each rank is fed as `vllm.flashmla_sparse.layer.pcp_dcp` feeds it (`fuzzer.support.pcp_runtime`): vLLM's PCPManager
partitions the step (two head-tail chunk rows of every prefill long enough to split; under DCP decodes whole on
every PCP rank, without DCP each decode on one PCP rank: `pcp_shard_decode_requests`), DefaultModelState builds both
metadata (the indexer's and FLASHMLA_SPARSE's) on the rank's local batch and the PCP-converted slot mapping, and the
module's seam runs with vLLM's PCP code:
  * the indexer (`sparse_attn_indexer` with use_pcp): the step's index keys gathered over PCP and written by the
    indexer itself (`maybe_gather_indexer_k`, `indexer_k_quant_and_cache`: under PCP nothing writes them before the
    seam), prefill chunks planned over the DCP shards every PCP rank holds (`_split_pcp_dcp_prefill_chunks`,
    `build_pcp_global_chunk_plan`), the shards all-gathered and de-interleaved (`dcp_gather_kv_rows`) before the
    logits, decodes over the rank's shard and merged over DCP (`_merge_dcp_topk_global`);
  * the MLA layer: the PCP-gathered cache write (`maybe_gather_mla_latent_cache_inputs`), the TP query gather where
    DCP spans more ranks than PCP, `forward_mqa` (prefill rows over the DCP-gathered KV, decode rows over the shard,
    merged by LSE), `finalize_mla_pcp_decode`, W_UV; PCPManager's restore puts the rows back in batch order.
Each world rank holds its own index cache and MLA caches (its DCP rank's shard), top-k buffer and engine.

Judged as the undivided module (`oracles/dsv32.py` `judge_dsv32_dcp`, as `vllm.dsv32.attention.dcp`): the top-k
rows of the batch's tokens (each from the PCP rank that holds it) from the index cache's bytes as the ranks wrote
them, every rank's copy of a row alike, each layer's restored output (the TP ranks' heads side by side) against the
fp32 reference over the whole context, the fp8_ds_mla entries the ranks wrote. Layouts: PCP x DCP (x TP), and PCP
without DCP (every rank a whole cache replica; decodes sharded over the PCP ranks; dense-MHA prefill allowed, which
vLLM's builder turns off under PCP + DCP). Not driven: CUDA-graph padding (the steps run eager), the direct DCP
collectives.
"""

from __future__ import annotations

import importlib

import torch

from fuzzer.env import STATE_DIR
from fuzzer.support import dcp_group, pcp_runtime
from fuzzer.support.dcp_steps import direct_dcp_off, layer_cache_writer, on_pcp_ranks, rank_heads
from fuzzer.support.dsv32_runtime import clear_topk_rows
from fuzzer.support.vllm_setup import guard_index_group
from fuzzer.support.indexer_runtime import (
    BUILDER_MODULE,
    INDEXER_MODULE,
    index_cache,
    indexer_config,
    logits_budget,
    write_index_keys,
)
from fuzzer.support.sparse_mla_steps import mla_spec, uninitialized_memory_as_nan
from fuzzer.targets.base import WHOLE, RunPlan
from fuzzer.targets.dsv32_attention import EMULATED as MODULE_EMULATED
from fuzzer.targets.dsv32_attention import engines_ended
from fuzzer.targets.dsv32_attention_dcp import (
    COLLECTIVES,
    INTERPRETED_COMBINE_ROWS,
    Dsv32AttentionDcp,
    RankState,
    StepInputs,
    own_slots,
    undivided_index_cache,
)
from fuzzer.targets.flashmla_layer_pcp import EMULATED as PCP_EMULATED
from fuzzer.targets.flashmla_layer_pcp import fp8_scales
from fuzzer.targets.harness import index_trace_step, max_batched_tokens, topk_buffer_for, trace_observation
from fuzzer.targets.indexer import Indexer
from oracles.dcp import rank_slots
from oracles.dsv32 import undivided_trace
from strategies.case import pcp_splits
from strategies.indexer_batches import attention_module_pcp_space
from strategies.indexer_tensors import attention_view, key_pool
from strategies.tensors import written_slots

# Under PCP the seam's callers write nothing before it: the index keys and MLA entries of the step are the seam's.
EMULATED = (MODULE_EMULATED[0].replace("the MLA cache write (concat_and_cache_mla), the index K-cache write "
                                       "(indexer_k_quant_and_cache) and ", ""),)


class Dsv32AttentionPcp(Dsv32AttentionDcp):
    name = "vllm.dsv32.attention.pcp_dcp"
    summary = ("DeepSeek-V3.2/GLM-5 attention module under PCP x DCP, every rank emulated in one process, fed by "
               "vLLM's PCPManager: the real indexer (index K gathered over PCP, DCP-gathered prefill chunks, DCP "
               "merge) feeding FLASHMLA_SPARSE (PCP cache write, gathered-KV prefill, LSE merge), skip_topk, traces")
    bug_classes = "A C D G H I J"
    real_parts = (*Dsv32AttentionDcp.real_parts,
                  "PCPManager.partition_batch / _convert_to_gathered_slot_mappings / restore_hidden_states",
                  "DefaultModelState.prepare_attn (the rank's CommonAttentionMetadata, both builders)",
                  ("the indexer's PCP path (maybe_gather_indexer_k, _split_pcp_dcp_prefill_chunks, "
                   "build_pcp_global_chunk_plan, dcp_gather_kv_rows)"),
                  "the module's PCP path (maybe_gather_mla_latent_cache_inputs, TP query gather, finalize_mla_pcp_decode)")
    cudagraph_modes = ("none",)  # the PCP runner's steps here are eager

    def unavailable(self) -> str | None:
        return super().unavailable() or pcp_runtime.missing()

    def prepare(self) -> None:
        direct_dcp_off()
        super().prepare()
        builder = importlib.import_module(BUILDER_MODULE)
        if self.device == "cpu" and builder.PIN_MEMORY:  # the PCP chunk plan's host tensors (no pinned memory here)
            builder.PIN_MEMORY = False
            self.shims = (*self.shims, f"PIN_MEMORY=False where {BUILDER_MODULE} bound it (build_pcp_global_chunk_plan)")
        indexer = importlib.import_module(INDEXER_MODULE)
        if not getattr(indexer.dist, "attnfuzz_emulated", False):  # dcp_gather_kv_rows' all-gather on the emulated group
            indexer.dist = dcp_group.emulated_dist()
            indexer.dist.attnfuzz_emulated = True
        self.shims = (*self.shims, f"{INDEXER_MODULE}.dist: torch.distributed with all_gather_into_tensor routed to "
                      "attnfuzz's emulated groups (dcp_gather_kv_rows)")

    def cases(self, profile, plan: RunPlan = WHOLE):
        # As the DCP module's: on a CPU the LSE combine is interpreted, so steps are cut to 768 combine rows a layer
        # over the whole world.
        return attention_module_pcp_space(profile, profile.attn_heads,
                                          combine_rows=INTERPRETED_COMBINE_ROWS if self.device == "cpu" else None)

    def run_trace(self, case):  # run by Dsv32Attention.run, under the case's scheduled SMs
        dev, x, d = self.device, case.indexer, case.dcp
        heads, world = x.attention_heads, d.pcp * d.tp
        whole = undivided_trace(case, heads=False)
        layers = 2 if x.skip_topk_layer else 1
        views = [undivided_trace(attention_view(case, i), heads=True) for i in range(layers)]  # every TP rank's heads
        pool = key_pool(whole, dev)
        cfg = indexer_config(dev, str(STATE_DIR), case, max_num_batched_tokens=max_batched_tokens(case))
        cfg.model_config.get_num_attention_heads = lambda parallel_config=None: heads
        context_write, write_emulated = self.writer(attention_view(case))
        write = layer_cache_writer(dev, fp8_scales(attention_view(case)))  # what the layer writes with under PCP
        ranks, groups = pcp_runtime.emulated_world(d.pcp, d.tp, d.size, cfg, dev)
        state = [RankState(topk=topk_buffer_for(case, dev),
                           index_kv=index_cache(case.pool_blocks, case.block_size, dev),
                           caches=[self.cache(attention_view(case, i), dev) for i in range(layers)])
                 for _ in range(world)]
        emulated = tuple(dict.fromkeys(e for e in (*self.emulated, write_emulated, *EMULATED, *PCP_EMULATED,
                                                     COLLECTIVES) if e))
        index_written = torch.zeros(pool.shape[0], dtype=torch.bool, device=dev)
        observed = []
        with engines_ended([st.engine for st in state]):
            for k, step in enumerate(steps := case.steps):
                reqs = step.requests
                batch = pcp_runtime.global_batch([r.query_len for r in reqs], [r.context_len for r in reqs],
                                                 [i >= step.num_decodes for i in range(len(reqs))], dev)
                shared = dict(vars(StepInputs.of(k, step, whole, views, pool, index_written, dev)), batch=batch,
                              write=context_write)

                def call(shared=shared):
                    with logits_budget(shared["case"].indexer.max_logits_mb), uninitialized_memory_as_nan():
                        results = on_pcp_ranks(cfg, ranks, groups, d.pcp, d.tp, write,
                                               lambda w: self.pcp_rank_step(w, state[w], cfg, groups, shared))
                    return self.pcp_merged(shared, results, groups)

                split = [pcp_splits(r.query_len, d.pcp, d.size) for r in reqs[step.num_decodes:]]
                obs = self.observe_step(call, lambda: state[0].routes, notes={
                    "pcp": f"PCP {d.pcp} x TP {d.tp} ranks emulated in one process, DCP {d.size}, interleave "
                           f"{d.interleave}, {heads} heads a rank",
                    "pcp_paths": {"pcp_prefill_split": any(split), "pcp_prefill_whole": not all(split),
                                  "decode": step.num_decodes > 0,
                                  "decode_sharded": step.num_decodes > 0 and d.size == 1,  # pcp_shard_decode_requests
                                  "mtp": x.num_speculative_tokens > 0, "skip_topk": bool(x.skip_topk_layer),
                                  "dcp_merge": d.size > 1}})
                if "mha_rows" in obs.outputs:  # every rank's dense-MHA rows, not rank 0's alone
                    obs.notes["route"] = dict(obs.notes["route"], mha_tokens=int(obs.outputs["mha_rows"].sum()))
                if index_trace_step(observed, obs, step, shared["inp"], index_written, emulated, self.shims):
                    break
        return trace_observation(observed)

    def pcp_rank_step(self, w: int, st: RankState, cfg, groups, s: dict) -> dict:
        """World rank w's step, on its thread: the context no earlier step wrote put in its caches (its DCP rank's
        shard), vLLM's PCP partition of the step, both builders' metadata from DefaultModelState on its local batch,
        then each layer's `_sparse_indexer_and_attn` on its rows (the layer and the indexer write the step's
        tokens), and PCPManager's restore."""
        from vllm.config import set_current_vllm_config

        dev, case, inp = self.device, s["case"], s["inp"]
        d, h = case.dcp, case.indexer.attention_heads
        p, t = divmod(w, d.tp)
        r = groups["_DCP"].rank_in_group
        if not st.engine:
            self.new_pcp_rank_engine(t, st, cfg, case, s["layer_inputs"])
        with set_current_vllm_config(cfg), torch.inference_mode():
            fresh = own_slots(case, s["fresh"], r)
            if bool((fresh >= 0).any()):
                write_index_keys(s["fresh_keys"][fresh >= 0], st.index_kv, fresh[fresh >= 0])
            news = []
            for ls, li, cache in zip(s["layer_steps"], s["layer_inputs"], st.caches):
                new = torch.cat([li.attention.slot_of[q][req.context_len:] for q, req in enumerate(ls.requests)]).to(dev)
                news.append(new)
                ctx = written_slots(ls).to(dev)
                ctx = ctx[~torch.isin(ctx, new)]  # the context no earlier step wrote
                local = own_slots(case, ctx, r)
                keep = local >= 0
                if bool(keep.any()):  # an empty write is not launched
                    s["write"](li.attention.kv_c[ctx[keep]], li.attention.k_pe[ctx[keep]], cache, local[keep])
            manager, local = pcp_runtime.rank_batch(s["batch"], d.pcp, p, d.size, r, d.interleave, dev)
            rows = manager._local_gather_idx  # the batch token of each of the rank's rows (padding rows: token 0)
            n = local.num_tokens
            clear_topk_rows(st.topk, len(rows))
            before = st.topk.clone()
            for route in st.routes:
                route.clear()
                route.update(mqa_tokens=0, mha_tokens=0)
            check_overrun = guard_index_group(st.engine["layers"][0].impl, poison=s["first"])
            block_table = Indexer.common_metadata(s["whole"], inp, dev).block_table_tensor
            slot_mapping = pcp_runtime.rank_slot_mapping(manager, own_slots(case, inp.slots, r))
            index_md = pcp_runtime.rank_metadata(cfg, st.engine["indexer_builder"], st.engine["indexer_backend"],
                                                 st.engine["indexer_spec"], local, block_table, slot_mapping)
            mla_md = pcp_runtime.rank_metadata(cfg, st.engine["mla_builder"], self.backend, st.engine["mla_spec"],
                                               local, block_table, slot_mapping)
            outs = []
            for layer, li, new in zip(st.engine["layers"], s["layer_inputs"], news):
                outs += pcp_runtime.module_forward(
                    [layer], cfg, local, mla_md, index_md, slot_mapping, rank_heads(li.q[rows], h, t),
                    li.attention.kv_c[new][rows], li.attention.k_pe[new][rows], inp.q_fp8[rows], inp.k[rows],
                    inp.weights[rows])
            restored = [manager.restore_hidden_states(o) for o in outs]
            overruns = [f"rank {w}: {m}" for m in check_overrun(st.routes[0]["mqa_tokens"])]
            # forward_impl's dense-MHA rows are the rank's last ones; each reads its local request's positions
            # before the request's first (the chunk's start) from the cache
            own_from = torch.repeat_interleave(torch.as_tensor(local.num_computed_tokens_np[:local.num_reqs]).long(),
                                               torch.as_tensor(local.num_scheduled_tokens[:local.num_reqs]).long())
        return {"restored": [o.clone() for o in restored], "topk": st.topk.clone(), "topk_before": before,
                "rows": rows[:n].clone(), "index_kv": st.index_kv.clone(), "caches": [c.clone() for c in st.caches],
                "overruns": overruns, "local": dict(rows=len(rows), tokens=n, requests=local.num_reqs),
                "mha": min(st.routes[0]["mha_tokens"], n), "own_from": own_from}

    def new_pcp_rank_engine(self, t: int, st: RankState, cfg, case, layer_inputs) -> None:
        """World rank (., t)'s engine: the DCP module's (its TP rank's heads, kv_b_proj outside TP), plus what
        DefaultModelState.prepare_attn takes for each builder (its backend and KV-cache spec)."""
        from vllm.config import set_current_vllm_config
        from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend

        self.new_rank_engine(t, st, cfg, case, layer_inputs, disable_tp=True)
        with set_current_vllm_config(cfg):
            st.engine["indexer_spec"] = st.engine["layers"][0].indexer.k_cache.get_kv_cache_spec(cfg)
        st.engine["mla_spec"] = mla_spec(case.block_size, "fp8_ds_mla")
        st.engine["indexer_backend"] = DeepseekV32IndexerBackend

    def pcp_merged(self, s: dict, results: list[dict], groups):
        """What every rank left, as the undivided step's observation: each layer's restored output (the TP ranks'
        heads side by side), the top-k rows of the batch's tokens (each from the first rank holding it; rows two
        ranks of one DCP group hold differently named), the index cache and the MLA entries read back from each DCP rank's first
        world rank. Returns (outputs, overruns, cache changes)."""
        case, n = s["case"], s["case"].num_tokens
        d = case.dcp
        rows, width = case.num_actual_tokens, case.topk_width
        topk, before = results[0]["topk"].clone(), results[0]["topk_before"].clone()
        seen = torch.zeros(rows, dtype=torch.bool, device=topk.device)
        differ = torch.zeros(rows, dtype=torch.bool, device=topk.device)
        other = topk.clone()  # the same, each differing row as the rank that differs has it
        # Ranks must agree on a decode token's row within its DCP group: they attend over shards of one context and
        # merge by LSE, and the indexer merges their top-k (`_merge_dcp_topk_global`) so that they do. A prefill row
        # under PCP + DCP each rank ranks over the whole gathered context and attends over the DCP-gathered KV with
        # it (flashmla_sparse: `pcp_dcp_kv_gather`), and TP peers sit in other DCP groups (DCP spans PCP first): a
        # tie taken otherwise there is the rank's own, and its heads are judged with its own rows (`topk_by_tp`).
        merged = torch.arange(rows, device=topk.device) < case.num_decode_tokens
        group_seen, group_rows = {}, {}
        by_tp = [(torch.zeros(rows, dtype=torch.bool, device=topk.device), topk.clone()) for _ in range(d.tp)]
        for w, res in enumerate(results):
            tok = res["rows"].to(topk.device)
            mine = res["topk"][:len(tok)]
            g = tuple(groups["_DCP"]._group_of[w])
            held = group_seen.setdefault(g, torch.zeros(rows, dtype=torch.bool, device=topk.device))
            ref = group_rows.setdefault(g, torch.empty_like(topk))
            again = tok[held[tok]]
            # as sets: the top-k kernels promise no order within a row
            these = (ref[again, :width].sort(dim=1).values != mine[held[tok]][:, :width].sort(dim=1).values).any(dim=1)
            these &= merged[again]
            other[again[these & ~differ[again]]] = mine[held[tok]][these & ~differ[again]]
            differ[again] |= these
            ref[tok[~held[tok]]] = mine[~held[tok]]
            held[tok] = True
            tp_held, tp_rows = by_tp[w % d.tp]  # world rank = PCP rank x TP + TP rank
            tp_rows[tok[~tp_held[tok]]] = mine[~tp_held[tok]]
            tp_held[tok] = True
            first = tok[~seen[tok]]
            topk[first] = other[first] = mine[~seen[tok]]
            before[first] = res["topk_before"][:len(tok)][~seen[tok]]
            seen[tok] = True
        first_of = {}
        for w in range(len(results)):
            first_of.setdefault(groups["_DCP"]._group_of[w].index(w), w)
        out = {"topk_indices_buffer": topk, "topk_before": before, "dcp_topk_rows_differ": differ.nonzero().flatten(),
               "dcp_topk_other": other, "topk_by_tp": torch.stack([r for _, r in by_tp]),
               "index_cache": undivided_index_cache(case, [results[first_of[r]]["index_kv"] for r in range(d.size)])}
        mha_rows, own_from = torch.zeros(n, dtype=torch.bool), torch.zeros(n, dtype=torch.long)
        for res in results:  # each batch token's dense-MHA route, from the ranks that ran it
            tok = res["rows"].cpu()
            mha_rows[tok[len(tok) - res["mha"]:]] = True
            own_from[tok] = res["own_from"][:len(tok)]
        out["mha_rows"], out["mha_own_from"] = mha_rows, own_from
        for i, (ls, li) in enumerate(zip(s["layer_steps"], s["layer_inputs"])):
            name = "out" if i == 0 else "out_skip_topk"
            o = torch.cat([results[t]["restored"][i] for t in range(d.tp)], dim=1)
            out[name], out[name + "_padded"] = o[:n], o[n:]
            slots = torch.unique(torch.cat([li.attention.slot_of[q] for q in range(len(ls.requests))])).to(o.device)
            owner, local = rank_slots(case, slots)
            entries = torch.empty(len(slots), results[0]["caches"][i].shape[-1], dtype=torch.uint8, device=o.device)
            for r in range(d.size):
                sel = owner == r
                cache = results[first_of[r]]["caches"][i]
                entries[sel] = cache[local[sel] // case.block_size, local[sel] % case.block_size]
            out[f"{name}.cache_slots"], out[f"{name}.cache_entries"] = slots, entries
            differ = torch.zeros(len(slots), dtype=torch.bool, device=o.device)
            for w, res in enumerate(results):  # every world rank of a DCP rank holds its shard alike (PCP alone: all)
                sel = owner == groups["_DCP"]._group_of[w].index(w)
                held = res["caches"][i][local[sel] // case.block_size, local[sel] % case.block_size]
                differ[sel] |= (held.view(torch.uint8) != entries[sel]).any(dim=-1)
            out[f"{name}.replica_slots_differ"] = slots[differ]
        overruns = [m for res in results for m in res["overruns"]]
        return out, overruns, []
