"""`vllm.flashmla_sparse.dcp`: FlashMLA sparse under decode context parallelism, every rank emulated in one
process.

Each rank gets its own fp8_ds_mla cache holding only the tokens it owns (written through vLLM's slot
mapping, -1 for the others' tokens) and runs vLLM's per-rank path as the layer drives it for the MQA tokens:
the query all-gather (`MLADCPManager.query_gather`), the builder and `FlashMLASparseImpl.forward_mqa` on the
fp8 mixed-batch path, which filters the global top-k to the rank's local slots
(`triton_filter_and_convert_dcp_index`) and returns the rank's LSE, then vLLM's LSE combine
(`cp_lse_ag_out_rs`: all-gather of LSEs, `correct_attn_out`, reduce-scatter over heads). The collectives run
over `fuzzer.support.dcp_group` (threads, one rank at a time). The merged heads are judged against
attention over the whole, undivided context (`oracles.dcp`); each rank's filtered indices exactly; each
rank's LSE over its own share.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import threading

import torch

from fuzzer.repro_spec import Call, Judge, ReproSpec
from fuzzer.support.attn_metadata import attn_metadata
from fuzzer.support.dcp_steps import (
    dcp_forward_mqa,
    dcp_rank_engine,
    direct_dcp_off,
    on_dcp_ranks,
    rank_heads,
    rank_metadata,
    replay_dcp_ranks,
)
from fuzzer.support.flashmla_runtime import BACKEND_MODULE
from fuzzer.support.vllm_setup import configure, guard_index_group
from fuzzer.support.sparse_mla_steps import mla_spec, step_config
from fuzzer.targets.base import WHOLE, RunPlan
from fuzzer.targets.flashmla_sparse import FlashMLASparse
from fuzzer.targets.guards import Guards
from fuzzer.targets.harness import common_attn_metadata, repro_step, step_tensors
from fuzzer.targets.probes import observe_paths
from oracles.attention_judge import attention_tolerance, judge_fp8_ds_mla_entries, reference_for
from oracles.dcp import RANK_LSE_TOLERANCE, judge_dcp, owner_and_local, rank_slot_mapping, rank_slots, undivided
from strategies.batches import AttentionFeatures, attention_space
from strategies.tensors import materialize_attention_inputs

# vLLM's direct DCP query gather (symmetric memory, multicast) needs a real process group: kept off.
DIRECT_Q_GATHER = ("VLLM_USE_DIRECT_DCP_Q_GATHER",)

# Per-rank records of vLLM's DCP filter (the rank's local top-k, the BLOCK_STRIDE_ROWS it was called with: the fp8
# kernel addresses 64-row pages, so vLLM passes none for 64-token blocks; whether it compacted the valid entries to
# each row's front: 0.34's bf16 path does), filled per case.
_FILTERED: dict[int, tuple[torch.Tensor, int | None, bool]] = {}
_FILTER_LOCK = threading.Lock()  # emulated ranks are threads


def dcp_cache_dtypes() -> tuple[str, ...]:
    """The caches this release runs FlashMLA sparse under DCP on: fp8_ds_mla, and bf16 where the bf16 forward filters
    the global top-k to the rank's slots itself (0.34; 0.33's impl refuses a bf16 cache under DCP)."""
    impl = importlib.import_module(BACKEND_MODULE).FlashMLASparseImpl
    bf16_forward = getattr(impl, "_forward_bf16_kv", None)
    filters = bf16_forward is not None and "triton_filter_and_convert_dcp_index" in inspect.getsource(bf16_forward)
    return ("fp8_ds_mla", "bfloat16") if filters else ("fp8_ds_mla",)


def record_dcp_filter() -> None:
    """Wrap `triton_filter_and_convert_dcp_index` where flashmla_sparse looks it up (once per process)."""
    mod = importlib.import_module(BACKEND_MODULE)
    real = mod.triton_filter_and_convert_dcp_index
    if getattr(real, "_attnfuzz_recorded", False):
        return

    signature = inspect.signature(real)

    def recorded(*args, **kwargs):
        result = real(*args, **kwargs)
        out = result[0] if isinstance(result, tuple) else result
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        compacted = bool(call.arguments.get("compact_valid_to_front", False))  # a release without it: never
        with _FILTER_LOCK:
            _FILTERED[int(kwargs["dcp_rank"])] = (out.detach().clone(), kwargs.get("BLOCK_STRIDE_ROWS"), compacted)
        return result

    recorded._attnfuzz_recorded = True
    mod.triton_filter_and_convert_dcp_index = recorded


class FlashMLASparseDcp(FlashMLASparse):
    name = "vllm.flashmla_sparse.dcp"
    summary = ("FlashMLA sparse under DCP, every rank emulated in one process: query all-gather, per-rank fp8 "
               "mixed-batch forward_mqa with the DCP top-k filter, vLLM's LSE combine")
    bug_classes = "B C G J"
    oracle = staticmethod(judge_dcp)
    real_parts = ("MLADCPManager (query gather, cp_lse_ag_out_rs combine)", "FlashMLASparseMetadataBuilder",
                  "FlashMLASparseImpl.forward_mqa (fp8 mixed batch)", "triton_filter_and_convert_dcp_index",
                  "correct_attn_out (Triton)")
    # vLLM runs FlashMLA sparse under DCP on an fp8_ds_mla cache, and from 0.34 on a bf16 one (`dcp_cache_dtypes`:
    # this release's; on one that refuses bf16 the cases check that it does)
    kv_cache_dtypes = ("fp8_ds_mla", "bfloat16")
    dcp_cache_dtypes: tuple[str, ...] = ("fp8_ds_mla",)
    PLANNED = (*FlashMLASparse.PLANNED, "dcp_cache_dtypes")

    def unavailable(self) -> str | None:
        return super().unavailable() or self.needs_dcp_manager()

    @staticmethod
    def needs_dcp_manager() -> str | None:
        try:
            importlib.import_module("vllm.v1.attention.ops.dcp").MLADCPManager  # noqa: B018
        except (ImportError, AttributeError) as e:
            return f"this vLLM has no MLADCPManager (vllm.v1.attention.ops.dcp): {e}"
        return None

    def prepare(self) -> None:
        direct_dcp_off(DIRECT_Q_GATHER)
        super().prepare()
        record_dcp_filter()
        self.dcp_cache_dtypes = dcp_cache_dtypes()

    def cases(self, profile, plan: RunPlan = WHOLE):
        # The mixed-batch path (< 32 heads per rank) with gathered heads inside one fp8 envelope (<= 64).
        return attention_space(profile, AttentionFeatures(kv_cache_dtypes=plan.kv_dtypes(self), heads=(8, 16),
                                                          block_sizes=(64, 128), dcp=True, block_stride_rows=True,
                                                          dcp_outside_envelope=True))

    def run(self, case):
        return run_emulated_ranks(self, DcpStep(self, case))

    def repro_spec(self, finding) -> ReproSpec:
        """Every rank of the step in one process, as `run` emulates them: each rank's cache as its writer left
        it, vLLM's builder, MLADCPManager (query all-gather, LSE combine) and forward_mqa, over attnfuzz's
        in-process DCP group (`fuzzer.support.dcp_steps`). Judged: the merged heads against the fp32 reference
        over the undivided context, each rank's LSE against the reference over its share. Real ranks' findings
        are reproduced so too."""

        case, dev = finding.case, finding.host.device
        whole = undivided(case)
        inp, slots, topk_buffer = step_tensors(whole, dev, materialize_attention_inputs(whole, dev))
        tensors, slot_values = dcp_repro_tensors(self, case, whole, inp, slots, topk_buffer, dev)
        owner, _ = owner_and_local(case, inp.index.topk_indices.long().clamp(min=0))
        for r in range(case.dcp.size):
            tensors[f"expected_lse.rank{r}"] = reference_for(whole, inp, dev, slot_values, keep=owner == r)[1]
        tensors.update(q=inp.q, expected_out=reference_for(whole, inp, dev, slot_values)[0])
        atol, rtol = attention_tolerance(whole, inp)
        real = "" if finding.target.endswith(".dcp") else (
            "\nThe finding came from real ranks (one process per GPU); this script emulates them in one process.")
        replay = Call(replay_dcp_ranks, dict(backend="backend", spec="spec", cfg="cfg", cam="cam", T="T",
                                             dcp_size="DCP_SIZE", heads="HEADS", kv_cache_dtype="KV_CACHE_DTYPE",
                                             **dcp_cache_args(), device="DEVICE", found="found"),
                      assign="out, lses", note="every rank, emulated in one process: its heads after vLLM's combine")
        return ReproSpec(
            about=f"Shrunk case: {case.summary()}; {case.heads} heads per rank, fp8_ds_mla, values {case.values}.\n"
                  "Inputs in tensors.safetensors beside this file; the expected output is attnfuzz's fp32 oracle over "
                  f"the undivided context (latent, 512 wide).{real}",
            constants=dict(dcp_constants(case, whole, topk_buffer), ATOL=atol, RTOL=rtol, LSE_TOL=RANK_LSE_TOLERANCE[0]),
            tensors=tensors,
            prepare=(Call(direct_dcp_off, dict(names=repr(DIRECT_Q_GATHER))), *self.repro_prepare(layer=False)),
            setup=dcp_setup(self),
            call=(replay,),
            judge=Judge("dcp", dict(out="out", expected='T["expected_out"]', lses="lses",
                                    expected_lses='{r: T[f"expected_lse.rank{r}"] for r in lses}', heads="HEADS",
                                    atol="ATOL", rtol="RTOL", lse_tol="LSE_TOL")),
            report=dcp_report())


# -- reproducers: what the DCP targets share ------------------------------------------------------------------

def dcp_rank_tensors(target, case, inp, slots, tensors: dict, device) -> dict:
    """`tensors` (the undivided step's) and each rank's: its cache as its writer left it (its own tokens only)
    and its slot mapping (-1 for the other ranks' tokens)."""
    write, _ = target.writer(case)
    for r in range(case.dcp.size):
        cache = target.cache(case, device)
        write(inp.kv_c[slots], inp.k_pe[slots], cache, rank_slot_mapping(case, slots, r))
        width = cache.shape[-1]
        tensors[f"kv_cache_rows.rank{r}"] = cache.as_strided((case.num_blocks * case.stride_rows, width), (width, 1))
        tensors[f"slot_mapping.rank{r}"] = rank_slot_mapping(case, tensors["slot_mapping"], r)
    return tensors


def dcp_repro_tensors(target, case, whole, inp, slots, topk_buffer, device) -> tuple[dict, torch.Tensor]:
    """A DCP reproducer's tensors (the undivided step's and each rank's: `dcp_rank_tensors`) and the values of the
    step's slots as the oracle reads them: from the entries the target's writer leaves in an undivided cache."""
    write, _ = target.writer(case)
    cache_u = target.cache(whole, device)
    write(inp.kv_c[slots], inp.k_pe[slots], cache_u, slots)
    tensors = dcp_rank_tensors(target, case, inp, slots, repro_step(whole, inp.index, None, topk_buffer, device),
                               device)
    slot_values, _ = judge_fp8_ds_mla_entries(whole, inp, slots, cache_u[slots // whole.block_size,
                                                                        slots % whole.block_size])
    return tensors, slot_values


def dcp_constants(case, whole, topk_buffer) -> dict:
    """The step's sizes a DCP reproducer names."""
    return dict(DCP_SIZE=case.dcp.size, INTERLEAVE=case.dcp.interleave, HEADS=case.heads,
                KV_CACHE_DTYPE=case.kv_cache_dtype, TOPK_WIDTH=case.topk_width, TOPK_ROWS=topk_buffer.shape[0],
                BLOCK_SIZE=case.block_size, BLOCK_STRIDE_ROWS=case.stride_rows, NUM_BLOCKS=case.num_blocks,
                NUM_TOKENS=whole.num_actual_tokens, MAX_QUERY_LEN=max(r.query_len for r in whole.requests),
                MAX_SEQ_LEN=max(r.seq_len for r in whole.requests))


def dcp_cache_args() -> dict:
    return dict(num_blocks="NUM_BLOCKS", block_size="BLOCK_SIZE", block_stride_rows="BLOCK_STRIDE_ROWS")


def dcp_setup(target, metadata: bool = True) -> tuple[Call, ...]:
    """vLLM's config (DCP on), the layer's KV-cache spec and (`metadata`) the undivided step's metadata."""
    cfg = Call(step_config, dict(device="DEVICE", heads="HEADS", topk_width="TOPK_WIDTH", kv_cache_dtype="KV_CACHE_DTYPE",
                                 block_size="BLOCK_SIZE", max_num_batched_tokens="TOPK_ROWS", dcp_size="DCP_SIZE",
                                 dcp_interleave="INTERLEAVE"), assign="cfg")
    cam = Call(attn_metadata, dict(query_start_loc='T["query_start_loc"]', seq_lens='T["seq_lens"]',
                                   num_computed_tokens='T["num_computed_tokens"]', block_table='T["block_table"]',
                                   slot_mapping='T["slot_mapping"]', num_actual_tokens="NUM_TOKENS",
                                   max_query_len="MAX_QUERY_LEN", max_seq_len="MAX_SEQ_LEN"), assign="cam",
               note="the undivided step's; each rank's slot mapping replaces its own")
    return (cfg, target.repro_spec_call(), *((cam,) if metadata else ()))


def dcp_report(**more: str) -> dict:
    return {"DCP ranks emulated in one process:": "DCP_SIZE", "interleave:": "INTERLEAVE", **more,
            "stand-ins for ops this host lacks:": '", ".join(emulated) or "none"'}


def run_emulated_ranks(target, step: "DcpStep"):
    """Every rank of `step` in this process, over attnfuzz's in-process DCP group; its observation."""
    case = step.case

    def call():
        return step.outputs(on_dcp_ranks(case.dcp.size, step.run_rank))

    obs = observe_paths(target.observe, call, notes={
        "dcp": f"{case.dcp.size} ranks emulated in one process, interleave {case.dcp.interleave}"})
    return step.finish(obs, "DCP collectives (attnfuzz's in-process group)")


@dataclasses.dataclass
class RankResult:
    """What one rank's step leaves, as plain CPU tensors (a real rank sends it to rank 0)."""

    merged: torch.Tensor | None = None  # this rank's heads after vLLM's combine [T, H, 512]
    lse: torch.Tensor | None = None  # the rank's partial LSE over the gathered heads [T, H * N]
    partial: torch.Tensor | None = None  # the rank's partial output over the gathered heads, before the combine
    topk: torch.Tensor | None = None  # the DCP filter's output: the rank's local slots [T, K]
    block_stride_rows: int | None = None  # as the filter was called
    compacted: bool = False  # the filter compacted each row's valid entries to its front
    entries: torch.Tensor | None = None  # the fp8 entries written for the undivided slots this rank owns
    cache_changed: int = 0  # cache rows the attention call wrote
    problems: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # buffer_overrun, guard
    error: str | None = None  # what the code under test raised on this rank (real ranks)
    device_lost: bool = False  # that error loses the CUDA context (fuzzer.targets.base.lost_device)
    memory: list = dataclasses.field(default_factory=list)  # the bounds checker's records on a rank's own process


class DcpStep:
    """One case under DCP: what every rank shares (the undivided inputs, config, metadata) and one rank's
    step, as MLAAttention.forward_impl drives the MQA tokens: query all-gather, builder, forward_mqa (the
    fp8 mixed-batch path filters the global top-k to the rank's slots and returns its LSE), LSE combine.
    vLLM's DCP group (real, or emulated) is whatever `parallel_state._DCP` holds when `run_rank` runs."""

    def __init__(self, target: FlashMLASparseDcp, case, inputs=None) -> None:
        """`inputs`: the undivided case's attention inputs, if the caller has them (the layer's)."""
        self.target, self.case, dev = target, case, target.device
        self.whole = undivided(case)
        self.inputs = inputs if inputs is not None else materialize_attention_inputs(self.whole, dev)
        _, self.slots, self.topk_buffer = step_tensors(self.whole, dev, inputs=self.inputs)
        self.write, self.write_emulated = target.writer(case)
        self.cfg = configure(target.cfg, case, max_num_batched_tokens=self.topk_buffer.shape[0])
        self.spec = mla_spec(case.block_size, case.kv_cache_dtype)
        self.metadata_in = common_attn_metadata(self.whole, self.inputs.index, dev)  # slot_mapping: undivided
        self.results: list[RankResult] = []

    def rank_buffers(self, r: int, guards: Guards):
        """The rank's paged cache and its own copy of the indexer's buffer, inside guard regions."""
        dev = self.target.device
        cache = self.target.cache(self.case, dev, guards, name=f"kv_cache (rank {r})")
        shape = self.topk_buffer.shape
        topk_buffer = guards.empty(f"topk_indices_buffer (rank {r})", shape.numel(), torch.int32, dev).view(shape)
        return cache, topk_buffer.copy_(self.topk_buffer)

    def write_rank_cache(self, r: int, res: RankResult, cache):
        """The layer's cache write on rank r (its own tokens: vLLM's slot mapping is -1 for the others'); the
        entries written, for the oracle; returns the cache as written (to compare after the call)."""
        case, inputs = self.case, self.inputs
        self.write(inputs.kv_c[self.slots], inputs.k_pe[self.slots], cache, rank_slot_mapping(case, self.slots, r))
        before = cache.clone()
        owner, rslot = rank_slots(case, self.slots)
        res.entries = before[rslot[owner == r] // case.block_size, rslot[owner == r] % case.block_size].cpu()
        return before

    def end_rank(self, r: int, res: RankResult, guards: Guards, cache, before) -> RankResult:
        """What every rank notes after its call: the cache rows it changed, guard regions it wrote."""
        if self.target.device == "cuda":
            torch.cuda.synchronize()
        res.cache_changed = int((cache.view(torch.uint8) != before.view(torch.uint8)).any(dim=-1).sum())
        if guard := guards.check():
            res.problems["guard"] = [f"rank {r}: {g}" for g in guard]
        return res

    def run_rank(self, r: int) -> RankResult:
        """Rank `r`'s step: its buffers, its share of the cache written, its call (`call_rank`), what it changed."""
        from vllm.config import set_current_vllm_config

        res, guards = RankResult(), Guards()
        cache, topk_buffer = self.rank_buffers(r, guards)
        with set_current_vllm_config(self.cfg), torch.inference_mode():
            before = self.write_rank_cache(r, res, cache)
            self.call_rank(r, res, guards, cache, topk_buffer)
        return self.end_rank(r, res, guards, cache, before)

    def call_rank(self, r: int, res: RankResult, guards: Guards, cache: torch.Tensor, topk_buffer) -> None:
        """The backend's call on rank `r`, noting what it gave in `res`."""
        case, inputs, cfg, dev, heads = self.case, self.inputs, self.cfg, self.target.device, self.case.heads
        builder, impl, manager = dcp_rank_engine(self.target.backend, self.spec, cfg, heads, case.kv_cache_dtype,
                                                 topk_buffer, dev)
        metadata = rank_metadata(builder, cfg, self.metadata_in,
                                 rank_slot_mapping(case, self.metadata_in.slot_mapping, r))
        check_overrun = guard_index_group(impl)
        out, lse, partial = dcp_forward_mqa(impl, manager, rank_heads(inputs.q, heads, r), cache, metadata)
        if lse is not None:  # the rank's partials, before the combine (a wrong merge of right partials: its)
            res.lse = lse.detach().float().to("cpu", copy=True)
            res.partial = partial.detach().to("cpu", copy=True)
        res.merged = out.detach().cpu()
        if r in _FILTERED:
            topk, res.block_stride_rows, res.compacted = _FILTERED.pop(r)
            res.topk = topk.cpu()
        if overruns := [f"rank {r}: {m}" for m in check_overrun(case.num_tokens)]:
            res.problems["buffer_overrun"] = overruns

    def outputs(self, results: list[RankResult]) -> dict:
        """The observation's outputs from every rank's result: the merged heads in rank order, each rank's
        LSE and filtered top-k (and the rest is kept for `finish`)."""
        self.results = results
        out = {"out": torch.cat([res.merged for res in results], dim=1)}
        for r, res in enumerate(results):
            if res.lse is not None:
                out[f"rank{r}.lse"] = res.lse
            if res.partial is not None:
                out[f"rank{r}.partial"] = res.partial
            if res.topk is not None:
                out[f"rank{r}.topk"] = res.topk
        return out

    def finish(self, obs, collectives: str):
        """Everything every rank saw, for the oracle: the fp8 entries as the undivided case's slots (its
        read-back), the filter's call, cache writes, overruns, guards; stand-ins and shims."""
        case, results = self.case, self.results
        if results and all(res.entries is not None for res in results):
            owner, _ = rank_slots(case, self.slots)
            entries = torch.empty(len(self.slots), results[0].entries.shape[-1], dtype=results[0].entries.dtype)
            for r, res in enumerate(results):
                entries[(owner == r).cpu()] = res.entries
            obs.outputs["cache_slots"], obs.outputs["cache_entries"] = self.slots.cpu(), entries
        calls = {(res.block_stride_rows, res.compacted) for res in results if res.topk is not None}
        if calls:
            stride, compacted = calls.pop()
            obs.notes["dcp_filter_call"] = {"block_stride_rows": stride, "compacted": compacted}
        if (dtypes := getattr(self.target, "dcp_cache_dtypes", None)) is not None:  # (PCP's layer target: none)
            obs.notes["dcp_cache_dtypes"] = list(dtypes)
        if changed := [f"rank {r}: {res.cache_changed} rows" for r, res in enumerate(results) if res.cache_changed]:
            obs.notes["cache_changed"] = ", ".join(changed)
        for key in ("buffer_overrun", "guard"):
            if found := [m for res in results for m in res.problems.get(key, [])]:
                obs.notes[key] = found
        obs.memory += [v for res in results for v in res.memory]  # real ranks' own (rank 0's: observe's)
        t = self.target
        obs.emulated = tuple(dict.fromkeys(x for x in (*t.emulated, self.write_emulated, collectives) if x))
        obs.notes["shims"] = t.shims
        return obs
