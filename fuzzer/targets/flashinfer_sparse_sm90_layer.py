"""`vllm.flashinfer_sparse_sm90.layer`: vLLM's MLAAttention layer on FLASHINFER_MLA_SPARSE_SM90, whole.

The layer target's split (`vllm.flashmla_sparse.layer`: decode tokens through W_UK absorption to forward_mqa,
short prefills to dense MHA with chunked context) on FlashInfer's SM90 sparse backend (`vllm.flashinfer_sparse_sm90`:
its plan, plan reuse and kv_end clamp, index remap and page packing). Its builder's reorder threshold (8/16/32 heads:
queries of up to 128 tokens count as decodes; 64: 256; 128: 1024) decides which requests leave for dense MHA, and
the builder asks the layer itself (`MLAAttention._use_sparse_mha`) whether they do: then it plans FlashInfer for the
decode prefix alone, which forward_mqa must then be handed. bf16 and per-tensor fp8 (the layer's k_scale, 1.0 or
a calibrated checkpoint's). FlashInfer's wrapper is attnfuzz's stand-in unless the GPU host has FlashInfer itself,
named in every result. Eager engines.
"""

from __future__ import annotations


from fuzzer.repro_spec import Call
from fuzzer.support import flashinfer_runtime
from fuzzer.targets.base import WHOLE, RunPlan
from fuzzer.targets.flashinfer_sparse_sm90 import FlashInferMLASparseSM90, sm90_repro
from fuzzer.targets.flashmla_layer import FlashMLASparseLayer
from fuzzer.targets.flashmla_sparse import StepContext
from strategies.batches import AttentionFeatures, attention_space


class FlashInferMLASparseSM90Layer(FlashMLASparseLayer, FlashInferMLASparseSM90):
    name = "vllm.flashinfer_sparse_sm90.layer"
    summary = ("MLAAttention on FLASHINFER_MLA_SPARSE_SM90: decode -> forward_mqa (FlashInfer plan/clamp), short "
               "prefill -> dense MHA + chunked context")
    bug_classes = "A B C F H I J K"
    real_parts = ("MLAAttention.forward_impl (the decode/MHA split, W_UK/W_UV)",
                  "FlashInferMLASparseSM90Builder (FlashInferMLASparseMetadataBuilder, the sparse-MLA builder)",
                  "_SM90State.plan (host lengths, plan reuse) and its Triton `_clamp_work_kv_end`",
                  "FlashInferMLASparseSM90Impl.forward_mqa / forward_mha", "chunked-context metadata",
                  "CPU_SDPA_MLA prefill backend", "the index-remap Triton kernel", "the Triton `_pack_topk_indices`",
                  "merge_attn_states")
    kv_cache_dtypes = ("bfloat16", "fp8")
    cudagraph_modes = ("none",)  # eager engines: full graphs are replayed on vllm.flashinfer_sparse_sm90's forward_mqa

    def cases(self, profile, plan: RunPlan = WHOLE):
        profile = profile.reaching_routes()  # steps past the decode thresholds (128, 256 by heads), up to top-k
        # Top-k rows as the indexer fills them only: the builder plans each row's count from its context.
        return attention_space(profile, AttentionFeatures(
            kv_cache_dtypes=plan.kv_dtypes(self), block_sizes=(64, 128), block_stride_rows=self.has_block_stride_rows(),
            indexer_fills_short_seqs=True, vllm_batch_order=True, cudagraph_padding=True, traces=True,
            topk_rows=("indexer",)))

    def layer_step(self, ctx: StepContext, step, inputs):
        if not ctx.engine:  # the layer on this backend, its scale as the cache was written, the builder under FlashInfer
            ctx.engine["builder"], ctx.engine["layer"], ctx.engine["route"] = flashinfer_runtime.layer_engine(
                self.backend, ctx.cfg, ctx.spec, step.heads, inputs.kv_b_weight, ctx.topk_buffer,
                self.k_scale(step), self.device)
        return super().layer_step(ctx, step, inputs)

    def repro_spec(self, finding):
        return sm90_repro(self, finding, layer=True)

    def repro_prepare(self, layer: bool, case=None) -> tuple[Call, ...]:
        if not layer:
            return super().repro_prepare(layer, case)
        return (Call(flashinfer_runtime.prepare_sm90_layer_host, dict(device="DEVICE"),
                     assign="backend, emulated, shims"),)

    def repro_engine(self, case, layer: bool) -> Call:
        if not layer:
            return super().repro_engine(case, layer)
        return Call(flashinfer_runtime.layer_engine, dict(backend_cls="backend", cfg="cfg", spec="spec", heads="HEADS",
                                                          kv_b_weight='T["kv_b_weight"]',
                                                          topk_indices_buffer="topk_indices_buffer",
                                                          k_scale=repr(self.k_scale(case)), device="DEVICE"),
                    assign="builder, layer, route", note="the MLAAttention layer, the builder, the route counts")
