"""Import stand-in of the FlashInfer names Step5's DSA backend imports (`vllm/models/step5/nvidia/flashinfer_sparse.py`,
`ops/sparse_prefill_pages.py`), for hosts without FlashInfer. torch only.

`Step5FlashInferSparse.__init__` imports `flashinfer.BatchPrefillWithRaggedKVCacheWrapper` and
`flashinfer.attn_scores.fp8_paged_mqa_logits` and constructs the ragged wrapper over its 128 MiB workspace; the
decode route (`select_and_run_decode_attention`, the Triton `_direct_scores` and `sparse_decode_attention`) calls
none of FlashInfer. The prefill route plans and runs FlashInfer's ragged and paged prefill wrappers and, for contexts
past topk on SM100, `fp8_paged_mqa_logits` with `compute_paged_mqa_logits_schedule`: this stand-in models none of
those calls and refuses each (NotImplementedError naming it), so a case that reaches them is a harness error, never a
silent result. What it checks is the constructor's contract as FlashInfer 0.7.2.post1 documents it
(`flashinfer/prefill.py`, `BatchPrefillWithRaggedKVCacheWrapper.__init__(float_workspace_buffer, kv_layout="NHD",
use_cuda_graph=False, ..., backend="auto")`: a uint8 workspace, kv_layout "NHD" or "HND", backend one of "auto",
"fa2", "fa3", "trtllm-gen", "cudnn"), read from FlashInfer's docstrings, not run against it.
"""

from __future__ import annotations

import contextlib
import types

import torch

from fuzzer.support.standins.importable import importable_as

SOURCE = ("FlashInfer 0.7.2.post1's documented constructor of BatchPrefillWithRaggedKVCacheWrapper / "
          "BatchPrefillWithPagedKVCacheWrapper (flashinfer/prefill.py); plan/run and flashinfer.attn_scores "
          "refused (not modelled)")
KV_LAYOUTS = ("NHD", "HND")
BACKENDS = ("auto", "fa2", "fa3", "trtllm-gen", "cudnn")


class _PrefillWrapper:
    """A FlashInfer prefill wrapper's constructor; plan and run refused."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 *args, backend: str = "auto", **kwargs) -> None:
        if not isinstance(float_workspace_buffer, torch.Tensor) or float_workspace_buffer.dtype != torch.uint8:
            raise ValueError(f"{type(self).__name__}: float_workspace_buffer must be a uint8 tensor")
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"{type(self).__name__}: kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
        if backend not in BACKENDS:
            raise ValueError(f"{type(self).__name__}: backend must be one of {BACKENDS}, got {backend!r}")
        if use_cuda_graph:
            raise NotImplementedError(f"attnfuzz's {type(self).__name__} stand-in: use_cuda_graph is not modelled")
        self.workspace, self.kv_layout, self.backend = float_workspace_buffer, kv_layout, backend

    def plan(self, *args, **kwargs):
        raise NotImplementedError(f"attnfuzz's {type(self).__name__} stand-in does not model plan() (Step5's prefill "
                                  "route): run it with FlashInfer installed")

    def run(self, *args, **kwargs):
        raise NotImplementedError(f"attnfuzz's {type(self).__name__} stand-in does not model run() (Step5's prefill "
                                  "route): run it with FlashInfer installed")


class BatchPrefillWithRaggedKVCacheWrapper(_PrefillWrapper):
    pass


class BatchPrefillWithPagedKVCacheWrapper(_PrefillWrapper):
    pass


def _refused(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(f"attnfuzz's FlashInfer stand-in does not model flashinfer.attn_scores.{name} "
                                  "(Step5's SM100 and prefill scoring): run it with FlashInfer installed")
    call.__name__ = name
    return call


def modules() -> dict[str, types.ModuleType]:
    """`flashinfer` and `flashinfer.attn_scores` as Step5's code imports them."""
    top = types.ModuleType("flashinfer")
    top.__path__ = []  # a package, so `flashinfer.attn_scores` resolves
    top.__version__ = "attnfuzz-standin"
    top.BatchPrefillWithRaggedKVCacheWrapper = BatchPrefillWithRaggedKVCacheWrapper
    top.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    scores = types.ModuleType("flashinfer.attn_scores")
    scores.fp8_paged_mqa_logits = _refused("fp8_paged_mqa_logits")
    scores.compute_paged_mqa_logits_schedule = _refused("compute_paged_mqa_logits_schedule")
    top.attn_scores = scores
    return {"flashinfer": top, "flashinfer.attn_scores": scores}


@contextlib.contextmanager
def importable():
    """The stand-in importable as `flashinfer` (and `flashinfer.attn_scores`) for the duration, then removed again
    (a later import finds no FlashInfer, as before)."""
    with importable_as(modules()):
        yield
