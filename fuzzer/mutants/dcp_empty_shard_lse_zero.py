"""Empty DCP shard not neutral (class G; vLLM #45426's family): a row for which this rank holds none of the
selected tokens gets LSE 0 instead of -inf, so vLLM's LSE merge weighs the rank's zero output as if it had
attended, and shrinks every other rank's contribution to that row."""

from fuzzer.mutants._kernel_patch import patch_method

BUG_CLASS = "G"
TARGETS = ("vllm.flashmla_sparse.dcp", "vllm.flashmla_sparse.layer.dcp")


def apply():
    patch_method("vllm.v1.attention.backends.mla.flashmla_sparse", "FlashMLASparseImpl", "_forward_fp8_kv_mixed_batch",
                 [("lse.masked_fill_(empty_rows.view(-1, 1), float('-inf'))",
                   "lse.masked_fill_(empty_rows.view(-1, 1), 0.0)")], "dcp-empty-shard-lse-zero")
