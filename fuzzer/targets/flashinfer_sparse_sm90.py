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
from fuzzer.repro_spec import ReproSpec
from fuzzer.support import flashinfer_runtime
from fuzzer.support.flashmla_runtime import cpu_shims, define_missing_c_queries, has_cache_op, prefill_outputs_under_initcheck
from fuzzer.support.interp.corrections import CORRECTIONS, install_corrections
from fuzzer.support.standins.cache_ops import concat_and_cache_mla
from fuzzer.support.standins.cpu_shims import install_cpu_shims
from fuzzer.targets.flashmla_sparse import FlashMLASparse, StepContext, flashmla_repro
from fuzzer.targets.harness import paged_cache
from fuzzer.targets.vllm_api import remap_api
from fuzzer.env import STATE_DIR
from strategies.batches import AttentionFeatures, attention_space
from strategies.tensors import HEAD_SIZE, fp8_kv_scale


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
        self.shims: list[str] = list(define_missing_c_queries())
        if self.device == "cpu":  # before the backend is imported: it binds PIN_MEMORY by name
            install_corrections()
            self.shims += [*install_cpu_shims(), *cpu_shims(), *flashinfer_runtime.cpu_shims(),
                           *(f"interpreter correction: {c}" for c in CORRECTIONS)]
        self.backend, self.emulated = flashinfer_runtime.backend(self.device)
        self.shims += prefill_outputs_under_initcheck(self.device)
        if not flashinfer_runtime.vllm_gate():
            self.shims.append("vLLM's has_flashinfer_sm90_nope_mla() is False here (no FlashInfer >= 0.6.18): vLLM would "
                              "not pick this backend on this host; it runs as with FlashInfer installed (its stand-in)")
        self.real_parts = type(self).real_parts
        if flashinfer_runtime.real_flashinfer(self.device):
            self.real_parts += (flashinfer_runtime.flashinfer_part(self.device),)
        self.cfg = self.runtime(str(STATE_DIR))
        self.block_stride_rows = remap_api().has_block_stride_rows

    def cases(self, profile):
        modes = self.cudagraph_modes if self.device == "cpu" else ("none",)
        return attention_space(profile, AttentionFeatures(
            kv_cache_dtypes=self.kv_cache_dtypes, heads=self.HEADS, block_sizes=(64, 128),
            block_stride_rows=self.has_block_stride_rows(), cudagraph_padding=True, traces=True,
            cudagraph_modes=modes, mtp_draft=False, topk_rows=("indexer",)))

    def run(self, case):
        if case.cudagraph != "none" and self.device != "cpu":
            raise HarnessError(f"case.cudagraph {case.cudagraph!r}: {self.name}'s FlashInfer stand-in reads its plan on "
                               "the host, which a CUDA graph cannot capture, and graphs of FlashInfer itself are not "
                               "wired yet; full graphs are emulated on a CPU only")
        return super().run(case)

    @staticmethod
    def cache(case, device, guards=None, name: str = "kv_cache"):
        """The paged cache, every row poisoned: NaN for bf16; 0xFF bytes for fp8 (e4m3 NaN)."""
        if case.kv_cache_dtype == "fp8":
            return paged_cache(case, device, dtype=torch.uint8, poison=255, guards=guards, name=name)
        return paged_cache(case, device, guards=guards, name=name)

    def writer(self, case):
        """vLLM's concat_and_cache_mla (or its stand-in), as MLAAttention calls it: the layer's k_scale, skip_scale
        where it is 1.0."""
        if case.kv_cache_dtype != "fp8":
            return super().writer(case)
        k_scale = fp8_kv_scale(case)
        skip = k_scale == 1.0
        if self.device != "cpu" and has_cache_op("concat_and_cache_mla"):
            op = torch.ops._C_cache_ops.concat_and_cache_mla
            return (lambda kv_c, k_pe, cache, slots: op(kv_c, k_pe, cache, slots, "fp8",
                                                        torch.tensor(k_scale, device=cache.device), skip)), None
        return (lambda kv_c, k_pe, cache, slots: concat_and_cache_mla(
            kv_c, k_pe, cache, slots, "fp8", torch.tensor(k_scale, device=cache.device), skip)), "concat_and_cache_mla"

    def kv_cache_spec(self, case, cfg):
        return flashinfer_runtime.kv_cache_spec(cfg, case.kv_cache_dtype, case.block_size)

    def new_engine(self, ctx: StepContext, step) -> None:
        impl, layer, builder = flashinfer_runtime.engine(
            self.backend, ctx.cfg, ctx.spec, step.heads, step.kv_cache_dtype, ctx.topk_buffer,
            fp8_kv_scale(step) if step.kv_cache_dtype == "fp8" else 1.0, self.device)
        ctx.engine.update(impl=impl, layer=layer, builder=builder)

    def repro_spec(self, finding) -> ReproSpec:
        return sm90_repro(flashmla_repro(self, finding, layer=False), finding.case)


