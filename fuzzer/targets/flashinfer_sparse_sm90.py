"""`vllm.flashinfer_sparse_sm90`: vLLM's FlashInfer sparse-MLA backend for Hopper (`FLASHINFER_MLA_SPARSE_SM90`),
whole, on the MQA route.

vLLM's code under test, run for real (its Triton kernels interpreted and bounds-checked on a CPU):
FlashInferMLASparseSM90Builder (the shared sparse-MLA builder through FlashInferMLASparseMetadataBuilder: reorder
threshold 128 for up to 32 heads, 256 for 64, 1024 for 128, spec decodes as decodes, non-uniform decode split) with
its `_SM90State`: per-row KV lengths planned on the host from the batch layout (a row of context c holds min(c,
index_topk) indices, as DeepSeek's indexer fills it), exact without `seq_lens_cpu_upper_bound` and otherwise upper
bounds plus 32 tokens of slack, a plan reused while they still fit, and `_clamp_work_kv_end`, which rewrites each
planned work item's `kv_end` in FlashInfer's int workspace to the row's exact count; then
FlashInferMLASparseSM90Impl.forward_mqa: vLLM's index remap (valid entries compacted to the front), `_pack_topk_indices`
into the plan's page table, and FlashInfer's `BatchMLAPagedAttentionWrapper.run` on the cache as pages of one token,
bf16 or per-tensor fp8 (e4m3, dequantized in the kernel with the layer's k_scale for the latent and 1.0 for RoPE).

FlashInfer itself (a JIT library no attnfuzz host installs; vLLM 0.33.0 pins flashinfer-python 0.7.2.post1, a 62 MB
wheel compiled with nvcc at first use) is attnfuzz's stand-in on every host, the GPU's included, and every result
names it: `fuzzer.support.standins.flashinfer_mla`, FlashInfer's fa3 planner (`MLAPlan`: its work items, splits and
merge, laid out in the int workspace as FlashInfer lays them, which vLLM's clamp edits) and its SM90 kernel's
semantics, bounds-checked. Without FlashInfer vLLM would not route to this backend (its `supports_combination` asks
`has_flashinfer_sm90_nope_mla()`); the target runs it as a host with FlashInfer >= 0.6.18 would.

Cases: the step's top-k rows as the indexer fills them (`topk_rows` "indexer": min(visible, topk) valid positions a
row): the backend plans each row's attended count from its context, not from its indices, so a row holding fewer is
outside its contract (it would attend to the row's first slot again: README, "FlashInfer's SM90 sparse backend").
Head size 576 (DeepSeek-V3.2's rope MLA); the NoPE form (512) is not drawn. kv-cache dtypes bf16 and "fp8" (k_scale 1.0, or a calibrated checkpoint's); blocks of 64 and 128; heads 8 to 128
(the stand-in's attention is torch, not interpreted); traces (one builder and its plan across steps); full CUDA graphs
(uniform decode steps replayed from graphs captured at start-up; on a CPU the replay is emulated, and FlashInfer's
launch parameters are the capture's, as a captured launch keeps them). On a GPU, eager engines only: the stand-in
reads its plan on the host, which a graph cannot capture.
"""

from __future__ import annotations

import dataclasses

import torch

from fuzzer.errors import HarnessError
from fuzzer.repro_spec import Call, ReproSpec, unchecked_unless_memory
from fuzzer.support import flashinfer_runtime
from fuzzer.support.vllm_setup import has_cache_op
from fuzzer.support.standins.cache_ops import concat_and_cache_mla
from fuzzer.targets.base import WHOLE, RunPlan
from fuzzer.targets.flashmla_sparse import FlashMLASparse, StepContext, flashmla_repro
from fuzzer.targets.harness import paged_cache
from fuzzer.targets.vllm_api import remap_api
from fuzzer.env import STATE_DIR
from strategies.batches import AttentionFeatures, attention_space
from strategies.tensors import fp8_kv_scale


