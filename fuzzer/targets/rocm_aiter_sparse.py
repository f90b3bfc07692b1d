"""`vllm.rocm_aiter_sparse`: vLLM's AITER sparse-MLA backend for AMD's MI300/MI355 (ROCM_AITER_MLA_SPARSE,
`ROCMAiterMLASparseBackend`, vllm/v1/attention/backends/mla/rocm_aiter_mla_sparse.py; gfx942/gfx950) whole, on the
MQA route.

vLLM's code under test, run for real (its Triton kernels interpreted and bounds-checked on a CPU):
- ROCMAiterMLASparseMetadataBuilder.build (over the shared sparse-MLA builder: reorder threshold 1, spec decodes as
  decodes): req_id_per_token into its persistent buffer (the shrink tail re-zeroed), the Triton
  `generate_sparse_seqlen_kernel` (each token's ragged length min(position + 1, index_topk)), their cumsum into the
  persistent `paged_kv_indptr` (the tail padded with the last value), and AITER's persistent work plan
  (`get_mla_metadata_v1`, skipped when the fingerprint of clamped lengths is the step before's; its
  `max_split_per_batch` from `_sparse_decode_max_split`).
- ROCMAiterMLASparseImpl.forward_mqa: the query concatenated (`concat_mla_q`) or, over an fp8 cache, quantized by
  the layer's `_DecodeConcatQuantFP8` with its q_scale; `fit_kpool_indices_to_aiter` (a pass-through at the buffer's
  own width); the backend's own ragged Triton remap `triton_convert_req_index_to_global_index` (request-local top-k
  positions to flat cache rows, written at each token's `paged_kv_indptr` offset, invalid entries as row 0); heads
  padded to AITER's multiple of 16 (`AiterMLAHelper`), then `_forward_mla`'s dispatch to
  `rocm_aiter_ops.mla_decode_fwd` (vLLM's custom op and its body) with the persistent plan and the layer's scales,
  the padded heads sliced off.

AITER (`get_mla_metadata_info_v1`, `get_mla_metadata_v1`, `mla_decode_fwd`) is attnfuzz's stand-in on every host
(`fuzzer.support.standins.aiter_mla`, an emulated gfx950: no attnfuzz host has an AMD GPU): named in every result,
with what its public contract leaves open (`not_public`). vLLM's platform check would not pick the backend here; the
engine is built as a gfx950 host builds it, and every result's shims say how.

Not driven (gfx950 with AITER's default settings takes none of them for DeepSeek-V3.2's 576-wide heads): the
rope-free 512-wide form and gfx942's long bf16 prefills (vLLM's Triton `rocm_sparse_attn_prefill`/`_decode_bf16`),
attention sinks (`mla_decode_fwd_lse`), AITER's Triton sparse kernel (`VLLM_ROCM_USE_AITER_TRITON_SPARSE_MLA`), the
kpool tail (a top-k buffer wider than index_topk), gfx942's float8_e4m3fnuz cache, and the layer's dense-MHA route.

Cases: heads 8 to 128 (8 padded to 16 by repetition), bf16 and per-tensor fp8 caches, blocks of 16, 64 and 128
(the backend takes multiples of 16), top-k rows as DeepSeek's indexer fills them (the ragged lengths are computed
from positions, not read from the rows: a row holding fewer valid entries attends to cache row 0 in their place, by
design), traces (one builder across steps: its plan reuse and shrink-tail zeroing), CUDA-graph padding tokens (their
rows get no entry: what AITER writes for them is not public, and they are not judged where the stand-in says so),
full CUDA graphs (UNIFORM_BATCH; emulated on a CPU). No MTP draft updates: its builder rebuilds (an ordinary step).
"""

from __future__ import annotations

import dataclasses

from fuzzer.env import STATE_DIR
from fuzzer.repro_spec import Call, ReproSpec, unchecked_unless_memory
from fuzzer.support import rocm_aiter_sparse_runtime as runtime
from fuzzer.support.vllm_setup import HEAD_SIZE
from fuzzer.support.interp.corrections import EVERY
from fuzzer.support.sparse_mla_steps import forward_mqa
from fuzzer.targets.base import WHOLE, RunPlan
from fuzzer.targets.flashinfer_sparse_sm90 import FlashInferMLASparseSM90, per_tensor_fp8_writer
from fuzzer.targets.flashmla_sparse import FlashMLASparse, StepContext, flashmla_repro
from fuzzer.targets.harness import with_padded_tokens
from fuzzer.targets.vllm_api import remap_api
from strategies.batches import AttentionFeatures, attention_space
from strategies.tensors import fp8_kv_scale, fp8_query_scale

