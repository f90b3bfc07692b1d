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
import os
import threading
from types import SimpleNamespace

import torch

from fuzzer.repro_spec import Judge, ReproSpec
from fuzzer.support.dcp_group import EmulatedDcpGroup, LockstepRanks, installed_dcp_group
from fuzzer.support.flashmla_runtime import (
    BACKEND_MODULE,
    KV_LORA_RANK,
    LAYER,
    configure,
    guard_index_group,
    impl_topk_kwargs,
)
from fuzzer.targets.flashmla_sparse import REPRO_CONFIG, REPRO_SETUP, FlashMLASparse
from fuzzer.targets.guards import Guards
from fuzzer.targets.harness import (
    REPRO_CPU_PREPARE,
    REPRO_CPU_SUPPORT,
    REPRO_METADATA,
    common_attn_metadata,
    repro_case,
    repro_constants,
    repro_step,
    step_tensors,
)
from fuzzer.targets.probes import observe_paths
from oracles.attention_judge import attention_tolerance, judge_fp8_ds_mla_entries, reference_for
from oracles.dcp import RANK_LSE_TOLERANCE, judge_dcp, owner_and_local, rank_slot_mapping, rank_slots, undivided
from strategies.batches import AttentionFeatures, attention_space
from strategies.tensors import HEAD_SIZE, ROPE_DIM, SM_SCALE, materialize_attention_inputs

# Per-rank records of vLLM's DCP filter (the rank's local top-k, and the BLOCK_STRIDE_ROWS it was called
# with: the fp8 kernel addresses 64-row pages, so vLLM passes none for 64-token blocks), filled per case.
_FILTERED: dict[int, tuple[torch.Tensor, int | None]] = {}
_FILTER_LOCK = threading.Lock()  # emulated ranks are threads


