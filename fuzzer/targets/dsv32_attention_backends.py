"""`vllm.dsv32.attention.flashattn` and `vllm.dsv32.attention.flashinfer_sm90`: `vllm.dsv32.attention` (DeepSeek-V3.2's
`DeepseekV32Attention._sparse_indexer_and_attn`, vLLM's real indexer feeding the layer's sparse MLA, the dense-MHA
split, skip_topk layers, traces) on vLLM's other two Hopper sparse backends, FLASH_ATTN_MLA_SPARSE and
FLASHINFER_MLA_SPARSE_SM90. The module, its indexer and the judging are `Dsv32Attention`'s; the backend (its name,
builder, kv-cache spec, cache writer, stand-ins and real parts) is its layer target's (`FlashAttnMLASparseLayer`,
`FlashInferMLASparseSM90Layer`).

On FlashInfer SM90 the builder asks the layer itself (`MLAAttention._use_sparse_mha`) whether prefills leave for dense
MHA and then plans FlashInfer for the decode prefix alone (vLLM PR 56969's fix): here that layer is the module's,
its prefills sent to dense MHA by the indexer's short-prefill skip as well. FA3's paged kernel and FlashInfer's
`BatchMLAPagedAttentionWrapper` are attnfuzz's stand-ins where the host lacks them, named in every result. bf16
caches (the module target's).
"""

from __future__ import annotations

import contextlib
import dataclasses

from fuzzer.support import flashinfer_runtime
from fuzzer.support.standins import flashinfer_mla
from fuzzer.targets.base import WHOLE, RunPlan
from fuzzer.targets.dsv32_attention import Dsv32Attention
from fuzzer.targets.flashattn_layer import FlashAttnMLASparseLayer
from fuzzer.targets.flashinfer_sparse_sm90_layer import FlashInferMLASparseSM90Layer


def _on(backend_parts: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """Dsv32Attention's real parts with FLASHMLA_SPARSE's replaced by the backend's."""
    return tuple(q for p in Dsv32Attention.real_parts for q in backend_parts.get(p, (p,)))


def past_decode_thresholds(profile):
    """The profile with indexer steps long enough for these builders' decode thresholds (a query of up to 128 tokens
    at 8 to 32 heads counts as a decode, 256 at FA's 8): a prefill leaves for dense MHA only past that and within
    top-k. A CPU profile's indexer steps (48 tokens) pass neither: up to 300 tokens there."""
    x = profile.indexer
    return profile if x.max_tokens >= 300 else dataclasses.replace(profile, indexer=dataclasses.replace(x, max_tokens=300))


class _OnAnotherBackend(Dsv32Attention):
    def cases(self, profile, plan: RunPlan = WHOLE):
        return super().cases(past_decode_thresholds(profile), plan)

    def captures_graphs(self) -> bool:
        # the backend's stand-in reads its plan or page table on the host, which a CUDA graph cannot capture: on a
        # GPU without the real kernel a FULL step runs eagerly, as on a CPU
        return super().captures_graphs() and self.kernel_is_real()  # each backend's class says (kernel_is_real)


class Dsv32AttentionFlashAttn(_OnAnotherBackend, FlashAttnMLASparseLayer):
    name = "vllm.dsv32.attention.flashattn"
    runs_backend_of = ("vllm.flashattn_sparse.layer",)
    summary = ("DeepSeek-V3.2/GLM-5 attention module (DeepseekV32Attention._sparse_indexer_and_attn): the real "
               "indexer feeding FLASH_ATTN_MLA_SPARSE (FA3 a stand-in unless installed), dense-MHA split, traces")
    real_parts = _on({"FlashMLASparseMetadataBuilder": ("FlashAttnMLASparseMetadataBuilder",),
                      "FlashMLASparseImpl.forward_mqa / forward_mha": ("FlashAttnMLASparseImpl.forward_mqa / forward_mha",)})

    def kernel_is_real(self) -> bool:
        return "flash_attn_varlen_func" not in self.emulated


class Dsv32AttentionFlashInferSM90(_OnAnotherBackend, FlashInferMLASparseSM90Layer):
    name = "vllm.dsv32.attention.flashinfer_sm90"
    runs_backend_of = ("vllm.flashinfer_sparse_sm90.layer",)  # its open padded_rows / fp8 output bugs meet here too
    summary = ("DeepSeek-V3.2/GLM-5 attention module (DeepseekV32Attention._sparse_indexer_and_attn): the real "
               "indexer feeding FLASHINFER_MLA_SPARSE_SM90 (decode-prefix plan, FlashInfer a stand-in unless "
               "installed), dense-MHA split, traces")
    real_parts = _on({"FlashMLASparseMetadataBuilder": (
                          "FlashInferMLASparseSM90Builder (FlashInferMLASparseMetadataBuilder, the sparse-MLA builder)",
                          "_SM90State.plan (host lengths, plan reuse) and its Triton `_clamp_work_kv_end`"),
                      "FlashMLASparseImpl.forward_mqa / forward_mha": (
                          "FlashInferMLASparseSM90Impl.forward_mqa / forward_mha", "the Triton `_pack_topk_indices`")})

    def kernel_is_real(self) -> bool:
        return flashinfer_runtime.real_flashinfer(self.device) is not None

    def mla_metadata_builder(self, case, cfg):
        # _SM90State imports flashinfer.mla here: FlashInfer's own where the host has it, else the stand-in
        with contextlib.nullcontext() if flashinfer_runtime.real_flashinfer(self.device) else flashinfer_mla.importable():
            return super().mla_metadata_builder(case, cfg)
