"""MTP draft metadata updated in place one token short (class M) at FLASHINFER_MLA_SPARSE's own builder
(`FlashInferMLASparseTRTLLMMetadataBuilder.update_draft_decode_metadata`): for an MTP draft step vLLM's speculator
advances the runner's inputs in place and asks the builder to refresh what it owns, the per-token request map, which
it recomputes from `query_start_loc`. Here it maps one token fewer than the step holds (tokens at or past the count
map to request 0), so the last draft token converts its top-k through request 0's block-table row. The step built
eagerly is right; only a draft step on updated metadata is wrong, and only with two or more requests."""

from fuzzer.mutants._kernel_patch import patch_method

BUG_CLASS = "M"
TARGETS = ("vllm.flashinfer_sparse_sm100",)


def apply():
    patch_method("vllm.v1.attention.backends.mla.flashinfer_mla_sparse", "FlashInferMLASparseTRTLLMMetadataBuilder",
                 "update_draft_decode_metadata",
                 [("metadata.req_id_per_token, num_tokens, num_tokens)",
                   "metadata.req_id_per_token, num_tokens - 1, num_tokens)")],
                 "sm100-draft-update-last-token")