def record_dcp_filter() -> None:
    """Wrap `triton_filter_and_convert_dcp_index` where flashmla_sparse looks it up (once per process)."""
    mod = importlib.import_module(BACKEND_MODULE)
    real = mod.triton_filter_and_convert_dcp_index
    if getattr(real, "_attnfuzz_recorded", False):
        return

    def recorded(*args, **kwargs):
        result = real(*args, **kwargs)
        out = result[0] if isinstance(result, tuple) else result
        with _FILTER_LOCK:
            _FILTERED[int(kwargs["dcp_rank"])] = (out.detach().clone(), kwargs.get("BLOCK_STRIDE_ROWS"))
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
    kv_cache_dtypes = ("fp8_ds_mla",)  # vLLM runs FlashMLA sparse under DCP on an fp8_ds_mla cache only

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
        # vLLM's direct (symmetric-memory, multicast) DCP paths need a real process group; keep them off.
        os.environ.setdefault("VLLM_USE_DIRECT_DCP_Q_GATHER", "0")
        super().prepare()
        record_dcp_filter()

    def cases(self, profile):
        # The mixed-batch path (< 32 heads per rank) with gathered heads inside one fp8 envelope (<= 64).
        return attention_space(profile, AttentionFeatures(kv_cache_dtypes=self.kv_cache_dtypes, heads=(8, 16),
                                                          block_sizes=(64, 128), dcp=True, block_stride_rows=True,
                                                          dcp_outside_envelope=True))

    def run(self, case):
        return run_emulated_ranks(self, DcpStep(self, case))

    def repro_spec(self, finding) -> ReproSpec:
        """Every rank of the step in one process, as `run` emulates them: each rank's cache as its writer left
        it, vLLM's builder, MLADCPManager (query all-gather, LSE combine) and forward_mqa, over attnfuzz's
        in-process DCP group. Judged: the merged heads against the fp32 reference over the undivided context,
        each rank's LSE against the reference over its share. Real ranks' findings are reproduced so too."""

        case, dev = finding.case, finding.host.device
        whole = undivided(case)
        inp, slots, topk_buffer = step_tensors(whole, dev, materialize_attention_inputs(whole, dev))
        write, _ = self.writer(case)
        cache_u = self.cache(whole, dev)  # the undivided slots' entries: what the oracle reads
        write(inp.kv_c[slots], inp.k_pe[slots], cache_u, slots)
        tensors = repro_step(whole, inp.index, None, topk_buffer, dev)
        for r in range(case.dcp.size):  # each rank's cache as its writer left it: its own tokens only
            cache = self.cache(case, dev)
            write(inp.kv_c[slots], inp.k_pe[slots], cache, rank_slot_mapping(case, slots, r))
            width = cache.shape[-1]
            tensors[f"kv_cache_rows.rank{r}"] = cache.as_strided((case.num_blocks * case.stride_rows, width), (width, 1))
        slot_values, _ = judge_fp8_ds_mla_entries(whole, inp, slots, cache_u[slots // whole.block_size,
                                                                            slots % whole.block_size])
        owner, _ = owner_and_local(case, inp.index.topk_indices.long().clamp(min=0))
        for r in range(case.dcp.size):
            tensors[f"expected_lse.rank{r}"] = reference_for(whole, inp, dev, slot_values, keep=owner == r)[1]
        tensors.update(q=inp.q, expected_out=reference_for(whole, inp, dev, slot_values)[0])
        atol, rtol = attention_tolerance(whole, inp)
        real = "" if finding.target.endswith(".dcp") else (
            "\nThe finding came from real ranks (one process per GPU); this script emulates them in one process.")
        return ReproSpec(
            about=f"Shrunk case: {case.summary()}; {case.heads} heads per rank, fp8_ds_mla, values {case.values}.\n"
                  "Inputs in tensors.safetensors beside this file; the expected output is attnfuzz's fp32 oracle over "
                  f"the undivided context (latent, 512 wide).{real}",
            imports=("import dataclasses", "import tempfile", "from types import SimpleNamespace"),
            constants=dict(DCP_SIZE=case.dcp.size, INTERLEAVE=case.dcp.interleave, HEADS=case.heads, **repro_constants(case),
                           ATOL=atol, RTOL=rtol, LSE_TOL=RANK_LSE_TOLERANCE[0]),
            tensors=tensors,
            support={"runtime": "fuzzer.support.flashmla_runtime", "dcp": "fuzzer.support.dcp_group",
                     **(REPRO_CPU_SUPPORT if dev == "cpu" else {})},
            prepare=(REPRO_CPU_PREPARE + "runtime.cpu_shims()  # no streams on a CPU\n" if dev == "cpu" else "")
            + "emulated = runtime.install_standins(DEVICE)\n",
            setup=REPRO_SETUP.replace("from vllm.v1.kv_cache", "from vllm.v1.attention.ops.dcp import MLADCPManager\n"
                                      "from vllm.v1.kv_cache")
            + repro_case(case, "SimpleNamespace(size=DCP_SIZE, interleave=INTERLEAVE)") + REPRO_CONFIG
            + REPRO_METADATA + _REPRO_RANK_STEP,
            call=_REPRO_CALL,
            judge=Judge("dcp", dict(out="out", expected='T["expected_out"]', lses="lses",
                                    expected_lses='{r: T[f"expected_lse.rank{r}"] for r in lses}', heads="HEADS",
                                    atol="ATOL", rtol="RTOL", lse_tol="LSE_TOL")),
            report='print(f"DCP {DCP_SIZE} ranks emulated in one process, interleave {INTERLEAVE} | stand-ins for ops '
                   'this host lacks: {\', \'.join(emulated) or \'none\'}")\n')


