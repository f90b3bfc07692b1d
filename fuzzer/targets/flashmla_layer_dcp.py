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

from fuzzer.repro_spec import Judge, ReproSpec
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
from fuzzer.targets.flashmla_sparse import REPRO_CONFIG, REPRO_SETUP_ANY, repro_backend
from fuzzer.targets.harness import REPRO_CPU_PREPARE, REPRO_CPU_SUPPORT, REPRO_METADATA, repro_case, repro_constants, repro_step, step_tensors
from fuzzer.targets.guards import Guards
from oracles.attention_judge import judge_fp8_ds_mla_entries, layer_reference_for, layer_tolerance
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

        for name in DIRECT_DCP_ENV:
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

    def repro_spec(self, finding) -> ReproSpec:
        """Every rank of the step in one process, as `run` emulates them: each rank's fp8_ds_mla cache as its
        writer left it (its own tokens), its MLAAttention (its heads of q and its rows of kv_b_proj) and builder,
        `forward_impl` over attnfuzz's in-process DCP group. Judged: the ranks' heads, in rank order, against the
        layer's fp32 reference over the undivided context."""
        case, dev = finding.case, finding.host.device
        cpu = dev == "cpu"
        whole = undivided(case)
        layer_inputs = materialize_layer_inputs(whole, dev)
        inp, slots, topk_buffer = step_tensors(whole, dev, layer_inputs.attention)
        write, _ = self.writer(case)
        cache_u = self.cache(whole, dev)  # the undivided slots' entries: what the oracle reads
        write(inp.kv_c[slots], inp.k_pe[slots], cache_u, slots)
        tensors = repro_step(whole, inp.index, None, topk_buffer, dev)
        for r in range(case.dcp.size):  # each rank's cache as its writer left it, and its slot mapping
            cache = self.cache(case, dev)
            write(inp.kv_c[slots], inp.k_pe[slots], cache, rank_slot_mapping(case, slots, r))
            width = cache.shape[-1]
            tensors[f"kv_cache_rows.rank{r}"] = cache.as_strided((case.num_blocks * case.stride_rows, width), (width, 1))
            tensors[f"slot_mapping.rank{r}"] = rank_slot_mapping(case, tensors["slot_mapping"], r)
        slot_values, _ = judge_fp8_ds_mla_entries(whole, inp, slots, cache_u[slots // whole.block_size,
                                                                            slots % whole.block_size])
        mha_tokens = int(finding.observation.notes.get("route", {}).get("mha_tokens", 0))
        expected, _ = layer_reference_for(whole, layer_inputs, dev, slot_values, mha_tokens)
        atol, rtol = layer_tolerance(whole, layer_inputs)
        new = [inp.slot_of[i][req.context_len:] for i, req in enumerate(whole.requests)]  # the step's own tokens
        new_slots = (torch.cat(new) if new else torch.zeros(0, dtype=torch.int64)).to(dev)
        tensors.update(q=layer_inputs.q, kv_b_weight=layer_inputs.kv_b_weight, kv_c_normed=inp.kv_c[new_slots],
                       k_pe=inp.k_pe[new_slots].unsqueeze(1), expected_out=expected)
        return ReproSpec(
            about=f"Shrunk case: {case.summary()}; {case.heads} heads per rank, fp8_ds_mla, values {case.values}.\n"
                  "Inputs in tensors.safetensors beside this file; the expected output is attnfuzz's fp32 oracle of "
                  "the layer (after W_UV) over the undivided context.",
            imports=("import dataclasses", "import os", "import tempfile", "from types import SimpleNamespace"),
            constants=dict(DCP_SIZE=case.dcp.size, INTERLEAVE=case.dcp.interleave, HEADS=case.heads,
                           **repro_constants(case), ATOL=atol, RTOL=rtol, LSE_TOL=0.0),
            tensors=tensors,
            support={"runtime": "fuzzer.support.flashmla_runtime", "dcp": "fuzzer.support.dcp_group",
                     **(REPRO_CPU_SUPPORT if cpu else {})},
            prepare=_REPRO_ENV + (REPRO_CPU_PREPARE + "runtime.cpu_shims()  # no streams on a CPU\n" if cpu else "")
            + repro_backend(self, layer=True),
            setup=REPRO_SETUP_ANY.replace("from vllm.v1.kv_cache", "from vllm.v1.attention.backends.utils import "
                                          "get_dcp_local_seq_lens\nfrom vllm.v1.kv_cache")
            + repro_case(case, "SimpleNamespace(size=DCP_SIZE, interleave=INTERLEAVE)") + REPRO_CONFIG
            + REPRO_METADATA + _REPRO_RANK_STEP,
            call=_REPRO_CALL,
            judge=Judge("dcp", dict(out="out", expected='T["expected_out"]', lses="{}", expected_lses="{}",
                                    heads="HEADS", atol="ATOL", rtol="RTOL", lse_tol="LSE_TOL")),
            report='print(f"DCP {DCP_SIZE} ranks emulated in one process, interleave {INTERLEAVE} | rank 0\'s routes:", '
                   'route, "| stand-ins for ops this host lacks:", ", ".join(emulated) or "none")\n',
            bounds_checked=cpu)


