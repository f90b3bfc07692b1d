"""Seed bug, kernel level (class A; vLLM issue 48611, bug 1): the index converter launches its kernel
without the check vLLM added in the fix, so a call with the full-batch req_id_per_token and only the
MQA rows of topk_indices sizes the grid by req_id and writes past the output sized like topk_indices."""

from fuzzer.mutants._kernel_patch import converter_without_checks

BUG_CLASS = "A"
TARGETS = ("vllm.index_remap",)


def apply():
    # Defined in the module's own namespace, so vLLM's callers pick it up as they would the original.
    converter_without_checks(("req_id.shape[0]==token_indices.shape[0]",))
