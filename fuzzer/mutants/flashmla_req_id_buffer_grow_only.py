"""A persistent buffer refreshed only where the batch grew (class H; vLLM #40018 and #56237's family): the
sparse-MLA metadata builder keeps `req_id_per_token_buffer` for the life of the engine and, as if the rows it
wrote before were still right, writes only the rows past the largest batch it has built so far. A fresh
builder's first step is correct; any later step whose tokens belong to other requests than before (requests
finished, arrived, or changed query length) maps them to the previous step's requests, so the index remap
reads other requests' block-table rows."""

BUG_CLASS = "H"
TARGETS = ("vllm.flashmla_sparse", "vllm.flashmla_sparse.layer")


def apply():
    from vllm.model_executor.layers.attention import sparse_mla_attention

    builder = sparse_mla_attention.SparseMLACommonMetadataBuilder
    build_req_id_per_token = builder._build_req_id_per_token

    def _build_req_id_per_token(self, common_attn_metadata):
        buffer, filled = self.req_id_per_token_buffer, getattr(self, "_rows_built", 0)
        stale = buffer[: min(filled, common_attn_metadata.num_actual_tokens)].clone()
        req_id_per_token = build_req_id_per_token(self, common_attn_metadata)
        buffer[: len(stale)] = stale  # the rows an earlier step wrote are kept as they were
        self._rows_built = max(filled, common_attn_metadata.num_actual_tokens)
        return req_id_per_token

    builder._build_req_id_per_token = _build_req_id_per_token
