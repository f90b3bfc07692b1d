"""Padded uniform-MTP decode length (class D; vLLM #49139 and #55636's family, a full CUDA graph's zero-length
padding requests counted in uniform-decode metadata): on FlashMLA's fp8 separate prefill/decode path, a batch of
decodes only maps each decode token to its request arithmetically (token // decode query length, as the
uniform batch's (num_decodes, decode_query_len) layout allows) and takes the decode query length as the real
decode tokens over the decode count. Under a full CUDA graph the count includes the padding rows, so for
query_len > 1 the length comes out short (floor(q * R / (R + P)) for R requests and P padding rows) and later
tokens of real requests take other requests' or padding rows' block-table rows. With query_len 1 the length
is clamped to 1 and comes out right. Needs all of: kv_cache_dtype fp8_ds_mla; >= 32 heads per rank (the
separate path; fewer take the mixed-batch path); a batch of decodes only, ending in padding rows with their
padded tokens (padded_tokens > 0); and decode query_len > 1 (MTP)."""

from fuzzer.mutants._kernel_patch import patch_method

BUG_CLASS = "D"
TARGETS = ("vllm.flashmla_sparse",)

_CONVERT = ("topk_indices, topk_length = self._convert_logical_to_physical_topk(topk_indices, attn_metadata, "
            "block_stride_rows=block_stride_rows, return_valid_counts=True)")


def apply():
    patch_method("vllm.v1.attention.backends.mla.flashmla_sparse", "FlashMLASparseImpl",
                 "_forward_fp8_kv_separate_prefill_decode",
                 [(_CONVERT,
                   "decode_query_len = max(1, int(attn_metadata.query_start_loc[num_decodes]) // max(1, num_decodes))\n"
                   "        token_req = (torch.arange(topk_indices.shape[0], device=topk_indices.device) // decode_query_len)"
                   ".clamp(max=attn_metadata.block_table.shape[0] - 1).to(torch.int32)\n"
                   "        topk_indices, topk_length = triton_convert_req_index_to_global_index(token_req, "
                   "attn_metadata.block_table, topk_indices, BLOCK_SIZE=attn_metadata.block_size, "
                   "BLOCK_STRIDE_ROWS=block_stride_rows, NUM_TOPK_TOKENS=topk_indices.shape[1], return_valid_counts=True)")],
                 "flashmla-mtp-padded-decode")