_REPRO_RANK_STEP = """\
lses = {}


def rank_step(r):
    \"\"\"Rank r's step, as MLAAttention.forward_impl drives the MQA tokens under DCP.\"\"\"
    width = T[f"kv_cache_rows.rank{r}"].shape[-1]
    cache = T[f"kv_cache_rows.rank{r}"].as_strided((NUM_BLOCKS, BLOCK_SIZE, width),
                                                     (BLOCK_STRIDE_ROWS * width, width, 1))
    with set_current_vllm_config(cfg), torch.inference_mode():
        impl = Backend.get_impl_cls()(
            HEADS, 576, runtime.SM_SCALE, 1, None, None, "fp8_ds_mla", None, "decoder", None,
            **runtime.impl_topk_kwargs(Backend.get_impl_cls(), T["topk_indices_buffer"].clone()),
            q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, qk_head_dim=192,
            v_head_dim=128, kv_b_proj=None)
        manager = MLADCPManager(vllm_config=cfg, device=torch.device(DEVICE), num_heads=HEADS, query_head_dim=576,
                                output_head_dim=512, query_dtype=torch.bfloat16, output_dtype=torch.bfloat16,
                                padded_num_heads=getattr(impl, "q_pad_num_heads", None),
                                is_lse_base_on_e=impl.lse_base_on_e, use_pcp=False) if DCP_SIZE > 1 else None
        cfg.compilation_config.static_forward_context[runtime.LAYER] = SimpleNamespace(
            prefill_backend=None, dcp_manager=manager)  # where the builder finds the layer's DCP manager
        metadata = Backend.get_builder_cls()(spec, [runtime.LAYER], cfg, torch.device(DEVICE)).build(0, cam)
        q = T["q"][:, r * HEADS:(r + 1) * HEADS].contiguous()  # this rank's heads
        if manager is None:
            return impl.forward_mqa(q, cache, metadata, None)[0]
        out, lses[r] = impl.forward_mqa(manager.query_gather(q), cache, metadata, None)
        return manager.combine(out, lses[r], seq_lens=metadata.seq_lens, query_start_loc=metadata.query_start_loc)
"""
_REPRO_CALL = """\
ranks = dcp.LockstepRanks(DCP_SIZE)
with dcp.installed_dcp_group(dcp.EmulatedDcpGroup(ranks)):
    out = torch.cat(ranks.run(rank_step), dim=1)  # every rank's heads after vLLM's combine, in rank order
"""


def run_emulated_ranks(target, step: "DcpStep"):
    """Every rank of `step` in this process, over attnfuzz's in-process DCP group; its observation."""
    case, ranks = step.case, LockstepRanks(step.case.dcp.size)

    def call():
        with installed_dcp_group(EmulatedDcpGroup(ranks)):
            return step.outputs(ranks.run(step.run_rank))

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
    entries: torch.Tensor | None = None  # the fp8 entries written for the undivided slots this rank owns
    cache_changed: int = 0  # cache rows the attention call wrote
    problems: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # buffer_overrun, guard
    error: str | None = None  # what the code under test raised on this rank (real ranks)


