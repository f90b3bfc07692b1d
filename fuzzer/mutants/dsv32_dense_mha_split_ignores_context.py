"""The dense-MHA split judged by the prefill's new tokens, not its sequence (class F): sparse MLA's builder sends
prefills to dense MHA when their whole sequence fits the top-k (`prefill_max_seq_len <= topk_tokens`: dense causal
attention then equals the sparse result); here it compares the longest prefill's query length instead, so an extend
or a chunked prefill with a long context (seq_len > top-k) takes dense MHA over every cached position, while its
indexer selects only top-k of them (or, with no decode in the batch, skips scoring them at all)."""

from fuzzer.mutants._kernel_patch import patch_method

BUG_CLASS = "F"
TARGETS = ("vllm.dsv32.attention", "vllm.dsv32.attention.flashattn", "vllm.dsv32.attention.flashinfer_sm90")


def apply():
    patch_method("vllm.model_executor.layers.attention.sparse_mla_attention", "SparseMLACommonMetadataBuilder", "build",
                 [("_use_dense_mha_prefill(self.vllm_config, prefill_max_seq_len, self.topk_tokens)",
                   "_use_dense_mha_prefill(self.vllm_config, prefill_max_query_len, self.topk_tokens)")],
                 "dsv32-dense-mha-split-ignores-context")
