"""ShardQ's tokens read their requests from the wrong rows (class G; the shape of vLLM issue 48611's first bug, at
ShardQ's seam): `build_shardq_metadata` narrows req_id_per_token to the rank's split tokens with their ids relative
to the first token after the decodes, and must add `num_decode_tokens` to reach their rows. Here it does not, so on
a step with decodes before the split each split token attends with the request of the token `num_decode_tokens`
rows earlier: another request's block table (a decode's, or an earlier prompt's), its output wrong. A step of
prefills only is unaffected. Found by the output check; needs decodes and a ShardQ split in one step."""

from fuzzer.mutants._kernel_patch import patch_function

BUG_CLASS = "G"
TARGETS = ("vllm.dsv32.attention.shardq",)


def apply():
    patch_function("vllm.model_executor.layers.attention.sparse_mla_attention", "build_shardq_metadata",
                   [("metadata.req_id_per_token[shardq.local_token_ids + num_decode_tokens]",
                     "metadata.req_id_per_token[shardq.local_token_ids]")],
                   "shardq-req-id-decode-offset-dropped")
