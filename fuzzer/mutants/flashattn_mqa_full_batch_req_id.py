"""Seed bug 1 at FLASH_ATTN_MLA_SPARSE's own call site (class A; vLLM issue 48611, bug 1): the fix made
FlashMLA slice req_id_per_token to the MQA tokens "exactly as the FlashInfer and FlashAttn sparse backends already
do". Here FlashAttn's conversion (`SparseMLACommonImpl.forward_mqa`) hands the converter the whole batch's
req_id_per_token again, and the converter has neither of 0.33's row checks to refuse it. Once a request leaves
for dense MHA (past the backend's reorder threshold, within top-k), forward_mqa gets only the decode tokens; the
remap kernel's grid follows req_id_per_token, so it reads top-k rows past them and writes past its output."""

from fuzzer.mutants._kernel_patch import converter_without_checks, patch_method

BUG_CLASS = "A"
TARGETS = ("vllm.flashattn_sparse.layer",)


def apply():
    from vllm.model_executor.layers.attention import sparse_mla_attention
    from vllm.v1.attention.backends.mla import sparse_utils

    converter_without_checks()  # neither of 0.33's row checks
    sparse_mla_attention.triton_convert_req_index_to_global_index = sparse_utils.triton_convert_req_index_to_global_index
    patch_method(sparse_mla_attention.__name__, "SparseMLACommonImpl", "forward_mqa",
                 [("triton_convert_req_index_to_global_index(attn_metadata.req_id_per_token[:num_tokens]",
                   "triton_convert_req_index_to_global_index(attn_metadata.req_id_per_token")],
                 "flashattn-mqa-full-batch-req-id")
