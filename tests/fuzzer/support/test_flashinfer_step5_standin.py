"""The import stand-in of the FlashInfer names Step5's DSA backend imports (fuzzer/support/standins/flashinfer_step5.py):
the constructor's documented contract, every call it does not model refused, importable only while asked."""

import sys

import pytest
import torch

from fuzzer.support.standins import flashinfer_step5


def test_constructs_as_the_adapter_does_and_refuses_every_call():
    with flashinfer_step5.importable():
        from flashinfer import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper
        from flashinfer.attn_scores import compute_paged_mqa_logits_schedule, fp8_paged_mqa_logits

        ws = torch.empty(1024, dtype=torch.uint8)
        ragged = BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa2")  # Step5FlashInferSparse.__init__
        paged = BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        for call in (ragged.plan, ragged.run, paged.plan, paged.run, fp8_paged_mqa_logits,
                     compute_paged_mqa_logits_schedule):
            with pytest.raises(NotImplementedError, match="stand-in"):
                call()
        with pytest.raises(ValueError, match="kv_layout"):
            BatchPrefillWithRaggedKVCacheWrapper(ws, "NDH")
        with pytest.raises(ValueError, match="workspace"):
            BatchPrefillWithRaggedKVCacheWrapper(torch.empty(4), "NHD")
        with pytest.raises(ValueError, match="backend"):
            BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa9")
        with pytest.raises(NotImplementedError, match="use_cuda_graph"):
            BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", True)
    assert sys.modules.get("flashinfer") is None or not hasattr(sys.modules["flashinfer"], "attn_scores") \
        or sys.modules["flashinfer"].__version__ != "attnfuzz-standin"
