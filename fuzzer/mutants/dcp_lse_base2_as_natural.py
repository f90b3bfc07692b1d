"""LSE base mismatch in the DCP merge (class G; vLLM #46076's family): the backend hands the merge a base-2 LSE
(as FlashInfer's trtllm-gen kernels return it) while the merge is told it is a natural log
(`is_lse_base_on_e=True`), so every rank's weight is exp(lse * log2(e)) instead of exp(lse)."""

from fuzzer.mutants._kernel_patch import patch_method

BUG_CLASS = "G"
TARGETS = ("vllm.flashmla_sparse.dcp", "vllm.flashmla_sparse.layer.dcp")


def apply():
    patch_method("vllm.v1.attention.backends.mla.flashmla_sparse", "FlashMLASparseImpl", "_forward_fp8_kv_mixed_batch",
                 [("lse = _lse.squeeze(0).transpose(0, 1)",
                   "lse = _lse.squeeze(0).transpose(0, 1) * 1.4426950408889634")], "dcp-lse-base2-as-natural")
