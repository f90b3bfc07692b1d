"""`vllm.flashinfer_sparse_sm100` and `vllm.flashinfer_sparse_sm120`: vLLM's FlashInfer sparse-MLA backends for
Blackwell, whole, on the MQA route: FLASHINFER_MLA_SPARSE (`FlashInferMLASparseTRTLLMBackend`, SM100, FlashInfer's
trtllm-gen kernel) and FLASHINFER_MLA_SPARSE_SM120 (`FlashInferMLASparseSM120Backend`, SM120, FlashInfer's "sparse"
kernel), both in vllm/v1/attention/backends/mla/flashinfer_mla_sparse.py (SM120's impl in flashinfer_mla_sparse_sm120.py).

vLLM's code under test, run for real (its Triton kernels interpreted and bounds-checked on a CPU):
- SM100: FlashInferMLASparseTRTLLMMetadataBuilder (the shared sparse-MLA builder through
  FlashInferMLASparseMetadataBuilder: reorder threshold 128 up to 32 heads, 256 at 64, 1024 at 128, spec decodes as
  decodes; its in-place `update_draft_decode_metadata` for MTP draft steps), and FlashInferMLASparseImpl.forward_mqa
  (SparseMLACommonImpl's: the index group's conversion, valid entries compacted to the front with their counts)
  into its `_forward_mqa_kernel`: the cache as flat rows in pages of gcd(block stride, block size, 64), the top-k
  rows as a one-token-per-request page table of width the buffer's, the valid counts as `seq_lens`, bmm scales
  folded from the layer's q/k scales. bf16 caches and per-tensor fp8 ("fp8", e4m3), for which MLAAttention hands
  forward_mqa its query quantized to fp8 with the layer's q_scale (`supports_quant_query_input`; the oracle judges
  against attention over that query, `query_fp8_scale`).
- SM120: FlashInferMLASparseMetadataBuilder and FlashInferMLASparseSM120Impl.forward_mqa: vLLM's index remap (no
  counts, -1 entries left where they are), the cache as 64-row pages of 656-byte fp8_ds_mla entries, FlashInfer's
  scale format picked from the model (`_kv_scale_format_for_model`: GLM's arbitrary fp32 scales, DeepSeek's powers of
  two). fp8_ds_mla only (the impl refuses every other cache; the backend canonicalizes fp8 to it).

FlashInfer's kernel is attnfuzz's stand-in on every host (`fuzzer.support.standins.flashinfer_trtllm_mla`, emulating
the SM100 or SM120 device; no attnfuzz host has one): named in every result, with what its public contract leaves open
(`not_public` in the result's notes). vLLM's platform check would choose neither backend here; the engines are built
as such a host builds them, and every result says so (its shims).

Cases: heads 8 to 128 (trtllm-gen takes none of 65-127, which DeepSeek's 128 heads over TP never give); traces (one
builder, impl, cache and top-k buffer across steps); full CUDA graphs (both builders declare UNIFORM_BATCH; on a CPU
the replay is emulated; on a GPU the stand-in reads lengths on the host, which a graph cannot capture, so eager only).
SM100: blocks of 32, 64 and 128; its top-k rows as DeepSeek's indexer fills them (`topk_rows` "indexer": a real token
always selects itself), since what trtllm-gen returns for a row of no entries is not public; CUDA-graph padding
tokens have such rows, and their output is not judged where the stand-in says so; MTP draft steps. SM120: blocks of
64 and 128; drawn top-k rows too (its kernel's answer for a row of no candidate is public: 0); each fp8 scale
convention with the model whose format reads it (power-of-two scales with DeepSeek-V3.2, arbitrary ones with GLM-5:
which one vLLM 0.33.0's compiled cache writer stores cannot be read from Python). vLLM picks SM120 only for
index_topk == 2048 (its supports_combination); the builder, impl and the kernel's decode envelope (top-k >= 1, up to
64 tokens) take any width, and cases draw the profile's.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from fuzzer.errors import HarnessError
from fuzzer.env import STATE_DIR
from fuzzer.repro_spec import Call, ReproSpec
from fuzzer.support import flashinfer_sparse_runtime
from fuzzer.targets.base import WHOLE, RunPlan
from fuzzer.targets.flashinfer_sparse_sm90 import FlashInferMLASparseSM90, per_tensor_fp8_writer
from fuzzer.targets.flashmla_sparse import FlashMLASparse, StepContext, flashmla_repro
from fuzzer.targets.vllm_api import remap_api
from strategies.batches import AttentionFeatures, attention_space
from strategies.tensors import fp8_kv_scale, fp8_query_scale

NOT_JUDGED_PADDING = ("the CUDA-graph padding tokens' rows select no entry, and what trtllm-gen writes for such a row "
                      "is not public (the stand-in leaves it NaN): their output is not judged")


class FlashInferMLASparseBlackwell(FlashMLASparse):
    """What both Blackwell FlashInfer backends share: the engine made by `flashinfer_sparse_runtime` for the device
    (MAJOR), FlashInfer's kernel the stand-in for that device, graphs emulated on a CPU."""

    MAJOR: ClassVar[int]
    HEADS = (16, 8, 32, 64, 128)
    BLOCK_SIZES: ClassVar[tuple[int, ...]]
    TOPK_ROWS: ClassVar[tuple[str, ...]]
    FP8_SCALES: ClassVar[tuple[str, ...] | None] = None
    cudagraph_modes = ("none", "full")

    def unavailable(self) -> str | None:
        try:
            flashinfer_sparse_runtime.backend(self.MAJOR, self.device)
        except Exception as e:
            return f"cannot import vLLM's {self.vllm_backend} backend: {type(e).__name__}: {e}"
        return None

    def prepare(self) -> None:
        self.backend, self.emulated, shims = flashinfer_sparse_runtime.prepare_host(self.MAJOR, self.device)
        self.shims = [*shims, *flashinfer_sparse_runtime.layer_quant_shim(self.MAJOR, self.device)]
        self.real_parts = type(self).real_parts
        self.cfg = self.runtime(str(STATE_DIR))
        self.block_stride_rows = remap_api().has_block_stride_rows

    def cases(self, profile, plan: RunPlan = WHOLE):
        modes = plan.graph_modes(self) if self.graphs_run_here() else ("none",)
        return attention_space(profile, AttentionFeatures(
            kv_cache_dtypes=plan.kv_dtypes(self), heads=self.HEADS, block_sizes=self.BLOCK_SIZES,
            block_stride_rows=self.has_block_stride_rows(), cudagraph_padding=True, traces=True,
            cudagraph_modes=modes, mtp_draft=self.mtp_draft, topk_rows=self.TOPK_ROWS, fp8_scales=self.FP8_SCALES))

    def graphs_run_here(self) -> bool:
        """Full graphs: emulated on a CPU. On a GPU the stand-in reads each row's length on the host, which a captured
        graph cannot."""
        return self.device == "cpu"

    def run(self, case):
        if case.cudagraph != "none" and not self.graphs_run_here():
            raise HarnessError(f"case.cudagraph {case.cudagraph!r}: {self.name}'s FlashInfer stand-in reads lengths on "
                               "the host, which a CUDA graph cannot capture: full graphs run on a CPU (emulated)")
        return super().run(case)

    def kv_cache_spec(self, case, cfg):
        return flashinfer_sparse_runtime.kv_cache_spec(self.backend, cfg, case.kv_cache_dtype, case.block_size)

    def engine_scales(self, case) -> dict:
        """The checkpoint's scales and the model the engine is built for (`flashinfer_sparse_runtime.engine`)."""
        return dict(k_scale=1.0, q_scale=1.0, model_type="deepseek_v32")

    def new_engine(self, ctx: StepContext, step) -> None:
        impl, layer, builder = flashinfer_sparse_runtime.engine(
            self.MAJOR, self.backend, ctx.cfg, ctx.spec, step.heads, step.kv_cache_dtype, ctx.topk_buffer,
            device=self.device, **self.engine_scales(step))
        ctx.engine.update(impl=impl, layer=layer, builder=builder)

    def mqa_step(self, ctx: StepContext, step, inp):
        flashinfer_sparse_runtime.undocumented()  # what earlier steps' calls left
        return super().mqa_step(ctx, step, inp)

    def finish(self, obs, case, slots, cache, before, write_emulated, overruns, guards):
        obs = super().finish(obs, case, slots, cache, before, write_emulated, overruns, guards)
        found = flashinfer_sparse_runtime.undocumented()
        if found:
            obs.notes["not_public"] = sorted({what for what, _ in found})
        return obs

    def repro_spec(self, finding) -> ReproSpec:
        spec = flashmla_repro(self, finding, layer=False)
        return dataclasses.replace(spec, about=spec.about + (
            f" {self.vllm_backend}: FlashInfer's trtllm_batch_decode_with_kv_cache_mla is attnfuzz's stand-in for an "
            f"SM{self.MAJOR}0 device (flashinfer 0.7.2.post1's API and checks; fuzzer.support.standins."
            "flashinfer_trtllm_mla), vLLM's platform check bypassed as that device's host would pass it."))

    def repro_prepare(self, layer: bool, case=None) -> tuple[Call, ...]:
        return (Call(flashinfer_sparse_runtime.prepare_host, dict(major=repr(self.MAJOR), device="DEVICE"),
                     assign="backend, emulated, shims"),)

    def repro_spec_call(self) -> Call:
        return Call(flashinfer_sparse_runtime.kv_cache_spec, dict(backend_cls="backend", cfg="cfg",
                                                                  kv_cache_dtype="KV_CACHE_DTYPE",
                                                                  block_size="BLOCK_SIZE"), assign="spec")

    def repro_engine(self, case, layer: bool) -> Call:
        scales = {name: repr(value) for name, value in self.engine_scales(case).items()}
        return Call(flashinfer_sparse_runtime.engine, dict(major=repr(self.MAJOR), backend_cls="backend", cfg="cfg",
                                                           spec="spec", heads="HEADS", kv_cache_dtype="KV_CACHE_DTYPE",
                                                           topk_indices_buffer="topk_indices_buffer", device="DEVICE",
                                                           **scales),
                    assign="impl, layer, builder", note="the impl, the layer vLLM hands forward_mqa, the builder")


