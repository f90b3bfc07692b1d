"""On a GPU: with ATTNFUZZ_POISON_ALLOCATOR=1, what the caching allocator hands out after the poisoning reads
as NaN, in both of its pools; without it, nothing is done."""

import pytest
import torch

from fuzzer.targets.guards import poison_free_memory

# tests/conftest.py hides the GPU unless ATTNFUZZ_TEST_DEVICE=cuda (README: how tests/gpu run on the GPU host).
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (ATTNFUZZ_TEST_DEVICE=cuda)")


def test_unwritten_allocations_read_as_nan(monkeypatch):
    monkeypatch.delenv("PYTORCH_NO_CUDA_MEMORY_CACHING", raising=False)
    monkeypatch.setenv("ATTNFUZZ_POISON_ALLOCATOR", "1")
    assert poison_free_memory("cuda")
    large = torch.empty(64, 128, 512, dtype=torch.bfloat16, device="cuda")  # 8 MiB: the large pool
    small = torch.empty(1000, dtype=torch.float32, device="cuda")  # the small pool
    assert large.isnan().all() and small.isnan().all()
    monkeypatch.setenv("ATTNFUZZ_POISON_ALLOCATOR", "0")
    assert not poison_free_memory("cuda")
