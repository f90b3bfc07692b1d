"""Prefill head weights read from the batch's first rows (class A, a row-offset contract): each prefill chunk scores
its rows [row_start, row_end) with those rows' head weights; this hands DeepGEMM weights[:rows], the decode tokens'
(and the first chunk's) weights, for every chunk."""

from fuzzer.mutants._kernel_patch import patch_function

BUG_CLASS = "A"
TARGETS = ("vllm.indexer",)


def apply():
    patch_function("vllm.model_executor.layers.sparse_attn_indexer", "sparse_attn_indexer",
                   [("weights[row_start:row_end])", "weights[:row_end - row_start])")],
                   "indexer-prefill-weights-from-row-zero")
