"""`vllm.flashmla_sparse.layer`: vLLM's MLAAttention layer on the FlashMLA sparse backend, whole.

`MLAAttention.forward_impl` makes the split vLLM ships: decode tokens (and every token, when a prefill's
sequence exceeds top-k) go through W_UK absorption to `FlashMLASparseImpl.forward_mqa`; short prefills
(seq_len <= top-k) go to the dense-MHA path, `forward_mha`, which projects K/V through `kv_b_proj`, attends
causally with the layer's prefill backend and, for chunked context or prefix-cache hits, gathers the cached
context (`cp_gather_and_upconvert_fp8_kv_cache` for fp8_ds_mla, `gather_and_maybe_dequant_cache` otherwise)
and merges the two parts by LSE. The output is judged after W_UV, for whichever route vLLM took.

The prefill backend is vLLM's own torch backend, CPU_SDPA_MLA, on every host: FlashAttention is not in the
GPU bundle. Compiled ops the host lacks are attnfuzz's stand-ins (see `fuzzer.support.standins`) and are listed in
every result.

Older releases (`flashmla_runtime.layer_api` reads what the installed one offers): 0.26.0 has the same two
routes but no CPU_SDPA_MLA and no `prefill_backend_cls=`; its layer picks its prefill backend itself, FLASH_ATTN
on a CPU, whose Python is vLLM's and whose varlen kernel is attnfuzz's stand-in. 0.23.0's forward_impl sends
every token of a sparse impl to forward_mqa (no dense-MHA route exists there), so the target drives that. Each
observation names the routes the release has (`notes["layer_routes"]`).
"""

from __future__ import annotations

import torch

from fuzzer.support import flashmla_runtime
from fuzzer.support.flashmla_runtime import install_layer_standins, layer_api
from fuzzer.support.vllm_setup import guard_index_group
from fuzzer.support.sparse_mla_steps import layer_forward, mla_attention_engine
from fuzzer.targets.base import WHOLE, RunPlan
from fuzzer.targets.flashmla_sparse import FlashMLASparse, StepContext, flashmla_repro
from fuzzer.targets.harness import common_attn_metadata, with_padded_tokens
from oracles.attention_judge import judge_layer
from oracles.steps import judge_steps
from strategies.batches import AttentionFeatures, attention_space
from strategies.case import CaseError
from strategies.tensors import V_HEAD, materialize_layer_inputs


