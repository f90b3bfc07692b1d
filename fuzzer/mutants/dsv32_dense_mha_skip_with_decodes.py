"""The indexer's short-prefill skip taken with decodes in the batch (class F): DeepSeek-V3.2's indexer op leaves the
top-k buffer unscored when the MLA layer's metadata says its prefills take dense MHA, which is right only when the
MLA layer has no decode tokens (every token then leaves for dense MHA). Here the decode check is dropped: in a batch
of decodes and short prefills the indexer returns early and the decodes' forward_mqa reads rows nothing scored (the
-1 that fused_norm_rope cleared them to). The indexer and the MLA layer disagree on those tokens' route."""

from fuzzer.mutants._kernel_patch import patch_function

BUG_CLASS = "F"
TARGETS = ("vllm.dsv32.attention", "vllm.dsv32.attention.flashattn", "vllm.dsv32.attention.flashinfer_sm90")


def apply():
    patch_function("vllm.model_executor.layers.sparse_attn_indexer", "sparse_attn_indexer",
                   [("getattr(prefill_metadata, 'use_dense_mha', False) and getattr(mla_metadata, "
                     "'num_decode_tokens', -1) == 0 and", "getattr(prefill_metadata, 'use_dense_mha', False) and")],
                   "dsv32-dense-mha-skip-with-decodes")