def sm90_repro(target, finding, layer: bool) -> ReproSpec:
    """FlashMLA's reproducer of the step (or the layer's), saying what FlashInfer's wrapper was. The step's
    reproducer of a finding that is not a memory one runs vLLM's interpreted kernels (index remap, page packing,
    kv_end clamp: integer ones, no scalar masks for the checker to correct) without the bounds checker, as its GPU
    reproducer runs without compute-sanitizer: a run the checker saw nothing in is the same without it, and the
    stand-in's own checks still report."""
    spec = flashmla_repro(target, finding, layer=layer)
    spec = dataclasses.replace(spec, about=spec.about + (
        f" FLASHINFER_MLA_SPARSE_SM90{' under MLAAttention' if layer else ''}: FlashInfer's "
        "BatchMLAPagedAttentionWrapper is attnfuzz's stand-in (flashinfer.mla, imported by the builder), FlashInfer 0.7.2.post1's planner and kernel "
        "semantics, unless the GPU host has FlashInfer itself (the script prints which)."))
    if layer:  # the layer's dense-MHA float kernels: checked as before
        return spec
    return unchecked_unless_memory(spec, finding, "the stand-in checks its own accesses")


def per_tensor_fp8_writer(device: str, case):
    """(write(kv_c, k_pe, cache, slots), emulated op name or None) for a per-tensor fp8 cache: vLLM's
    concat_and_cache_mla (or its stand-in), as MLAAttention calls it: the layer's k_scale, skip_scale where it is 1.0."""
    k_scale = fp8_kv_scale(case)
    skip = k_scale == 1.0
    if device != "cpu" and has_cache_op("concat_and_cache_mla"):
        op = torch.ops._C_cache_ops.concat_and_cache_mla
        return (lambda kv_c, k_pe, cache, slots: op(kv_c, k_pe, cache, slots, "fp8",
                                                    torch.tensor(k_scale, device=cache.device), skip)), None
    return (lambda kv_c, k_pe, cache, slots: concat_and_cache_mla(
        kv_c, k_pe, cache, slots, "fp8", torch.tensor(k_scale, device=cache.device), skip)), "concat_and_cache_mla"