class DcpStep:
    """One case under DCP: what every rank shares (the undivided inputs, config, metadata) and one rank's
    step, as MLAAttention.forward_impl drives the MQA tokens: query all-gather, builder, forward_mqa (the
    fp8 mixed-batch path filters the global top-k to the rank's slots and returns its LSE), LSE combine.
    vLLM's DCP group (real, or emulated) is whatever `parallel_state._DCP` holds when `run_rank` runs."""

    def __init__(self, target: FlashMLASparseDcp, case, inputs=None) -> None:
        """`inputs`: the undivided case's attention inputs, if the caller has them (the layer's)."""
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        self.target, self.case, dev = target, case, target.device
        self.whole = undivided(case)
        self.inputs = inputs if inputs is not None else materialize_attention_inputs(self.whole, dev)
        _, self.slots, self.topk_buffer = step_tensors(self.whole, dev, inputs=self.inputs)
        self.write, self.write_emulated = target.writer(case)
        self.cfg = configure(target.cfg, case, max_num_batched_tokens=self.topk_buffer.shape[0])
        self.spec = MLAAttentionSpec(block_size=case.block_size, num_kv_heads=1, head_size=HEAD_SIZE,
                                     dtype=torch.bfloat16, cache_dtype_str=case.kv_cache_dtype)
        self.metadata_in = common_attn_metadata(self.whole, self.inputs.index, dev)  # slot_mapping: undivided
        self.results: list[RankResult] = []

    def run_rank(self, r: int) -> RankResult:
        from vllm.config import set_current_vllm_config
        from vllm.v1.attention.ops.dcp import MLADCPManager

        case, inputs, cfg, dev, heads = self.case, self.inputs, self.cfg, self.target.device, self.case.heads
        backend = importlib.import_module(BACKEND_MODULE).FlashMLASparseBackend
        res, guards = RankResult(), Guards()
        cache = self.target.cache(case, dev, guards, name=f"kv_cache (rank {r})")
        shape = self.topk_buffer.shape  # each rank has its own indexer buffer
        topk_buffer = guards.empty(f"topk_indices_buffer (rank {r})", shape.numel(), torch.int32, dev).view(shape)
        topk_buffer.copy_(self.topk_buffer)
        with set_current_vllm_config(cfg), torch.inference_mode():
            # The rank's cache holds its own tokens: vLLM's slot mapping is -1 for the others'.
            self.write(inputs.kv_c[self.slots], inputs.k_pe[self.slots], cache, rank_slot_mapping(case, self.slots, r))
            before = cache.clone()
            owner, rslot = rank_slots(case, self.slots)
            res.entries = before[rslot[owner == r] // case.block_size, rslot[owner == r] % case.block_size].cpu()
            impl = backend.get_impl_cls()(
                heads, HEAD_SIZE, SM_SCALE, 1, None, None, case.kv_cache_dtype, None, "decoder", None,
                **impl_topk_kwargs(backend.get_impl_cls(), topk_buffer), q_lora_rank=None,
                kv_lora_rank=KV_LORA_RANK, qk_nope_head_dim=128, qk_rope_head_dim=ROPE_DIM,
                qk_head_dim=128 + ROPE_DIM, v_head_dim=128, kv_b_proj=None)
            manager = None
            if case.dcp.size > 1:  # as MLAAttention builds it when DCP is on
                manager = MLADCPManager(vllm_config=cfg, device=torch.device(dev), num_heads=heads,
                                        query_head_dim=HEAD_SIZE, output_head_dim=KV_LORA_RANK,
                                        query_dtype=torch.bfloat16, output_dtype=torch.bfloat16,
                                        padded_num_heads=getattr(impl, "q_pad_num_heads", None),
                                        is_lse_base_on_e=impl.lse_base_on_e, use_pcp=False)
            # The builder finds the layer's DCP manager in the forward context.
            cfg.compilation_config.static_forward_context[LAYER] = SimpleNamespace(prefill_backend=None,
                                                                                   dcp_manager=manager)
            builder = backend.get_builder_cls()(self.spec, [LAYER], cfg, torch.device(dev))
            metadata = builder.build(0, dataclasses.replace(
                self.metadata_in, slot_mapping=rank_slot_mapping(case, self.metadata_in.slot_mapping, r)))
            q = inputs.q[:, r * heads:(r + 1) * heads].contiguous()  # this rank's heads (TP split)
            if manager is not None:
                q = manager.query_gather(q)
            check_overrun = guard_index_group(impl)
            out, lse = impl.forward_mqa(q, cache, metadata, None)
            if manager is not None:
                # Copies taken before the combine, which corrects both in place (on a CPU, .cpu() is no copy).
                res.lse = lse.detach().float().to("cpu", copy=True)
                res.partial = out.detach().to("cpu", copy=True)  # a wrong merge of right partials: the combine's
                out = manager.combine(out, lse, seq_lens=metadata.seq_lens, query_start_loc=metadata.query_start_loc)
            res.merged = out.detach().cpu()
            if r in _FILTERED:
                topk, res.block_stride_rows = _FILTERED.pop(r)
                res.topk = topk.cpu()
            if overruns := [f"rank {r}: {m}" for m in check_overrun(case.num_tokens)]:
                res.problems["buffer_overrun"] = overruns
        if self.target.device == "cuda":
            torch.cuda.synchronize()
        res.cache_changed = int((cache.view(torch.uint8) != before.view(torch.uint8)).any(dim=-1).sum())
        if guard := guards.check():
            res.problems["guard"] = [f"rank {r}: {g}" for g in guard]
        return res

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
        strides = {res.block_stride_rows for res in results if res.topk is not None}
        if strides:
            obs.notes["dcp_filter_call"] = {"block_stride_rows": strides.pop()}
        if changed := [f"rank {r}: {res.cache_changed} rows" for r, res in enumerate(results) if res.cache_changed]:
            obs.notes["cache_changed"] = ", ".join(changed)
        for key in ("buffer_overrun", "guard"):
            if found := [m for res in results for m in res.problems.get(key, [])]:
                obs.notes[key] = found
        t = self.target
        obs.emulated = tuple(dict.fromkeys(x for x in (*t.emulated, self.write_emulated, collectives) if x))
        obs.notes["shims"] = t.shims
        return obs
