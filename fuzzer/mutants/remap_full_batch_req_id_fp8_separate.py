"""Seed bug 1 at one call site (class A; vLLM issue 48611, bug 1, from PR 47327), fixed only for the step the
report showed: once short prefills have left for dense MHA, FlashMLA's fp8 separate prefill/decode path
converts the decode tokens forward_mqa gets through the index group; the slice of req_id_per_token to those
tokens is kept where the step's prefills have cached context (chunked context / a prefix-cache hit, the
builder's `prefill.chunked_context`), but a step whose short prefills are all fresh (no chunked context) passes
the whole batch's req_id_per_token, to a group converter that has neither of 0.33's row checks to refuse the
call. The remap kernel's grid follows req_id_per_token: it reads top-k rows past the decode tokens and writes
past its rows of the group's physical top-k buffer. Every other call site (bf16, fp8 mixed batch, the index
group's own slice) is left as 0.33 has it. Needs all of: kv_cache_dtype fp8_ds_mla; >= 32 heads per rank (the
separate path); decode tokens (as vLLM splits the batch) and prefills in one step; every prefill short
(seq_len <= topk_width), so that the layer splits them off to dense MHA; and no prefill with cached context
(context_len 0 for every prefill)."""

from fuzzer.mutants._kernel_patch import converter_without_checks, patch_method

BUG_CLASS = "A"
TARGETS = ("vllm.flashmla_sparse.layer",)


def apply():
    from vllm.v1.attention.backends.mla import flashmla_sparse, index_group, sparse_utils

    # only the index group gets the converter without 0.33's row checks
    index_group.triton_convert_req_index_to_global_index = converter_without_checks(scope=dict(vars(sparse_utils)))
    sliced = ("topk_indices, topk_length = self._convert_logical_to_physical_topk(topk_indices, attn_metadata, "
              "block_stride_rows=block_stride_rows, return_valid_counts=True)")
    full_batch = ("topk_indices, topk_length = self.index_group._convert_once(self.index_group_index, topk_indices, "
                  "attn_metadata.req_id_per_token, attn_metadata.block_table, attn_metadata.block_size, "
                  "block_stride_rows=block_stride_rows, return_valid_counts=True)")
    patch_method(flashmla_sparse.__name__, "FlashMLASparseImpl", "_forward_fp8_kv_separate_prefill_decode",
                 [(sliced, "if attn_metadata.prefill is not None and attn_metadata.prefill.chunked_context is None:\n"
                           f"            {full_batch}\n"
                           "        else:\n"
                           f"            {sliced}")],
                 "remap-full-batch-req-id-fp8-separate")
