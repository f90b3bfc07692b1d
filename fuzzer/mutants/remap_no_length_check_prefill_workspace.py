"""The seed bug in the index remap's prefill-workspace call only
(class A; vLLM issue 48611, bug 1, kernel level): as
`remap-no-length-check`, the converter launches without the row check vLLM added in the fix, but only in a call in
prefill-workspace mode (HAS_PREFILL_WORKSPACE); every other call mode keeps the check and refuses the call. A call
with the full-batch req_id_per_token and only the MQA rows of topk_indices sizes the grid by req_id and writes past
the output sized like topk_indices. Needs all of: prefill-workspace mode (call.prefill_workspace); the decode rows
of topk_indices (call.token_rows decodes, so decodes in the step) with the whole batch's req_id_per_token
(call.req_id_rows full_batch, so prefills in the step)."""

from fuzzer.mutants._kernel_patch import converter_without_row_check_in

BUG_CLASS = "A"
TARGETS = ("vllm.index_remap",)


def apply():
    converter_without_row_check_in("prefill_workspace")