# The FlashMLA reproducer's text (fuzzer.targets.flashmla_sparse), with this backend's set-up in its place: each
# (old, new) pair must match, so a change there fails here, loudly.
_ENGINE = """\
    k_scale = {k_scale!r}  # the layer's kv-cache scale (1.0: vLLM's default)
    # The impl, the layer vLLM registers it on (the builder reads both), then the builder, whose _SM90State
    # imports flashinfer.mla (FlashInfer's own on a GPU host that has it, else attnfuzz's stand-in of its wrapper).
    impl, layer, builder = sm90.engine(Backend, cfg, spec, case.heads, case.kv_cache_dtype, {topk}, k_scale, DEVICE)
"""


def sm90_repro(spec: ReproSpec, case) -> ReproSpec:
    k_scale = fp8_kv_scale(case) if case.kv_cache_dtype == "fp8" else 1.0
    edits = {
        "prepare": [(f"Backend, emulated = runtime.sparse_backend('{flashinfer_runtime.NAME}', DEVICE)\n",
                     "Backend, emulated = sm90.backend(DEVICE)\n")]
        + ([("runtime.cpu_shims()  # no streams on a CPU\n", "runtime.cpu_shims()  # no streams on a CPU\n"
             "sm90.cpu_shims()  # nor graph captures\n")] if "runtime.cpu_shims()" in spec.prepare else []),
        "setup": [("spec = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,\n"
                   "                        cache_dtype_str=case.kv_cache_dtype)\n",
                   "spec = sm90.kv_cache_spec(cfg, case.kv_cache_dtype, BLOCK_SIZE)\n")],
    }
    if case.earlier or case.cudagraph == "full":  # the trace's call (flashmla_trace_repro)
        topk = "topk_indices_buffer"
        edits["call"] = [
            ("""    # topk_indices_buffer= with indexer=None: the index group orders on the compute stream.
    impl = Backend.get_impl_cls()(
        case.heads, 576, runtime.SM_SCALE, 1, None, None, case.kv_cache_dtype, None, "decoder", None,
        **runtime.impl_topk_kwargs(Backend.get_impl_cls(), topk_indices_buffer),
        q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, qk_head_dim=192, v_head_dim=128, kv_b_proj=None)
    builder = Backend.get_builder_cls()(spec, [runtime.LAYER], cfg, torch.device(DEVICE))
""", _ENGINE.format(k_scale=k_scale, topk=topk))]
        edits["call"] += [(", cache, metadata, None)", ", cache, metadata, layer)")]
    else:
        topk = 'T["topk_indices_buffer"]'
        edits["call"] = [
            ("""    metadata = Backend.get_builder_cls()(spec, [runtime.LAYER], cfg, torch.device(DEVICE)).build(0, cam)
    # topk_indices_buffer= with indexer=None: the index group orders on the compute stream.
    impl = Backend.get_impl_cls()(
        case.heads, 576, runtime.SM_SCALE, 1, None, None, case.kv_cache_dtype, None, "decoder", None,
        **runtime.impl_topk_kwargs(Backend.get_impl_cls(), T["topk_indices_buffer"]),
        q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, qk_head_dim=192, v_head_dim=128, kv_b_proj=None)
""", _ENGINE.format(k_scale=k_scale, topk=topk) + "    metadata = builder.build(0, cam)\n"),
            (", cache, metadata, None)", ", cache, metadata, layer)")]
    changed = {}
    for field_name, pairs in edits.items():
        text = getattr(spec, field_name)
        for old, new in pairs:
            if old not in text:
                raise HarnessError(f"{FlashInferMLASparseSM90.name}'s reproducer: the FlashMLA reproducer's {field_name} "
                                   f"no longer holds {old.splitlines()[0]!r}")
            text = text.replace(old, new)
        changed[field_name] = text
    about = spec.about + (" FLASHINFER_MLA_SPARSE_SM90: FlashInfer's BatchMLAPagedAttentionWrapper is attnfuzz's "
                          "stand-in (flashinfer.mla, imported by the builder), FlashInfer 0.7.2.post1's planner and "
                          "kernel semantics, unless the GPU host has FlashInfer itself (the script prints which).")
    return dataclasses.replace(spec, about=about, support={**spec.support, "sm90": "fuzzer.support.flashinfer_runtime"},
                               **changed)
