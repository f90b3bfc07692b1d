"""The interpreter bounds checker on tiny kernels of our own (no vLLM needed)."""

import torch
import triton
import triton.language as tl

from fuzzer.support.interp.sanitizer import SANITIZER


@triton.jit
def _copy(src, dst, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(dst + i, tl.load(src + i, mask=i < n, other=0))  # the store is unmasked: writes BLOCK


@triton.jit
def _scalar_mask_load(src, dst, flag):
    # A scalar pointer with a scalar mask: the interpreter's native load rejects it ("mask has unsupported dtype").
    v = tl.load(src + 1, mask=flag > 0, other=-1)
    tl.store(dst, v)


@triton.jit
def _atomic_count(counter, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.atomic_add(counter + i, 1, mask=i < n)


def test_in_bounds_kernel_reports_nothing():
    src, dst = torch.arange(16, dtype=torch.int32), torch.zeros(16, dtype=torch.int32)
    with SANITIZER.install().collect() as found:
        _copy[(1,)](src, dst, 16, BLOCK=16)
    assert found == [] and torch.equal(dst, src)


def test_out_of_bounds_store_is_reported_and_dropped():
    backing = torch.full((32,), 99, dtype=torch.int32)
    src, dst = torch.arange(16, dtype=torch.int32), backing[:8]  # dst is a view: 8 of 32 elements
    guard = torch.full((64,), 7, dtype=torch.int32)
    with SANITIZER.install().collect() as found:
        _copy[(1,)](src, dst, 16, BLOCK=16)
    assert len(found) == 1
    v = found[0]
    assert (v.kernel, v.op, v.argument, v.lanes, v.byte_offset, v.argument_bytes) == ("_copy", "store", "dst", 8, 32, 32)
    assert v.inside_allocation  # past the view, inside `backing`
    assert "out-of-bounds store" in v.describe()
    assert torch.equal(backing[8:], torch.full((24,), 99, dtype=torch.int32))  # the bad lanes were not written
    assert torch.equal(guard, torch.full((64,), 7, dtype=torch.int32))


def test_scalar_mask_is_corrected():
    src, dst = torch.tensor([1, 2], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with SANITIZER.install().collect() as found:
        _scalar_mask_load[(1,)](src, dst, 1)
    assert found == [] and int(dst[0]) == 2
    with SANITIZER.collect():
        _scalar_mask_load[(1,)](src, dst, 0)
    assert int(dst[0]) == -1


def test_atomics_are_checked():
    counter = torch.zeros(4, dtype=torch.int32)
    with SANITIZER.install().collect() as found:
        _atomic_count[(1,)](counter, 8, BLOCK=8)
    assert [(v.op, v.lanes) for v in found] == [("atomic_rmw", 4)]
    assert counter.tolist() == [1, 1, 1, 1]