class FlashInferMLASparseSM100(FlashInferMLASparseBlackwell):
    name = "vllm.flashinfer_sparse_sm100"
    summary = ("FlashInfer sparse-MLA backend for SM100 (FLASHINFER_MLA_SPARSE, trtllm-gen): builder + draft update + "
               "impl.forward_mqa, bf16 and fp8 (FlashInfer's kernel a stand-in)")
    bug_classes = "A B C D H I J K M"
    real_parts = ("FlashInferMLASparseTRTLLMMetadataBuilder (FlashInferMLASparseMetadataBuilder, the sparse-MLA "
                  "builder) and its update_draft_decode_metadata",
                  "FlashInferMLASparseImpl.forward_mqa (SparseMLACommonImpl's) and _forward_mqa_kernel",
                  "SparseMLAIndexGroup", "the index-remap Triton kernel",
                  "MLAAttention's fp8 query quantization (_DecodeConcatQuantFP8)")
    kv_cache_dtypes = ("bfloat16", "fp8")
    vllm_backend = "FLASHINFER_MLA_SPARSE"
    mtp_draft = True  # update_draft_decode_metadata (supports_draft_decode_metadata_update without DCP/PCP/HiSparse)
    MAJOR = 10
    BLOCK_SIZES = (64, 128, 32)
    TOPK_ROWS = ("indexer",)

    cache = staticmethod(FlashInferMLASparseSM90.cache)  # per-tensor fp8: 576 e4m3 bytes a token

    def writer(self, case):
        """MLAAttention's concat_and_cache_mla; a per-tensor fp8 cache with the layer's k_scale."""
        return per_tensor_fp8_writer(self.device, case) if case.kv_cache_dtype == "fp8" else super().writer(case)

    def engine_scales(self, case) -> dict:
        """A per-tensor fp8 checkpoint's k_scale and q_scale (1.0 where it has none); 1.0 for bf16."""
        fp8 = case.kv_cache_dtype == "fp8"
        return dict(k_scale=fp8_kv_scale(case) if fp8 else 1.0, q_scale=fp8_query_scale(case) if fp8 else 1.0,
                    model_type="deepseek_v32")

    def query_fp8_scale(self, case) -> float | None:
        return self.engine_scales(case)["q_scale"] if case.kv_cache_dtype == "fp8" else None

    def finish(self, obs, case, slots, cache, before, write_emulated, overruns, guards):
        obs = super().finish(obs, case, slots, cache, before, write_emulated, overruns, guards)
        if (scale := self.query_fp8_scale(case)) is not None:
            obs.notes["query_fp8_scale"] = scale
        if "out_padded" in obs.outputs and any("seq_lens 0" in what for what in obs.notes.get("not_public", ())):
            del obs.outputs["out_padded"]
            obs.notes["padded_tokens_not_judged"] = NOT_JUDGED_PADDING
        return obs


