"""`vllm.dsv41.flashmla_mega`: DeepSeek-V4.1's sparse attention on FlashMLA's mega-attention layer
(FLASHMLA_MEGA_ATTN_DSV41, `DeepseekV4MegaAttnAttention` of vllm/models/deepseek_v41/nvidia/flash_mla_mega_attn.py,
SM100), one step.

V4.1's FlashMLA target (dsv41_flashmla.py) run on the mega layer: the same builders (FlashMLAMegaAttnBackend shares
FLASHMLA_SPARSE_DSV41's metadata: DeepseekSparseSWAFlashMLAMetadataBuilder and DeepseekV4FlashMLAMetadataBuilder) and
the layer's own `forward_mqa`: decode through the global top-k conversion into one mega-kernel call over the paged
caches; prefill chunk by chunk through V4.1's Triton dequantizing gathers (the NVFP4 one for the compressed cache
under nvfp4_ds_mla) and top-k/window combine into the prefill mega kernel. Cases: `--kv-cache-dtype` nvfp4_ds_mla
(the 528-byte MXFP8 SWA record, the compressed cache in 288-byte NVFP4 records) or fp8_ds_mla (MXFP8 both), the
128-token kernel block, compress ratios 0, 1 and 2, 64 heads (TP1: 8 heads a wo_a group, no padding). q is drawn
unroped; the oracle ropes it, attends, inverse-ropes the output and compares it with the kernel's MXFP8 output read
back, within half an e4m3 step more than V4.1's tolerance. The mega kernels are stand-ins on every attnfuzz host
(`fuzzer.support.standins.flashmla_mega`; their semantics are not public: see its docstring), as are the caches'
writers (attnfuzz's torch writers, byte-equal to vLLM's Triton ones). vLLM's platform check would not choose the
backend here (`supports_compute_capability`: major 10; `is_flashmla_mega_attn_supported`): the layer is made as an
SM100 host makes it, and every result says so.
"""

from __future__ import annotations

from dataclasses import replace

from fuzzer.repro_spec import Call
from fuzzer.support import dsv41_mega_runtime as mega
from fuzzer.support.vllm_setup import try_import
from fuzzer.support.standins.flashmla_mega import NOT_PUBLIC
from fuzzer.targets.base import WHOLE, RunPlan
from fuzzer.targets.dsv41_flashmla import Dsv41FlashMLA
from strategies.dsv4_batches import MEGA_FEATURES, dsv4_space

WRITER = ("cache writes: attnfuzz's torch writers of the 528-byte MXFP8 and 288-byte NVFP4 records (byte-equal to "
          "vLLM's Triton _quantize_and_insert_k_mxfp8_kernel and _rope_quant_insert_nvfp4_kernel) in place of the "
          "layer's fused insert and the compressor")


class Dsv41FlashMLAMega(Dsv41FlashMLA):
    name = "vllm.dsv41.flashmla_mega"
    summary = ("DeepSeek-V4.1 sparse attention on FlashMLA's mega-attention layer (FLASHMLA_MEGA_ATTN_DSV41, SM100): "
               "builders + forward_mqa, nvfp4_ds_mla and fp8_ds_mla, compress ratios 0/1/2")
    real_parts = ("DeepseekSparseSWAFlashMLAMetadataBuilder (V4.1)", "DeepseekV4FlashMLAMetadataBuilder (V4.1)",
                  "DeepseekV4MegaAttnAttention.forward_mqa", "alloc_mega_attn_output", "permute_q_to_fused",
                  "Triton: SWA indices/lens, prefill gather lens, compressed slot mapping, global top-k, "
                  "dequantize-and-gather (MXFP8 and NVFP4), top-k/SWA combine")
    kv_cache_dtypes = ("nvfp4_ds_mla", "fp8_ds_mla")
    writer = WRITER
    PLANNED = ()
    forward_mqa = staticmethod(mega.forward_mqa)

    def unavailable(self) -> str | None:
        return super().unavailable() or self._missing(mega.MEGA_LAYER_MODULE)

    @staticmethod
    def _missing(module: str) -> str | None:
        try:
            return None if try_import(module) is not None else f"this vLLM has no {module}"
        except Exception as e:
            return f"cannot import {module}: {type(e).__name__}: {e}"

    def prepare(self) -> None:
        super().prepare()
        self.shims, standins = mega.prepare_host(self.device)
        self.shims += [
            "DeepseekV4MegaAttnAttention made without __init__ (it needs a TP group, linears, load-time weight "
            "permutes and DeepGEMM): the attributes forward_mqa reads set as __init__ sets them",
            "vLLM's FlashMLAMegaAttnBackend.supports_compute_capability asks for major == 10 and "
            "is_flashmla_mega_attn_supported for _flashmla_C's mega ops: this host has neither; the layer is made as "
            "an SM100 host makes it, the mega kernels stand-ins"]
        self.emulated = (*standins, self.writer)
        self.kv_records = (528,)

    def cases(self, profile, plan: RunPlan = WHOLE):
        return dsv4_space(profile, replace(MEGA_FEATURES, cache_dtypes=tuple(plan.kv_dtypes(self))))

    def call_notes(self) -> dict:
        return {"not_public": NOT_PUBLIC}

    def layer_sizes(self, case) -> dict:
        return {**super().layer_sizes(case), "compressed_record": case.dsv4.compressed_record}

    step_layer = staticmethod(mega.step_layer)

    def prepare_call(self, layer_module: dict):
        return Call(mega.prepare_host, dict(device="DEVICE"), assign="shims, emulated",
                    note="FlashMLA's mega kernels stood in for (no attnfuzz host has them)")
