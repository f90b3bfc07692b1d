"""`vllm.flashmla_sparse.layer.pcp_dcp`: FLASHMLA_SPARSE under prefill context parallelism (PCP) with decode
context parallelism (DCP), the layer on every rank of the PCP x TP world, emulated in one process.

vLLM 0.33's FlashMLA sparse backend attends a PCP rank's prefill rows over the DCP-gathered KV
(`pcp_dcp_kv_gather`): each rank upconverts its fp8_ds_mla shard of every prefill request's context into a
workspace of `dcp_local_seq_lens_cpu_upper_bound` rows (the largest shard, alike on every rank), all-gathers the
shards over the DCP group (`_gather_prefill_chunk`) and maps its rows' top-k onto the rank-major result; the
builder groups a rank's two head-tail chunk rows of a request into one workspace entry
(`gathered_prefill_shards`). Decode rows attend over the rank's own shard and merge by LSE over DCP.

Each rank is fed as the model runner feeds it (`fuzzer.support.pcp_runtime`): vLLM's PCPManager partitions the
step, DefaultModelState builds the metadata, DeepSeek-V3.2's attention layer (the one that supports PCP + DCP)
writes the PCP-gathered new tokens into the rank's cache (which holds its DCP shard of the context) and attends,
and PCPManager restores the outputs to batch order. The TP ranks' heads side by side are judged as the layer
over the undivided context (`oracles.dcp.judge_layer_pcp`), every rank's own rows too, and the fp8 entries the
layer wrote.
"""

from __future__ import annotations

import dataclasses
import importlib

import torch

from fuzzer.repro_spec import Call, Judge, ReproSpec
from fuzzer.support import pcp_runtime
from fuzzer.support.dcp_steps import (
    direct_dcp_off,
    layer_cache_writer,
    on_pcp_ranks,
    pcp_rank_engine,
    pcp_rank_metadata,
    pcp_rank_topk,
    rank_heads,
    rank_kv_b_weight,
    replay_pcp_ranks,
)
from fuzzer.support.vllm_setup import configure, guard_index_group
from fuzzer.support.sparse_mla_steps import mla_spec
from fuzzer.targets.base import WHOLE, RunPlan
from fuzzer.targets.flashmla_dcp import FlashMLASparseDcp, dcp_cache_args, dcp_setup
from fuzzer.targets.flashmla_layer import FlashMLASparseLayer
from fuzzer.targets.guards import Guards
from fuzzer.targets.harness import step_tensors
from fuzzer.targets.probes import observe_paths
from oracles.attention_judge import judge_fp8_ds_mla_entries, layer_reference_for, layer_tolerance
from oracles.dcp import judge_layer_pcp, rank_slot_mapping, rank_slots, undivided
from strategies.batches import PCP_LAYOUTS, AttentionFeatures, attention_space
from strategies.tensors import V_HEAD, materialize_layer_inputs

ROUTES = "every token -> forward_mqa (PCP + DCP has no dense MHA): prefill rows over the DCP-gathered KV"
EMULATED = ("PCP / DCP / TP collectives (attnfuzz's in-process groups)",
            "the runner's InputBatch of the step (attnfuzz's, from the case) and the global batch's slot mapping "
            "(BlockTables.compute_slot_mappings: the same DCP rule, computed by attnfuzz)")


