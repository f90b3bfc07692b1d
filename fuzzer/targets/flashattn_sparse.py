"""`vllm.flashattn_sparse`: vLLM's FlashAttention sparse-MLA backend (`FLASH_ATTN_MLA_SPARSE`), on the MQA route.

The same contracts as FLASHMLA_SPARSE, separate code: FlashAttnMLASparseMetadataBuilder (the shared sparse-MLA
builder with its own head-count-dependent reorder threshold, spec decodes as decodes, and
`update_draft_decode_metadata` for MTP draft steps) and FlashAttnMLASparseImpl.forward_mqa over every token:
vLLM's index-remap Triton kernel on `req_id_per_token`, then FA3's paged kernel with the top-k rows as its page
table (page size 1) and the latent as its QV input. bf16 caches only (the backend refuses fp8). Where the host
lacks vllm_flash_attn's compiled FA3 (any CPU, the GPU bundle), the kernel is attnfuzz's bounds-checked stand-in
(`fuzzer.support.standins.flash_attn_ops`, FA3's documented paged semantics), named in every result.
"""

from __future__ import annotations

from dataclasses import replace

from fuzzer.errors import HarnessError
from fuzzer.support.flashmla_runtime import has_compiled_flash_attn
from fuzzer.targets.base import WHOLE, RunPlan
from fuzzer.targets.flashmla_sparse import FlashMLASparse


class FlashAttnMLASparse(FlashMLASparse):
    name = "vllm.flashattn_sparse"
    summary = "FlashAttention sparse-MLA backend (FLASH_ATTN_MLA_SPARSE): builder + impl.forward_mqa, bf16"
    bug_classes = "B C D H I J K M"
    real_parts = ("FlashAttnMLASparseMetadataBuilder", "FlashAttnMLASparseImpl.forward_mqa",
                  "the index-remap Triton kernel")
    kv_cache_dtypes = ("bfloat16",)
    vllm_backend = "FLASH_ATTN_MLA_SPARSE"
    mtp_draft = True  # its builder's update_draft_decode_metadata runs MTP draft steps in place

    def real_parts_here(self) -> tuple[str, ...]:
        if self.device == "cuda" and "flash_attn_varlen_func" not in self.emulated:
            return (*type(self).real_parts, "FA3's CUDA kernel (vllm_flash_attn)")
        return type(self).real_parts

    def cases(self, profile, plan: RunPlan = WHOLE):
        if self.device == "cuda" and not has_compiled_flash_attn():
            # FA3's stand-in walks its page table on the host, which a CUDA graph cannot capture: on a GPU without
            # FA3's extension, eager engines only. (On a CPU every graph replay is emulated eagerly.)
            plan = replace(plan, cudagraph_modes=("none",))
        return super().cases(profile, plan)

    def run(self, case):
        if case.cudagraph != "none" and self.device == "cuda" and not has_compiled_flash_attn():
            raise HarnessError(f"case.cudagraph {case.cudagraph!r}: {self.name} cannot capture FA3's stand-in in a CUDA "
                               "graph on this host (no vllm_flash_attn extension); run it where FA3 is installed")
        return super().run(case)