NOT_JUDGED_PADDING = ("the CUDA-graph padding tokens' rows get no KV entry (they are past the builder's qo_indptr), "
                      "and what AITER writes for them is not public (the stand-in leaves them as they were): their "
                      "output is not judged")


class RocmAiterMLASparse(FlashMLASparse):
    name = "vllm.rocm_aiter_sparse"
    summary = ("AITER sparse-MLA backend for gfx942/gfx950 (ROCM_AITER_MLA_SPARSE): builder + persistent plan + "
               "impl.forward_mqa, bf16 and fp8 (AITER's kernels a stand-in)")
    bug_classes = "A B C D H I J K M"
    real_parts = ("ROCMAiterMLASparseMetadataBuilder (its ragged lengths, paged_kv_indptr and plan fingerprint; the "
                  "sparse-MLA builder)", "ROCMAiterMLASparseImpl.forward_mqa and _forward_mla (head padding, dispatch)",
                  "the backend's Triton kernels (generate_sparse_seqlen_kernel, its ragged index remap)",
                  "rocm_aiter_ops.mla_decode_fwd (vLLM's custom op and its body)",
                  "MLAAttention's fp8 query quantization (_DecodeConcatQuantFP8)")
    kv_cache_dtypes = ("bfloat16", "fp8")
    vllm_backend = "ROCM_AITER_MLA_SPARSE"
    mtp_draft = False  # no update_draft_decode_metadata: vLLM rebuilds (an ordinary step)
    cudagraph_modes = ("none", "full")
    HEADS = (16, 8, 32, 64, 128)
    BLOCK_SIZES = (64, 128, 16)

    cache = staticmethod(FlashInferMLASparseSM90.cache)  # per-tensor fp8: 576 e4m3 bytes a token

    def unavailable(self) -> str | None:
        try:
            runtime.backend(self.device)
        except Exception as e:
            return f"cannot import vLLM's {self.vllm_backend} backend: {type(e).__name__}: {e}"
        return None

    def prepare(self) -> None:
        # every interpreter correction, whatever the kernels reach (a reproducer installs those its route needs)
        self.backend, self.emulated, shims = runtime.prepare_host(self.device, EVERY)
        self.shims = [*shims, *runtime.layer_quant_shim(None, self.device)]
        self.real_parts = type(self).real_parts
        self.cfg = self.runtime(str(STATE_DIR))
        self.block_stride_rows = remap_api().has_block_stride_rows

    def cases(self, profile, plan: RunPlan = WHOLE):
        modes = plan.graph_modes(self) if self.device == "cpu" else ("none",)
        return attention_space(profile, AttentionFeatures(
            kv_cache_dtypes=plan.kv_dtypes(self), heads=self.HEADS, block_sizes=self.BLOCK_SIZES,
            block_stride_rows=self.has_block_stride_rows(), cudagraph_padding=True, traces=True,
            cudagraph_modes=modes, mtp_draft=False, topk_rows=("indexer",), topk_valid_first=True,
            graph_padding_full_only=True))

    def kv_cache_spec(self, case, cfg):
        return runtime.kv_cache_spec(self.backend, cfg, case.kv_cache_dtype, case.block_size)

    def writer(self, case):
        """MLAAttention's concat_and_cache_mla; a per-tensor fp8 cache with the layer's k_scale."""
        return per_tensor_fp8_writer(self.device, case) if case.kv_cache_dtype == "fp8" else super().writer(case)

    def engine_scales(self, case) -> dict:
        """A per-tensor fp8 checkpoint's k_scale and q_scale (1.0 where it has none); 1.0 for bf16."""
        fp8 = case.kv_cache_dtype == "fp8"
        return dict(k_scale=fp8_kv_scale(case) if fp8 else 1.0, q_scale=fp8_query_scale(case) if fp8 else 1.0)

    def query_fp8_scale(self, case) -> float | None:
        return self.engine_scales(case)["q_scale"] if case.kv_cache_dtype == "fp8" else None

    def new_engine(self, ctx: StepContext, step) -> None:
        impl, layer, builder = runtime.engine(self.backend, ctx.cfg, ctx.spec, step.heads, step.kv_cache_dtype,
                                              ctx.topk_buffer, device=self.device, **self.engine_scales(step))
        ctx.engine.update(impl=impl, layer=layer, builder=builder)

    def mqa_step(self, ctx: StepContext, step, inp):
        """FlashMLASparse.mqa_step, except that a replayed step with graph padding is not also run eagerly on its
        metadata: vLLM never runs padded metadata outside a FULL graph (the runner pads only for FULL, `pad_attn`),
        and this backend's Python refuses it (its remap asserts req_id_per_token, cut at the real tokens, and the
        top-k rows, the padded count, cover the same tokens): what a replay runs is the captured kernels."""
        runtime.undocumented()  # what earlier steps' calls left
        if not (step.replays_graph and step.padded_tokens):
            return super().mqa_step(ctx, step, inp)
        graphs, engine = ctx.graphs, ctx.engine
        if not engine:
            self.new_engine(ctx, step)
        if ctx.first and graphs.sizes:  # the runner captures before its first step
            graphs.capture(engine["builder"], lambda q, md: {"out": forward_mqa(engine["impl"], q, ctx.cache, md,
                                                                               engine["layer"])[0]},
                           (step.heads, HEAD_SIZE), inp.q.dtype, ctx.topk_buffer)
            ctx.notes["cudagraph"] = {"captured": [list(s) for s in graphs.sizes], "emulated": graphs.emulated}
        engine["cam"] = graphs.stage(step, inp.index)
        engine["metadata"] = engine["builder"].build(0, engine["cam"])
        outputs = graphs.replay(step, with_padded_tokens(step, inp.q))
        if ctx.rerun:
            outputs["out_again"] = graphs.replay(step, with_padded_tokens(step, inp.q))["out"]
        ctx.notes.setdefault("cudagraph", {"emulated": graphs.emulated})["replayed"] = step.num_actual_tokens
        ctx.notes["padded_replay_not_run_eagerly"] = ("vLLM runs padded metadata only in a FULL graph; the backend's "
                                                      "Python refuses it eagerly")
        return outputs

    def finish(self, obs, case, slots, cache, before, write_emulated, overruns, guards):
        obs = super().finish(obs, case, slots, cache, before, write_emulated, overruns, guards)
        found = runtime.undocumented()
        if found:
            obs.notes["not_public"] = sorted({what for what, _ in found})
        if (scale := self.query_fp8_scale(case)) is not None:
            obs.notes["query_fp8_scale"] = scale
        if "out_padded" in obs.outputs and any("no KV entries" in what for what, _ in found):
            del obs.outputs["out_padded"]
            obs.notes["padded_tokens_not_judged"] = NOT_JUDGED_PADDING
        return obs

    def repro_spec(self, finding) -> ReproSpec:
        spec = flashmla_repro(self, finding, layer=False)
        steps = [dict(s, EAGER=False) if s.get("REPLAY") and step.padded_tokens else s  # as mqa_step: replay only
                 for s, step in zip(spec.constants["STEPS"], finding.case.steps)]
        spec = dataclasses.replace(spec, constants={**spec.constants, "STEPS": steps}, about=spec.about + (
            f" {self.vllm_backend}: AITER's get_mla_metadata_v1 and mla_decode_fwd are attnfuzz's stand-ins for a "
            "gfx950 device (fuzzer.support.standins.aiter_mla), vLLM's platform check bypassed as that device's host "
            "would pass it."))
        return unchecked_unless_memory(spec, finding, "the stand-ins check their own accesses")

    def repro_prepare(self, layer: bool, case=None) -> tuple[Call, ...]:
        return (Call(runtime.prepare_host, dict(device="DEVICE"), assign="backend, emulated, shims"),)

    def repro_spec_call(self) -> Call:
        return Call(runtime.kv_cache_spec, dict(backend_cls="backend", cfg="cfg", kv_cache_dtype="KV_CACHE_DTYPE",
                                                block_size="BLOCK_SIZE"), assign="spec")

    def repro_engine(self, case, layer: bool) -> Call:
        scales = {name: repr(value) for name, value in self.engine_scales(case).items()}
        return Call(runtime.engine, dict(backend_cls="backend", cfg="cfg", spec="spec", heads="HEADS",
                                         kv_cache_dtype="KV_CACHE_DTYPE", topk_indices_buffer="topk_indices_buffer",
                                         device="DEVICE", **scales),
                    assign="impl, layer, builder", note="the impl, the layer vLLM hands forward_mqa, the builder")
