"""The prefill call's query offsets left absolute (class N): DeepSeek-V4.1's FlashInfer layer
(FLASHINFER_MLA_SPARSE_DSV41) hands FlashInfer's kernel the prefills' query view, which starts at their first token,
with `cum_seq_lens_q` rebased to 0 (`query_start_loc[num_decodes:] - query_start_loc[num_decodes]`; V4's layer skips
the rebase only for its RopeQuant output, whose rows span the whole batch). Here the rebase is dropped, so in a step
with decodes before its prefills each prefill request's tokens are read num_decode_tokens rows late: its first
tokens attend with another token's query, position and window, its last ones are never written. Found by the output
check (or NaN rows); needs a step with both decodes and a prefill. Beside the other V4.1 backends
(`vllm.dsv41.all`) it is the one out of line."""

from fuzzer.mutants._kernel_patch import patch_method

BUG_CLASS = "N"
TARGETS = ("vllm.dsv41.flashinfer", "vllm.dsv41.all")


def apply():
    patch_method("vllm.models.deepseek_v41.nvidia.flashinfer_sparse", "DeepseekV4FlashInferMLAAttention", "_forward",
                 [("prefill_cu = query_start_loc[num_decodes:num_reqs + 1] - query_start_loc[num_decodes]",
                   "prefill_cu = query_start_loc[num_decodes:num_reqs + 1]")],
                 "dsv41-flashinfer-prefill-cu-not-rebased")
