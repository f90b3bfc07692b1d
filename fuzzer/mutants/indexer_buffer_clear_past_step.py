"""The top-k buffer cleared one row past the step (class A): the op fills the rows it is handed with -1 before the
kernels scatter into them; this clears one more, a row of the persistent buffer the step does not own."""

from fuzzer.mutants._kernel_patch import patch_function

BUG_CLASS = "A"
TARGETS = ("vllm.indexer",)


def apply():
    patch_function("vllm.model_executor.layers.sparse_attn_indexer", "sparse_attn_indexer",
                   [("topk_indices_buffer[:hidden_states.shape[0]] = -1",
                     "topk_indices_buffer[:hidden_states.shape[0] + 1] = -1")],
                   "indexer-buffer-clear-past-step")
