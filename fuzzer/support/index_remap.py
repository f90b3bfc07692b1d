"""vLLM's sparse-MLA index remap, called as its call sites call it (`vllm.index_remap` runs it; its
reproducers show it)."""

from __future__ import annotations

import importlib

from fuzzer.support.vllm_calls import returned

SPARSE_UTILS = "vllm.v1.attention.backends.mla.sparse_utils"


def remap_topk_indices(entry_point, req_id_per_token, block_table, topk_indices, **kwargs):
    """`sparse_utils.<entry_point>` (looked up at call time, so that a patch to the module takes effect as
    inside vLLM) on request-local top-k positions; returns (global slots, valid counts or None)."""
    remap = getattr(importlib.import_module(SPARSE_UTILS), entry_point)
    res = remap(req_id_per_token, block_table, topk_indices, **kwargs)
    if kwargs.get("return_valid_counts"):
        return returned(res, 2, f"{entry_point}(return_valid_counts=True)")
    return returned(res, 1, entry_point), None