class FlashMLASparseLayerPcp(FlashMLASparseLayer):
    name = "vllm.flashmla_sparse.layer.pcp_dcp"
    summary = ("FLASHMLA_SPARSE under PCP x DCP, every rank's layer emulated in one process, fed by vLLM's PCPManager: "
               "prefill rows over the DCP-gathered KV, decode rows merged by LSE")
    bug_classes = "A B C G I J"
    oracle = staticmethod(judge_layer_pcp)
    kv_cache_dtypes = ("fp8_ds_mla",)  # vLLM's PCP + DCP prefill gathers through the fp8_ds_mla upconvert only
    real_parts = ("PCPManager.partition_batch / _convert_to_gathered_slot_mappings / restore_hidden_states",
                  "DefaultModelState.prepare_attn (the rank's CommonAttentionMetadata)",
                  "DeepseekV32Attention._sparse_indexer_and_attn (PCP cache-input gather, TP query gather, W_UV)",
                  "FlashMLASparseMetadataBuilder (gathered_prefill_shards)",
                  "FlashMLASparseImpl.forward_mqa (fp8 separate path, _gather_prefill_chunk)",
                  "MLADCPManager (LSE combine)", "the index-remap and DCP-filter Triton kernels")

    def unavailable(self) -> str | None:
        return super().unavailable() or FlashMLASparseDcp.needs_dcp_manager() or pcp_runtime.missing()

    def prepare(self) -> None:
        direct_dcp_off()  # no symmetric memory over emulated ranks (CUDA would probe for it)
        super().prepare()
        importlib.import_module(pcp_runtime.V32_ATTENTION)  # imported before the first case: its probes wrap it
        self.real_parts = type(self).real_parts + (("FlashMLA's CUDA kernels (vllm._flashmla_C)",)
                                                   if self.device == "cuda" else ())
        self.routes = ROUTES

    def cases(self, profile, plan: RunPlan = WHOLE):
        # Steps long enough that prefills split over the PCP ranks in chunks of a few tokens (a CPU case: 1-4 s).
        # Heads per rank: the profile's and 64 (DeepSeek-V3.2 at TP 2); 128 (TP 1) where the profile draws it.
        heads = tuple(dict.fromkeys((*profile.attn_heads, 64)))
        profile = dataclasses.replace(profile, attn_max_tokens=max(profile.attn_max_tokens, 40))
        return attention_space(profile, AttentionFeatures(
            kv_cache_dtypes=plan.kv_dtypes(self), heads=heads, block_sizes=(64, 128),
            pcp_layouts=tuple(PCP_LAYOUTS), dcp_outside_envelope=True, block_stride_rows=False,
            indexer_fills_short_seqs=True, vllm_batch_order=True))

    def run(self, case):
        step = PcpStep(self, case)
        obs = observe_paths(self.observe, step.call, notes={
            "pcp": f"PCP {case.dcp.pcp} x TP {case.dcp.tp} ranks emulated in one process, DCP {case.dcp.size}, "
                   f"interleave {case.dcp.interleave}"})
        return step.finish(obs)

    def repro_spec(self, finding) -> ReproSpec:
        return pcp_repro(self, finding)


@dataclasses.dataclass
class PcpRankResult:
    """What one rank's step leaves, as CPU tensors."""

    restored: torch.Tensor | None = None  # the step's output in batch order (PCPManager.restore_hidden_states)
    rows: torch.Tensor | None = None  # the rank's own rows [n, H * 128]
    tokens: torch.Tensor | None = None  # the batch token of each of its rows
    entries: torch.Tensor | None = None  # the fp8 entries of the undivided slots its DCP rank holds, after the call
    local: dict = dataclasses.field(default_factory=dict)  # the rank's batch: rows, tokens, decodes, prefills
    route: dict = dataclasses.field(default_factory=dict)
    cache_changed: int = 0  # cache rows the attention changed after the layer's write
    problems: dict[str, list[str]] = dataclasses.field(default_factory=dict)


