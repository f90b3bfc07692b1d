"""`vllm.flashattn_sparse_fa4`: vLLM's FlashAttention 4 sparse-MLA backend for SM100 (`FLASH_ATTN_MLA_SPARSE_FA4`,
`FlashAttnMLASparseFA4Backend` in vllm/v1/attention/backends/mla/flashattn_mla_sparse.py), whole, on the MQA route.

vLLM 0.33.0 builds it on FLASHINFER_MLA_SPARSE (SM100): its builder is the trtllm-gen one (reorder threshold 128 up
to 32 heads, 256 at 64, 1024 at 128; spec decodes as decodes; UNIFORM_BATCH graphs; the in-place
`update_draft_decode_metadata` for MTP draft steps), its impl FlashInferMLASparseImpl's with its own
`_forward_mqa_kernel`: SparseMLACommonImpl.forward_mqa converts the step's top-k rows (the index group's conversion,
valid entries compacted to the front, their counts) and makes ONE kernel call for the step, `is_decode` when every
token is a decode. A decode batch goes to FA4: vLLM's `flash_attn_varlen_func(fa_version=4)` over the cache as flat
rows (k the 64 RoPE columns, v the 512 latent ones, each a view of the cache), the latent query as `q_v`, one query
row a token (`cu_seqlens_q` 0..T), `cu_seqlens_k` zeros and `seqused_k` the number of flat rows for every token (FA4
masks an entry at or past it), the top-k rows as `gather_kv_indices`, the valid counts as `gather_kv_valid_length`,
causal False. Any other batch goes to trtllm-gen (FLASHINFER_MLA_SPARSE's call). bf16 only (the backend lists
auto/bfloat16: FA4's qv kernel takes no descales); heads 8, 16, 32, 64, 128 (128 runs FA4's MLA forward kernel, the
others its sparse decode kernel); index_topk a multiple of 128 (every profile's width is); blocks of 64 and 128
(MultipleOf(64)).

Both kernels are attnfuzz's stand-ins on every host (FA4's: `fuzzer.support.standins.flash_attn_fa4`, which follows
the FA4 vLLM vendors; trtllm-gen's as `vllm.flashinfer_sparse_sm100` has it), named in every result; vLLM's
`flash_attn_varlen_func` runs for real (`fuzzer.support.flashattn_fa4_runtime`). vLLM's platform check would not
choose the backend here; the engine is built as an SM100 host builds it, and every result's shims say so. Cases are
`vllm.flashinfer_sparse_sm100`'s with a bf16 cache: top-k rows as DeepSeek's indexer fills them (trtllm-gen's answer
for a row of no entry is not public; FA4's is: out 0, LSE -inf, so CUDA-graph padding tokens of a decode batch are
judged), traces with MTP draft steps, full graphs (emulated on a CPU; eager on a GPU: the stand-ins read lengths on
the host).
"""

from __future__ import annotations

import dataclasses

from fuzzer.env import STATE_DIR
from fuzzer.repro_spec import Call, ReproSpec
from fuzzer.support import flashattn_fa4_runtime
from fuzzer.targets.flashinfer_sparse_blackwell import FlashInferMLASparseSM100
from fuzzer.targets.flashmla_sparse import flashmla_repro
from fuzzer.targets.vllm_api import remap_api


class FlashAttnMLASparseFA4(FlashInferMLASparseSM100):
    name = "vllm.flashattn_sparse_fa4"
    summary = ("FlashAttention 4 sparse-MLA backend for SM100 (FLASH_ATTN_MLA_SPARSE_FA4): trtllm-gen builder + draft "
               "update + impl.forward_mqa, FA4 for decode batches, trtllm-gen otherwise, bf16 (both kernels stand-ins)")
    bug_classes = "A B C D H I J M"
    real_parts = ("FlashAttnMLASparseFA4MetadataBuilder (FLASHINFER_MLA_SPARSE's trtllm-gen builder, the sparse-MLA "
                  "builder) and its update_draft_decode_metadata",
                  "FlashAttnMLASparseFA4Impl.forward_mqa (SparseMLACommonImpl's) and _forward_mqa_kernel "
                  "(FlashInferMLASparseImpl's for non-decode batches)",
                  "vLLM's flash_attn_varlen_func (vllm_flash_attn, its FA4 branch)",
                  "SparseMLAIndexGroup", "the index-remap Triton kernel")
    kv_cache_dtypes = ("bfloat16",)
    vllm_backend = "FLASH_ATTN_MLA_SPARSE_FA4"
    mtp_draft = True  # the trtllm-gen builder's update_draft_decode_metadata
    BLOCK_SIZES = (64, 128)

    def unavailable(self) -> str | None:
        try:
            flashattn_fa4_runtime.backend(self.device)
        except Exception as e:
            return f"cannot import vLLM's {self.vllm_backend} backend: {type(e).__name__}: {e}"
        return None

    def prepare(self) -> None:
        self.backend, self.emulated, self.shims = flashattn_fa4_runtime.prepare_host(self.device)
        self.real_parts = type(self).real_parts
        self.cfg = self.runtime(str(STATE_DIR))
        self.block_stride_rows = remap_api().has_block_stride_rows

    def new_engine(self, ctx, step) -> None:
        impl, layer, builder = flashattn_fa4_runtime.engine(
            self.backend, ctx.cfg, ctx.spec, step.heads, step.kv_cache_dtype, ctx.topk_buffer, device=self.device,
            **self.engine_scales(step))
        ctx.engine.update(impl=impl, layer=layer, builder=builder)

    def repro_spec(self, finding) -> ReproSpec:
        spec = flashmla_repro(self, finding, layer=False)
        return dataclasses.replace(spec, about=spec.about + (
            f" {self.vllm_backend}: FA4's _flash_attn_fwd (decode batches) and FlashInfer's "
            "trtllm_batch_decode_with_kv_cache_mla (the others) are attnfuzz's stand-ins for an SM100 device "
            "(fuzzer.support.standins.flash_attn_fa4, flashinfer_trtllm_mla), vLLM's flash_attn_varlen_func its own, "
            "vLLM's platform check bypassed as that device's host would pass it."))

    def repro_prepare(self, layer: bool, case=None) -> tuple[Call, ...]:
        return (Call(flashattn_fa4_runtime.prepare_host, dict(device="DEVICE"), assign="backend, emulated, shims"),)

    def repro_engine(self, case, layer: bool) -> Call:
        scales = {name: repr(value) for name, value in self.engine_scales(case).items()}
        return Call(flashattn_fa4_runtime.engine, dict(backend_cls="backend", cfg="cfg", spec="spec", heads="HEADS",
                                                       kv_cache_dtype="KV_CACHE_DTYPE",
                                                       topk_indices_buffer="topk_indices_buffer", device="DEVICE",
                                                       **scales),
                    assign="impl, layer, builder", note="the impl, the layer vLLM hands forward_mqa, the builder")
