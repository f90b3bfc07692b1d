"""DCP ownership (class G): the owner rank of a token is computed round-robin per token, ignoring
cp_kv_cache_interleave_size, so with interleave > 1 a rank keeps tokens it does not hold and drops
tokens it does."""

from fuzzer.mutants._kernel_patch import patch_remap_kernel

BUG_CLASS = "G"
TARGETS = ("vllm.dcp_filter", "vllm.flashmla_sparse.dcp", "vllm.flashmla_sparse.layer.dcp")


def apply():
    patch_remap_kernel([("owning_rank = tok // DCP_INTERLEAVE % DCP_SIZE", "owning_rank = tok % DCP_SIZE")],
                       "dcp-owner-ignores-interleave")
