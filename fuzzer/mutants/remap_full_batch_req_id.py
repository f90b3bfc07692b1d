"""Seed bug 1 at its call sites (class A; vLLM issue 48611, bug 1, from PR 47327): once short prefills leave
for dense MHA, forward_mqa gets only the decode tokens, but FlashMLA's paths (bf16, fp8 mixed batch, fp8
separate) and the index group convert them with the whole batch's req_id_per_token, and the converter has
neither of 0.33's row checks to refuse the call. The remap kernel's grid follows req_id_per_token: it reads
top-k rows past the decode tokens and writes past its output."""

from fuzzer.mutants._kernel_patch import converter_without_checks, patch_method

BUG_CLASS = "A"
TARGETS = ("vllm.flashmla_sparse.layer",)


def apply():
    from vllm.model_executor.layers.attention import sparse_mla_attention
    from vllm.v1.attention.backends.mla import flashmla_sparse, index_group, sparse_utils

    converter_without_checks()  # neither of 0.33's row checks
    for module in (index_group, sparse_mla_attention, flashmla_sparse):  # they bound the converter by name at import
        module.triton_convert_req_index_to_global_index = sparse_utils.triton_convert_req_index_to_global_index
    patch_method(index_group.__name__, "SparseMLAIndexGroup", "convert_logical_to_physical_topk",
                 [("attn_metadata.req_id_per_token[:logical_topk_indices.shape[0]]", "attn_metadata.req_id_per_token")],
                 "remap-full-batch-req-id")
    # vLLM's fix sliced req_id_per_token to the MQA tokens in each FlashMLA path: take the slices out again.
    for method in ("_forward_bf16_kv", "_forward_fp8_kv_mixed_batch", "_forward_fp8_kv_separate_prefill_decode"):
        patch_method("vllm.v1.attention.backends.mla.flashmla_sparse", "FlashMLASparseImpl", method,
                     [("attn_metadata.req_id_per_token[:topk_indices.shape[0]]", "attn_metadata.req_id_per_token")],
                     "remap-full-batch-req-id")
