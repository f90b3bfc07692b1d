"""MTP draft metadata updated in place with an off-by-one (class M: `update_draft_decode_metadata`): for an MTP
draft step, vLLM's speculator advances the runner's inputs in place and asks the builder to refresh what it
owns; FlashAttention sparse-MLA's builder recomputes `req_id_per_token` from `query_start_loc`. Here it maps
one token fewer than the step holds (tokens past the count are mapped to request 0), so the last draft token
reads request 0's block-table row. The step built eagerly is right; only a draft step on updated metadata is
wrong, and only with two or more requests."""

BUG_CLASS = "M"
TARGETS = ("vllm.flashattn_sparse",)


def apply():
    from vllm.v1.attention.backends.mla import flashattn_mla_sparse
    from vllm.v1.attention.ops.metadata import compute_token_to_req_indices

    def update_draft_decode_metadata(self, metadata):
        num_tokens = metadata.num_decode_tokens
        if num_tokens == 0:
            return
        compute_token_to_req_indices(metadata.query_start_loc, metadata.req_id_per_token, num_tokens - 1, num_tokens)

    flashattn_mla_sparse.FlashAttnMLASparseMetadataBuilder.update_draft_decode_metadata = update_draft_decode_metadata