DIRECT_DCP_ENV = ("VLLM_USE_DIRECT_DCP_Q_GATHER", "VLLM_USE_DIRECT_DCP_KV_GATHER", "VLLM_USE_DIRECT_DCP_A2A")
_REPRO_ENV = "".join(f'os.environ.setdefault("{name}", "0")  # the emulated ranks share no symmetric memory\n'
                     for name in DIRECT_DCP_ENV)
_REPRO_RANK_STEP = """\
route = {}


def rank_step(r):
    \"\"\"Rank r's step, as the model runs the layer under DCP: MLAAttention.forward_impl on its heads of q.\"\"\"
    width = T[f"kv_cache_rows.rank{r}"].shape[-1]
    cache = T[f"kv_cache_rows.rank{r}"].as_strided((NUM_BLOCKS, BLOCK_SIZE, width),
                                                     (BLOCK_STRIDE_ROWS * width, width, 1))
    rows = slice(r * HEADS * 256, (r + 1) * HEADS * 256)  # this rank's kv_b_proj rows (128 nope + 128 v a head)
    with set_current_vllm_config(cfg), torch.inference_mode():
        layer = runtime.mla_layer(cfg, HEADS, T["kv_b_weight"][rows], T["topk_indices_buffer"].clone(), DEVICE,
                                  backend=Backend)  # it makes its MLADCPManager on this rank's DCP group
        builder = Backend.get_builder_cls()(spec, [runtime.LAYER], cfg, torch.device(DEVICE))
        manager = layer.dcp_manager  # the builder gave it its context-gather collective (init_kv_gather)
        if getattr(manager, "_kv_gather", None) is not None:  # on the group's device_group, which the emulated one lacks
            manager._kv_gather = manager.group.all_gather_into_tensor
        local = get_dcp_local_seq_lens(cam.seq_lens, DCP_SIZE, r, INTERLEAVE)
        extra = {k: v for k, v in dict(dcp_local_seq_lens=local, dcp_local_seq_lens_cpu_upper_bound=local.cpu()).items()
                 if k in fields}
        metadata = builder.build(0, dataclasses.replace(cam, slot_mapping=T[f"slot_mapping.rank{r}"], **extra))
        if r == 0:
            runtime.record_routes(layer.impl, route)
        out = torch.full((T["q"].shape[0], HEADS * 128), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        # Decode tokens go to forward_mqa, short prefills to dense MHA with the DCP context gather.
        layer.forward_impl(T["q"][:, r * HEADS:(r + 1) * HEADS].contiguous(), T["kv_c_normed"], T["k_pe"], cache,
                           metadata, out)
        return out
"""
_REPRO_CALL = """\
ranks = dcp.LockstepRanks(DCP_SIZE)
with dcp.installed_dcp_group(dcp.EmulatedDcpGroup(ranks)):
    out = torch.cat(ranks.run(rank_step), dim=1).unflatten(1, (-1, 128))  # every rank's heads, in rank order
"""


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