class FlashMLASparseLayer(FlashMLASparse):
    name = "vllm.flashmla_sparse.layer"
    summary = "MLAAttention on FLASHMLA_SPARSE: decode -> forward_mqa, short prefill -> dense MHA + chunked context"
    bug_classes = "A B C E F H I J K"
    oracle = staticmethod(judge_steps(judge_layer))
    real_parts = ("MLAAttention.forward_impl (the decode/MHA split, W_UK/W_UV)", "FlashMLASparseMetadataBuilder",
                  "FlashMLASparseImpl.forward_mqa / forward_mha", "chunked-context metadata",
                  "CPU_SDPA_MLA prefill backend", "SparseMLAIndexGroup", "the index-remap Triton kernel",
                  "merge_attn_states")
    cudagraph_modes = ("none",)  # eager engines: full graphs are captured on vllm.flashmla_sparse's forward_mqa

    def prepare(self) -> None:
        super().prepare()
        api = layer_api()  # which routes and prefill backend this release's layer has (see layer_api)
        self.routes = api.routes
        drop = {"CPU_SDPA_MLA prefill backend"}  # (the index group is dropped where absent by real_parts_here)
        if not api.dense_mha:
            drop |= {"chunked-context metadata", "merge_attn_states"}
        parts = [p for p in self.real_parts if p not in drop]
        if api.dense_mha:
            parts.append(f"{api.prefill_backend} MLA prefill backend")
        else:  # 0.23: forward_impl hands a sparse impl every token
            parts = [{"MLAAttention.forward_impl (the decode/MHA split, W_UK/W_UV)": "MLAAttention.forward_impl (W_UK/W_UV)",
                      "FlashMLASparseImpl.forward_mqa / forward_mha": "FlashMLASparseImpl.forward_mqa"}.get(p, p)
                     for p in parts]
        self.real_parts = tuple(parts)
        self.emulated = (*self.emulated, *install_layer_standins(self.device))
        flashmla_runtime.record_gathers()

    def cases(self, profile, plan: RunPlan = WHOLE):
        profile = profile.reaching_routes()  # steps past the decode thresholds (128, 256 by heads), up to top-k
        return attention_space(profile, AttentionFeatures(kv_cache_dtypes=plan.kv_dtypes(self), block_sizes=(64, 128),
                                                          block_stride_rows=self.has_block_stride_rows(),
                                                          indexer_fills_short_seqs=True,
                                                          vllm_batch_order=True,
                                                          cudagraph_padding=True, traces=True))

    def run(self, case):
        if case.cudagraph != "none":
            raise CaseError(f"case.cudagraph: {self.name} runs eager engines only (full CUDA graphs: vllm.flashmla_sparse), "
                            f"got {case.cudagraph!r}")
        obs = self.run_steps(case, self.layer_step)
        for o in (*obs.steps, obs):
            o.notes["layer_routes"] = self.routes  # what this release's forward_impl offers a sparse impl
        return obs

    def step_inputs(self, step):
        return materialize_layer_inputs(step, self.device)

    def layer_step(self, ctx: StepContext, step, inputs):
        """One step through MLAAttention.forward_impl (vLLM's decode/MHA split), on the engine's layer and builder."""
        dev, inp, engine = self.device, inputs.attention, ctx.engine
        if not engine:
            engine["builder"], engine["layer"], engine["route"] = mla_attention_engine(
                self.backend, ctx.spec, ctx.cfg, step.heads, inputs.kv_b_weight, ctx.topk_buffer, dev)
        layer, route = engine["layer"], engine["route"]
        route.clear()
        route.update(mqa_tokens=0, mha_tokens=0)
        # The step's own tokens, in batch order: what the layer receives as kv_c_normed / k_pe.
        new = [inp.slot_of[r][req.context_len:] for r, req in enumerate(step.requests)]
        new_slots = (torch.cat(new) if new else torch.zeros(0, dtype=torch.int64)).to(dev)
        metadata = engine["builder"].build(0, common_attn_metadata(step, inp.index, dev))
        prefill = getattr(metadata, "prefill", None)  # 0.23's sparse metadata has no dense-MHA part
        route.update(chunked_context=prefill is not None and prefill.chunked_context is not None,
                     fp8_mixed_batch=bool(getattr(metadata, "fp8_use_mixed_batch", False)))
        check_overrun = guard_index_group(layer.impl, poison=ctx.first)
        rows = step.num_actual_tokens  # the step's tokens and any CUDA-graph padding tokens
        args = (with_padded_tokens(step, inputs.q), with_padded_tokens(step, inp.kv_c[new_slots]),
                with_padded_tokens(step, inp.k_pe[new_slots]).unsqueeze(1), ctx.cache, metadata)
        gathers: list = []

        def forward(name: str):
            output = torch.full((rows, step.heads * V_HEAD), float("nan"), dtype=torch.bfloat16, device=dev)
            if name == "output":  # the judged call's output sits in a guard region
                output = ctx.guards.empty("output", rows * step.heads * V_HEAD, torch.bfloat16, dev).view(
                    rows, step.heads * V_HEAD).fill_(float("nan"))
            flashmla_runtime.GATHER_LOG = gathers if name == "output" else None
            try:
                layer_forward(layer, *args, output)
            finally:
                flashmla_runtime.GATHER_LOG = None
            return output

        outputs = {"out": forward("output")}
        ctx.overruns.extend(check_overrun(route["mqa_tokens"]))
        ctx.notes["route"] = dict(route)  # (the rerun below counts its tokens again; the step's are these)
        if gathers:  # the context rows the dense-MHA path gathered, with the cache slots they came from
            outputs["gathered_slots"] = torch.cat([s for s, _ in gathers])
            outputs["gathered_rows"] = torch.cat([r for _, r in gathers])
        if ctx.rerun:  # the same step again, on the same metadata and buffers
            outputs["out_again"] = forward("again")
        return outputs

    def repro_spec(self, finding):
        return flashmla_repro(self, finding, layer=True)
