"""`vllm.dsv4.rocm`: DeepSeek-V4's sparse attention on vLLM's ROCM_FLASHMLA_SPARSE_DSV4 route (AMD), one step.

The DeepSeek-V4 target (dsv4_flashmla.py) run on the ROCm layer, `DeepseekV4ROCMAiterMLAAttention` of
vllm/models/deepseek_v4/amd/rocm.py (backend DeepseekV4ROCMAiterMLASparseBackend): vLLM's own SWA builder as a ROCm
host picks it (DeepseekV4ROCMAiterSparseSWAMetadataBuilder: the shared SWA metadata, then the decode tokens' ragged
SWA indices and indptr, `build_ragged_indices_from_dense`, copied into its persistent buffers) and compressed builder
(DeepseekV4ROCMAiterMLASparseMetadataBuilder: the compressed slot mapping, C128A top-k metadata and its ragged
form), then the layer's forward_mqa: the prefill route (V4's chunk plan, dequantize-and-gather into the bf16
workspace, the ROCm module's own top-k/window combine, vLLM's Triton `rocm_sparse_attn_prefill`), the decode route
(C4A's global top-k packed ragged by `compute_global_topk_ragged_indices_and_indptr`, C128A's builder rows;
`rocm_sparse_attn_decode`: gfx950's split-K partial kernel over both fp8_ds_mla caches read in place and its reduce,
which takes the sink and folds the inverse RoPE in; on the un-tuned gfx1201 and gfx1250 the fallback ragged kernel), and the inverse RoPE the rows the reduce did not rotate still
owe (`rocm_inverse_rope_rows_`). Compress ratios 1, 4 and 128; MTP decodes; the 584-byte record in both caches,
which every --kv-cache-dtype the backend takes (auto, fp8, fp8_ds_mla) resolves to.

Everything on the route is vLLM's Python and Triton (interpreted and bounds-checked on a CPU); with vLLM's defaults
(VLLM_ROCM_USE_AITER, VLLM_ROCM_USE_AITER_TRITON_SPARSE_MLA off) no AITER kernel is on it. Emulated, named in every
result: the caches' writer (attnfuzz's torch writer of V4's record, OCP e4m3 as the gfx950 fused insert writes it),
and the platform: vLLM's platform check would not choose the backend here, so the layer is built as a gfx950 host
builds it and the modules that read the arch by value answer the case's arch's for the step (`Dsv4.rocm_arch`:
gfx950, gfx1201 or gfx1250; rocm_dsv4_runtime, the result's shims). Judged by the V4 oracle with the output's RoPE taken back out (`Dsv4.rocm_arch`). A finding's
repro.py is the V4 target's, making the ROCm layer and calling the builders and forward_mqa on the emulated arch.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from fuzzer.env import STATE_DIR
from fuzzer.repro_spec import Call, ReproSpec, unchecked_unless_memory
from fuzzer.support import dsv4_runtime, dsv41_runtime
from fuzzer.support import rocm_dsv4_runtime as rocm
from fuzzer.support.interp.corrections import EVERY
from fuzzer.targets.base import WHOLE, RunPlan
from fuzzer.targets.dsv4_flashmla import Dsv4FlashMLA
from fuzzer.targets.dsv41_flashmla import Dsv41FlashMLA
from strategies.dsv4_batches import ROCM_FEATURES, ROCM_V41_FEATURES, dsv4_space

WRITER = ("cache writes: attnfuzz's torch writer of the 584-byte record, OCP e4m3 (byte-equal to vLLM's Triton "
          "quantize_and_insert_k_cache with use_fnuz=False, what gfx950's fused insert writes) in place of the layer's "
          "fused insert and the compressor")


class Dsv4Rocm(Dsv4FlashMLA):
    name = "vllm.dsv4.rocm"
    summary = ("DeepSeek-V4 sparse attention (ROCM_FLASHMLA_SPARSE_DSV4, emulated gfx950/gfx1201/gfx1250): SWA + "
               "compressed-KV builders and the layer's forward_mqa with its inverse RoPE, compress ratios 1/4/128")
    bug_classes = "C H J K N"
    real_parts = ("DeepseekV4ROCMAiterSparseSWAMetadataBuilder", "DeepseekV4ROCMAiterMLASparseMetadataBuilder",
                  "DeepseekV4ROCMAiterMLAAttention.forward_mqa",
                  "Triton: SWA indices/lens, prefill gather lens, compressed slot mapping, C128A top-k metadata, "
                  "ragged indices, global top-k (ragged), dequantize-and-gather, top-k/SWA combine (ROCm's), "
                  "rocm_sparse_attn_prefill, rocm_sparse_attn_decode (gfx950 partial + reduce with inverse RoPE; "
                  "un-tuned archs: the fallback ragged kernel), rocm_inverse_rope_rows_")
    version = "4"
    features = ROCM_FEATURES
    writer = WRITER
    cpu_second_opinion = False  # vLLM's CPU layer hands its output on before the inverse RoPE

    def unavailable(self) -> str | None:
        if self.device != "cpu":  # an NVIDIA GPU would run AMD-tuned Triton launches (waves_per_eu) nobody checked there
            return "CPU only: vLLM's ROCm kernels are tuned for (and launched with options of) AMD GPUs"
        try:
            rocm.layer_class(self.version)
        except Exception as e:
            return f"cannot import {rocm.LAYER_MODULES[self.version]}: {type(e).__name__}: {e}"
        return super().unavailable()

    def prepare(self) -> None:
        # every interpreter correction, whatever the kernels reach (a reproducer installs those its route needs)
        self.shims, standins = rocm.prepare_host(self.device, self.version, EVERY)
        self.shims.append(f"{rocm.LAYER_CLASSES[self.version]} ({self.model}) made without __init__ (it needs a TP "
                          "group, linears, CUDA events and AITER's GEMMs): the attributes forward_mqa reads set as "
                          "__init__ sets them (BF16 wo_a: forward_mqa owes the inverse RoPE)")
        self.emulated = (*standins, self.writer)
        self.real_parts = type(self).real_parts
        self.cfg = self.config(self.device, str(STATE_DIR))

    def cases(self, profile, plan: RunPlan = WHOLE):
        return dsv4_space(profile, self.features)

    def step(self, case, dev: str) -> SimpleNamespace:
        """The V4 target's step, q and the sink cut to the layer's heads (the ROCm layer pads none:
        get_padded_num_q_heads(h) = h)."""
        s = super().step(case, dev)
        s.inputs = dataclasses.replace(s.inputs, q=s.inputs.q[:, : case.heads].contiguous(),
                                       attn_sink=s.inputs.attn_sink[: case.heads].contiguous())
        return s

    def run(self, case):
        """The V4 target's run (both builders, then forward_mqa) on the case's emulated arch."""
        with rocm.emulated_arch(case.dsv4.rocm_arch):
            return super().run(case)

    step_layer = staticmethod(rocm.step_layer)

    def layer_sizes(self, case) -> dict:
        return {**super().layer_sizes(case), "num_heads": case.heads}

    def prepare_call(self, layer_module: dict) -> Call:
        return Call(rocm.prepare_host, dict(device="DEVICE", version=repr(self.version)), assign="shims, emulated",
                    note="vLLM's ROCm modules as a gfx950 host imports them; nothing stood in for")

    def repro_spec(self, finding) -> ReproSpec:
        """The V4 target's reproducer, its builders and forward_mqa called on the case's emulated arch; a finding that
        is not a memory one runs the interpreted kernels without the bounds checker."""
        spec = super().repro_spec(finding)
        arch = repr(finding.case.dsv4.rocm_arch)
        swap = {dsv4_runtime.build_metadata: rocm.build_metadata, dsv4_runtime.forward_mqa: rocm.forward_mqa}
        calls = tuple(dataclasses.replace(c, fn=swap[c.fn], args={**c.args, "arch": arch}) if c.fn in swap else c
                      for c in spec.call)
        return unchecked_unless_memory(dataclasses.replace(spec, call=calls, about=spec.about + (
            f"\n{rocm.LAYER_CLASSES[self.version]}'s route on an emulated {finding.case.dsv4.rocm_arch}: vLLM's platform "
            "check bypassed as that device's host would pass it (the shims printed say how).")), finding)


class Dsv41Rocm(Dsv4Rocm):
    """`vllm.dsv41.rocm`: the same on DeepSeek-V4.1's ROCM_FLASHMLA_SPARSE_DSV41: V4.1's
    DeepseekV41ROCMAiterMLAAttention of vllm/models/deepseek_v41/amd/rocm.py, its SWA builder
    (DeepseekV41ROCMAiterSparseSWAMetadataBuilder) and compressed builder (DeepseekV41ROCMAiterMLASparseMetadata
    Builder), the decode's ragged top-k memoized on the index source (`_decode_topk_ragged`), V4.1's own gather and
    combine; compress ratios 0 (sliding window only), 1 and 2 (both through the indexer's top-k), the compressed K
    cache in the backend's kernel blocks of 64 or 128 tokens on a kv-source layer, read by the layer itself or by a
    consumer (`kv_source`); SWA blocks of 32; V4's 584-byte record (V4.1 writes its MXFP8 record on SM100 only)."""

    name = "vllm.dsv41.rocm"
    summary = ("DeepSeek-V4.1 sparse attention (ROCM_FLASHMLA_SPARSE_DSV41, emulated gfx950/gfx1201): SWA + "
               "compressed-KV builders and the layer's forward_mqa with its inverse RoPE, compress ratios 0/1/2, own "
               "or shared compressed cache")
    real_parts = ("DeepseekV41ROCMAiterSparseSWAMetadataBuilder", "DeepseekV41ROCMAiterMLASparseMetadataBuilder",
                  "DeepseekV41ROCMAiterMLAAttention.forward_mqa",
                  "Triton: SWA indices/lens, compressed slot mapping, ragged indices, global top-k (ragged), "
                  "dequantize-and-gather (V4.1), top-k/SWA combine, rocm_sparse_attn_prefill, rocm_sparse_attn_decode "
                  "(gfx950 partial + reduce with inverse RoPE; gfx1201: the fallback ragged kernel), "
                  "rocm_inverse_rope_rows_")
    version = "4.1"
    features = ROCM_V41_FEATURES
    writer = WRITER
    runtime = dsv41_runtime
    model = "DeepSeek-V4.1"
    config = staticmethod(dsv41_runtime.dsv41_config)
    step_config = staticmethod(dsv41_runtime.step_config)
    step_layer = staticmethod(rocm.step_layer_v41)
    metadata_outputs = staticmethod(dsv41_runtime.metadata_outputs_v41)
    guard_compressed_builder = False
    layer_sizes = Dsv41FlashMLA.layer_sizes  # V4.1's layer, its heads included