class FlashInferMLASparseSM120(FlashInferMLASparseBlackwell):
    name = "vllm.flashinfer_sparse_sm120"
    summary = ("FlashInfer sparse-MLA backend for SM120 (FLASHINFER_MLA_SPARSE_SM120): builder + impl.forward_mqa, "
               "fp8_ds_mla with DeepSeek's and GLM's scale formats (FlashInfer's kernel a stand-in)")
    bug_classes = "B C D H I J K M"
    real_parts = ("FlashInferMLASparseMetadataBuilder (the sparse-MLA builder)",
                  "FlashInferMLASparseSM120Impl.forward_mqa and _run_mqa_kernel", "the index-remap Triton kernel")
    kv_cache_dtypes = ("fp8_ds_mla",)
    vllm_backend = "FLASHINFER_MLA_SPARSE_SM120"
    mtp_draft = False  # its builder has no in-place draft update: vLLM rebuilds (an ordinary step)
    MAJOR = 12
    BLOCK_SIZES = (64, 128)
    TOPK_ROWS = ("drawn", "indexer")
    FP8_SCALES = tuple(flashinfer_sparse_runtime.MODEL_TYPES)  # each writer convention with the model that reads it

    def engine_scales(self, case) -> dict:
        """fp8_ds_mla entries carry their own scales; the model (its `model_type`) picks how FlashInfer reads them."""
        return dict(k_scale=1.0, q_scale=1.0, model_type=flashinfer_sparse_runtime.MODEL_TYPES[case.fp8_scale])
