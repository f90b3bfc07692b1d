"""Previous request's workspace start (class C; the prefill-workspace offsets by which vLLM's fp8 separate
prefill/decode path maps prefill rows into the gathered, upconverted context): in the remap's
prefill-workspace specialization with counting and compaction (the only one vLLM calls: FlashMLA's fp8
separate path converts its prefill rows with return_valid_counts=True), a prefill row of prefill request
i >= 1 takes workspace_starts[i - 1], the previous prefill's start, so it attends to the previous request's
context. Needs all of: prefill-workspace mode (call.prefill_workspace); valid counts (call.valid_counts); at
least two prefill requests; and a valid entry in a row of a prefill after the first (entries past the block
table stay -1)."""

from fuzzer.mutants._kernel_patch import patch_remap_kernel

BUG_CLASS = "C"
TARGETS = ("vllm.index_remap",)


def apply():
    patch_remap_kernel([("        workspace_start = tl.load(workspace_starts_ptr + prefill_req_id, mask=is_prefill, other=0)",
                         "        workspace_row = prefill_req_id\n"
                         "        if COMPACT_TO_FRONT:\n"
                         "            workspace_row = tl.maximum(prefill_req_id - 1, 0)\n"
                         "        workspace_start = tl.load(workspace_starts_ptr + workspace_row, mask=is_prefill, other=0)")],
                       "remap-workspace-second-prefill")