class FlashInferMLASparseSM90(FlashMLASparse):
    name = "vllm.flashinfer_sparse_sm90"
    summary = ("FlashInfer sparse-MLA backend for Hopper (FLASHINFER_MLA_SPARSE_SM90): builder + plan/clamp + "
               "impl.forward_mqa, bf16 and fp8 (FlashInfer a stand-in unless the GPU host has it)")
    bug_classes = "A B C D H I J K M"
    real_parts = ("FlashInferMLASparseSM90Builder (FlashInferMLASparseMetadataBuilder, the sparse-MLA builder)",
                  "_SM90State.plan (host lengths, plan reuse) and its Triton `_clamp_work_kv_end`",
                  "FlashInferMLASparseSM90Impl.forward_mqa", "the index-remap Triton kernel",
                  "the Triton `_pack_topk_indices`")
    kv_cache_dtypes = ("bfloat16", "fp8")
    vllm_backend = flashinfer_runtime.NAME
    cudagraph_modes = ("none", "full")
    mtp_draft = False  # its builder has no in-place draft update: vLLM rebuilds (an ordinary step)
    HEADS = (16, 8, 32, 64, 128)  # 128 heads x many tokens: FlashInfer's planner takes clusters of 2 CTAs

    def unavailable(self) -> str | None:
        try:
            flashinfer_runtime.backend(self.device)
        except Exception as e:
            return f"cannot import vLLM's {self.vllm_backend} backend: {type(e).__name__}: {e}"
        return None

    def prepare(self) -> None:
        self.backend, self.emulated, self.shims = flashinfer_runtime.prepare_sm90_host(self.device)
        if not flashinfer_runtime.vllm_gate():
            self.shims.append("vLLM's has_flashinfer_sm90_nope_mla() is False here (no FlashInfer >= 0.6.18): vLLM would "
                              "not pick this backend on this host; it runs as with FlashInfer installed (its stand-in)")
        self.real_parts = type(self).real_parts
        if flashinfer_runtime.real_flashinfer(self.device):
            self.real_parts += (flashinfer_runtime.flashinfer_part(self.device),)
        self.cfg = self.runtime(str(STATE_DIR))
        self.block_stride_rows = remap_api().has_block_stride_rows

    def cases(self, profile, plan: RunPlan = WHOLE):
        modes = plan.graph_modes(self) if self.graphs_run_here() else ("none",)
        return attention_space(profile, AttentionFeatures(
            kv_cache_dtypes=plan.kv_dtypes(self), heads=self.HEADS, block_sizes=(64, 128),
            block_stride_rows=self.has_block_stride_rows(), cudagraph_padding=True, traces=True,
            cudagraph_modes=modes, mtp_draft=False, topk_rows=("indexer",)))

    def graphs_run_here(self) -> bool:
        """Full graphs: emulated on a CPU; captured on a GPU with FlashInfer's own wrapper (vLLM plans it in
        `build`, into the buffers a `use_cuda_graph=True` wrapper keeps, so a replay reads each step's plan). The
        stand-in's kernel takes its plan from the host at launch, which a captured graph cannot: not on a GPU."""
        return self.device == "cpu" or flashinfer_runtime.real_flashinfer(self.device) is not None

    def run(self, case):
        if case.cudagraph != "none" and not self.graphs_run_here():
            raise HarnessError(f"case.cudagraph {case.cudagraph!r}: {self.name}'s FlashInfer stand-in reads its plan on "
                               "the host, which a CUDA graph cannot capture: full graphs run on a CPU (emulated) or "
                               "with FlashInfer itself on a GPU (ATTNFUZZ_FLASHINFER=real)")
        return super().run(case)

    @staticmethod
    def cache(case, device, guards=None, name: str = "kv_cache"):
        """The paged cache, every row poisoned: NaN for bf16; 0xFF bytes for fp8 (e4m3 NaN)."""
        if case.kv_cache_dtype == "fp8":
            return paged_cache(case, device, dtype=torch.uint8, poison=255, guards=guards, name=name)
        return paged_cache(case, device, guards=guards, name=name)

    def writer(self, case):
        return per_tensor_fp8_writer(self.device, case) if case.kv_cache_dtype == "fp8" else super().writer(case)

    def kv_cache_spec(self, case, cfg):
        return flashinfer_runtime.kv_cache_spec(cfg, case.kv_cache_dtype, case.block_size)

    def new_engine(self, ctx: StepContext, step) -> None:
        impl, layer, builder = flashinfer_runtime.engine(
            self.backend, ctx.cfg, ctx.spec, step.heads, step.kv_cache_dtype, ctx.topk_buffer, self.k_scale(step),
            self.device)
        ctx.engine.update(impl=impl, layer=layer, builder=builder)

    @staticmethod
    def k_scale(case) -> float:
        """The layer's k_scale: per-tensor fp8's (1.0 or a calibrated checkpoint's), 1.0 for bf16."""
        return fp8_kv_scale(case) if case.kv_cache_dtype == "fp8" else 1.0

    def repro_spec(self, finding) -> ReproSpec:
        return sm90_repro(self, finding, layer=False)

    def repro_prepare(self, layer: bool, case=None) -> tuple[Call, ...]:
        return (Call(flashinfer_runtime.prepare_sm90_host, dict(device="DEVICE"), assign="backend, emulated, shims"),)

    def repro_spec_call(self) -> Call:
        return Call(flashinfer_runtime.kv_cache_spec, dict(cfg="cfg", kv_cache_dtype="KV_CACHE_DTYPE",
                                                           block_size="BLOCK_SIZE"), assign="spec")

    def repro_engine(self, case, layer: bool) -> Call:
        k_scale = fp8_kv_scale(case) if case.kv_cache_dtype == "fp8" else 1.0
        return Call(flashinfer_runtime.engine, dict(backend_cls="backend", cfg="cfg", spec="spec", heads="HEADS",
                                                    kv_cache_dtype="KV_CACHE_DTYPE",
                                                    topk_indices_buffer="topk_indices_buffer", k_scale=repr(k_scale),
                                                    device="DEVICE"),
                    assign="impl, layer, builder", note="the impl, the layer vLLM registers it on, the builder")