class PcpStep:
    """One case on every rank of the PCP x TP world (world rank w = pcp_rank * TP + tp_rank, as vLLM lays them)."""

    def __init__(self, target: FlashMLASparseLayerPcp, case) -> None:
        self.target, self.case, dev = target, case, target.device
        d = case.dcp
        self.whole = whole = undivided(case)
        self.layer_inputs = materialize_layer_inputs(whole, dev)
        inp = self.inputs = self.layer_inputs.attention
        _, self.slots, self.topk_all = step_tensors(whole, dev, inp)
        self.write, self.write_emulated = target.writer(case)
        self.cfg = configure(target.cfg, case, max_num_batched_tokens=self.topk_all.shape[0])
        self.spec = mla_spec(case.block_size, case.kv_cache_dtype)
        # On the device, as the runner's slot mappings are: vLLM's writer and PCP conversion index with them.
        self.new_slots = _cat([inp.slot_of[i][r.context_len:] for i, r in enumerate(whole.requests)]).to(dev)
        self.context_slots = _cat([inp.slot_of[i][:r.context_len] for i, r in enumerate(whole.requests)]).to(dev)
        self.batch = pcp_runtime.global_batch([r.query_len for r in case.requests], [r.context_len for r in case.requests],
                                              [i >= case.num_decodes for i in range(len(case.requests))], dev)
        self.ranks, self.groups = pcp_runtime.emulated_world(d.pcp, d.tp, d.size, self.cfg, dev)
        self.results: list[PcpRankResult] = []

    def call(self) -> dict:
        d = self.case.dcp
        write = layer_cache_writer(self.target.device, fp8_scales(self.case))  # what the layer writes with
        self.results = on_pcp_ranks(self.cfg, self.ranks, self.groups, d.pcp, d.tp, write, self.run_rank)
        return self.outputs()

    def run_rank(self, w: int) -> PcpRankResult:
        from vllm.config import set_current_vllm_config

        case, inp, cfg, dev = self.case, self.inputs, self.cfg, self.target.device
        d, heads, backend = case.dcp, case.heads, self.target.backend
        p, t = divmod(w, d.tp)
        dcp_rank = self.groups["_DCP"].rank_in_group
        res, guards = PcpRankResult(), Guards()
        cache = self.target.cache(case, dev, guards, name=f"kv_cache (rank {w})")
        with set_current_vllm_config(cfg), torch.inference_mode():
            # The cache holds the rank's DCP shard of the context (what earlier steps wrote); the layer writes
            # the step's own tokens. No context, no write: the runner never writes none, and vLLM's writer
            # launches a grid of one block per token with no launch check (an empty grid's launch error would
            # surface at the next launch; bench/cache_ops_check.py's 0-token row checks the real op).
            if len(self.context_slots):
                self.write(inp.kv_c[self.context_slots], inp.k_pe[self.context_slots], cache,
                           rank_slot_mapping(case, self.context_slots, dcp_rank))
            manager, local = pcp_runtime.rank_batch(self.batch, d.pcp, p, d.size, dcp_rank, d.interleave, dev)
            shape = self.topk_all.shape
            topk_buffer = guards.empty(f"topk_indices_buffer (rank {w})", shape.numel(), torch.int32, dev).view(shape)
            rows = pcp_rank_topk(topk_buffer, self.topk_all, manager, local)  # the batch token of each of its rows
            n = local.num_tokens
            res.local = dict(rows=len(rows), tokens=n, requests=local.num_reqs,
                             prefilling=int(local.is_prefilling_np[:local.num_reqs].sum()))
            builder, layer, res.route = pcp_rank_engine(
                backend, self.spec, cfg, heads, rank_kv_b_weight(self.layer_inputs.kv_b_weight, heads, t), topk_buffer, dev)
            written: list = []
            update = layer.impl.do_kv_cache_update

            def write_then_snapshot(*args, **kwargs):  # attention after the layer's own write must leave the cache
                update(*args, **kwargs)
                written.append(cache.clone())

            layer.impl.do_kv_cache_update = write_then_snapshot
            slot_mapping, metadata = pcp_rank_metadata(cfg, builder, backend, self.spec, manager, local, inp.index.block_table,
                                                       rank_slot_mapping(case, self.new_slots, dcp_rank))
            width = heads * V_HEAD
            output = guards.empty(f"output (rank {w})", len(rows) * width, torch.bfloat16, dev).view(len(rows), width)
            output.fill_(float("nan"))
            q = rank_heads(self.layer_inputs.q[rows], heads, t)
            check_overrun = guard_index_group(layer.impl)
            before = cache.clone()
            pcp_runtime.forward(layer, cfg, local, metadata, slot_mapping, cache, q, inp.kv_c[self.new_slots][rows],
                                inp.k_pe[self.new_slots][rows], output)
            res.rows, res.tokens = output[:n].detach().cpu(), rows[:n].cpu()
            res.restored = manager.restore_hidden_states(output).detach().cpu()  # PCP all-gather, batch order
            if overruns := [f"rank {w}: {m}" for m in check_overrun(res.route.get("mqa_tokens", 0))]:
                res.problems["buffer_overrun"] = overruns
        if dev == "cuda":
            torch.cuda.synchronize()
        owner, rslot = rank_slots(case, self.slots)
        mine = rslot[owner == dcp_rank]
        res.entries = cache[mine // case.block_size, mine % case.block_size].cpu()
        ref = written[-1] if written else before
        res.cache_changed = int((cache.view(torch.uint8) != ref.view(torch.uint8)).any(dim=-1).sum())
        if guard := guards.check():
            res.problems["guard"] = [f"rank {w}: {g}" for g in guard]
        return res

    def outputs(self) -> dict:
        """The step's output in batch order, the TP ranks' heads side by side (each TP rank's PCP rank 0 restored
        it); every rank's own rows; the fp8 entries of the undivided slots, each from its DCP rank."""
        d, results = self.case.dcp, self.results
        out = {"out": torch.cat([results[t].restored for t in range(d.tp)], dim=1)}
        out["rank_rows"] = torch.cat([r.rows for r in results])
        out["rank_row_tokens"] = torch.cat([r.tokens for r in results])
        out["rank_row_tp"] = torch.cat([torch.full((len(r.tokens),), w % d.tp) for w, r in enumerate(results)])
        out["rank_row_ranks"] = torch.cat([torch.full((len(r.tokens),), w) for w, r in enumerate(results)])
        owner, _ = rank_slots(self.case, self.slots)
        first = {}
        for w in range(len(results)):  # each DCP rank's entries from its first world rank
            first.setdefault(self.groups["_DCP"]._group_of[w].index(w), w)
        entries = torch.empty(len(self.slots), results[0].entries.shape[-1], dtype=results[0].entries.dtype)
        for r, w in first.items():
            entries[(owner == r).cpu()] = results[w].entries
        out["cache_slots"], out["cache_entries"] = self.slots.cpu(), entries
        return out

    def finish(self, obs):
        results, t = self.results, self.target
        if results:
            obs.notes["route"] = dict(results[0].route, mha_tokens=0)
            obs.notes["rank_batches"] = [r.local for r in results]
        if changed := [f"rank {w}: {r.cache_changed} rows" for w, r in enumerate(results) if r.cache_changed]:
            obs.notes["cache_changed"] = ", ".join(changed)
        for key in ("buffer_overrun", "guard"):
            if found := [m for r in results for m in r.problems.get(key, [])]:
                obs.notes[key] = found
        obs.notes["layer_routes"] = ROUTES
        obs.emulated = tuple(dict.fromkeys(x for x in (*t.emulated, self.write_emulated, *EMULATED) if x))
        obs.notes["shims"] = t.shims
        return obs


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def pcp_repro(target, finding) -> ReproSpec:
    """Every rank of the PCP x TP world in one process, as `run` emulates them: each rank's cache holding its
    DCP shard of the context as the writer left it, vLLM's PCPManager partitioning the step, DefaultModelState's
    metadata, DeepSeek-V3.2's attention layer on its heads (it writes the step's tokens itself), and
    PCPManager's restore, over attnfuzz's in-process groups. Judged: the restored output, the TP ranks' heads
    side by side, against the layer's fp32 reference over the undivided context."""
    case, dev = finding.case, finding.host.device
    cpu, d = dev == "cpu", case.dcp
    whole = undivided(case)
    layer_inputs = materialize_layer_inputs(whole, dev)
    inp = layer_inputs.attention
    _, slots, topk_buffer = step_tensors(whole, dev, inp)
    write, _ = target.writer(case)
    new = _cat([inp.slot_of[i][r.context_len:] for i, r in enumerate(whole.requests)]).to(dev)
    context = _cat([inp.slot_of[i][:r.context_len] for i, r in enumerate(whole.requests)]).to(dev)
    cache_u = target.cache(whole, dev)  # every slot as the layer leaves it: what the reference reads
    write(inp.kv_c[slots], inp.k_pe[slots], cache_u, slots)
    slot_values, _ = judge_fp8_ds_mla_entries(whole, inp, slots, cache_u[slots // whole.block_size,
                                                                        slots % whole.block_size])
    expected, _ = layer_reference_for(whole, layer_inputs, dev, slot_values)
    atol, rtol = layer_tolerance(whole, layer_inputs)
    tensors = dict(topk_indices_buffer=topk_buffer, block_table=inp.index.block_table, q=layer_inputs.q, kv_b_weight=layer_inputs.kv_b_weight,
                   kv_c_new=inp.kv_c[new], k_pe_new=inp.k_pe[new], expected_out=expected)
    for r in range(d.size):  # each DCP rank's cache (its shard of the context) and global slot mapping
        cache = target.cache(case, dev)
        if len(context):
            write(inp.kv_c[context], inp.k_pe[context], cache, rank_slot_mapping(case, context, r))
        width = cache.shape[-1]
        tensors[f"kv_cache_rows.dcp{r}"] = cache.as_strided((case.num_blocks * case.stride_rows, width), (width, 1))
        tensors[f"slot_mapping.dcp{r}"] = rank_slot_mapping(case, new, r)
    replay = Call(replay_pcp_ranks, dict(backend="backend", spec="spec", cfg="cfg", T="T", batch="batch", pcp="PCP",
                                         tp="TP", dcp_size="DCP_SIZE", interleave="INTERLEAVE", heads="HEADS",
                                         **dcp_cache_args(), write="write", device="DEVICE", found="found"),
                  assign="out, route", note="every rank of the PCP x TP world, emulated in one process")
    return ReproSpec(
        about=f"Shrunk case: {case.summary()}; {case.heads} heads per rank, fp8_ds_mla, values {case.values}.\n"
              "Inputs in tensors.safetensors beside this file; the expected output is attnfuzz's fp32 oracle of "
              "the layer (after W_UV) over the undivided context.",
        constants=dict(PCP=d.pcp, TP=d.tp, DCP_SIZE=d.size, INTERLEAVE=d.interleave, HEADS=case.heads,
                       KV_CACHE_DTYPE=case.kv_cache_dtype, TOPK_WIDTH=case.topk_width, TOPK_ROWS=topk_buffer.shape[0],
                       BLOCK_SIZE=case.block_size, BLOCK_STRIDE_ROWS=case.stride_rows, NUM_BLOCKS=case.num_blocks,
                       QUERY_LENS=[r.query_len for r in case.requests],
                       CONTEXT_LENS=[r.context_len for r in case.requests],
                       IS_PREFILLING=[i >= case.num_decodes for i in range(len(case.requests))],
                       FP8_SCALES=fp8_scales(case), ATOL=atol, RTOL=rtol, LSE_TOL=0.0),
        tensors=tensors,
        prepare=(Call(direct_dcp_off), *target.repro_prepare(layer=True)),
        setup=(*dcp_setup(target, metadata=False),
               Call(pcp_runtime.global_batch, dict(query_lens="QUERY_LENS", context_lens="CONTEXT_LENS",
                                                   is_prefilling="IS_PREFILLING", device="DEVICE"), assign="batch",
                    note="the scheduled step, before vLLM's PCP partitions it"),
               Call(layer_cache_writer, dict(device="DEVICE", fp8_scales="FP8_SCALES"), assign="write",
                    note="the layer writes the step's tokens through it (None: vLLM's own)")),
        call=(replay,),
        judge=Judge("dcp", dict(out="out", expected='T["expected_out"]', lses="{}", expected_lses="{}",
                                heads="HEADS", atol="ATOL", rtol="RTOL", lse_tol="LSE_TOL")),
        report={"emulated in one process:": 'f"PCP {PCP} x TP {TP} ranks, DCP {DCP_SIZE}, interleave {INTERLEAVE}"',
                "rank 0's routes:": "route", "stand-ins for ops this host lacks:": '", ".join(emulated) or "none"'},
        bounds_checked=cpu)


def fp8_scales(case) -> str:
    """The scale convention the stand-in cache writer uses (pow2 scales survive e8m0)."""
    return case.fp8_scale if case.fp8_scale != "e8m0_trunc" else "pow2"
