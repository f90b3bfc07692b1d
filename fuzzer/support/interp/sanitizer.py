"""Bounds checking for Triton's interpreter (CPU), plus the interpreter corrections kernels need.

The interpreter has no out-of-bounds detection: loads and stores are raw memcpy on host addresses and CPU
tensors are used in place (measured.md, Trap 3). We wrap its memory entry points and check every active
lane's address against the byte ranges of the launched kernel's tensor arguments. An out-of-bounds lane is
recorded and masked off (a load yields `other`, a store is dropped), so the process survives to report it,
much as compute-sanitizer lets a kernel run on after reporting.

Correction applied here: a scalar `mask=` on a scalar pointer reaches the interpreter's native load as a
0-d numpy bool and fails with "mask has unsupported dtype" (Trap 4); masks are broadcast to the pointer
shape as a bool array, which is what the compiled kernel does.
"""

from __future__ import annotations

import inspect
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

MAX_VIOLATIONS = 64  # per case: the first accesses name the bug; thousands more add nothing


@dataclass(frozen=True)
class MemoryViolation:
    kernel: str
    op: str  # load | store | atomic_rmw | atomic_cas
    argument: str  # the tensor argument nearest to the first bad address
    byte_offset: int  # of the first bad address, from that argument's first byte (negative: before it)
    argument_bytes: int  # the argument's extent in bytes
    element_bytes: int
    program_id: tuple[int, int, int]
    lanes: int  # out-of-bounds lanes in this access
    inside_allocation: bool  # True: past the argument's view but inside its storage

    def describe(self) -> str:
        where = "inside its allocation" if self.inside_allocation else "outside every argument's allocation"
        rel = (
            f"{self.byte_offset - self.argument_bytes} bytes after the end of"
            if self.byte_offset >= self.argument_bytes
            else f"{-self.byte_offset} bytes before"
        )
        return (
            f"out-of-bounds {self.op} of {self.element_bytes} bytes in {self.kernel} (program {self.program_id}): "
            f"{self.lanes} lane(s), first {rel} `{self.argument}` ({self.argument_bytes} bytes; {where})"
        )


@dataclass(frozen=True)
class _Arg:
    name: str
    start: int
    end: int  # view extent [start, end)
    alloc_start: int
    alloc_end: int


def _tensor_args(fn, args, kwargs) -> list[_Arg]:
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args))
    bound.update({k: v for k, v in kwargs.items() if k in params})
    out = []
    for name, t in bound.items():
        if not hasattr(t, "data_ptr") or not hasattr(t, "untyped_storage"):
            continue
        es = t.element_size()
        lo = hi = 0
        for size, stride in zip(t.shape, t.stride()):
            if size == 0:
                lo = hi = 0
                break
            span = (size - 1) * stride
            lo, hi = (lo + span, hi) if span < 0 else (lo, hi + span)
        start = t.data_ptr() + lo * es
        end = t.data_ptr() + (hi + 1) * es if t.numel() else start
        st = t.untyped_storage()
        out.append(_Arg(name, start, end, st.data_ptr(), st.data_ptr() + st.nbytes()))
    return out


class InterpreterSanitizer:
    """Install once per process; `collect()` gathers the violations of the calls made inside it."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._installed = False
        self.violations: list[MemoryViolation] = []

    # -- public ---------------------------------------------------------------------------------------
    def install(self) -> "InterpreterSanitizer":
        if self._installed:
            return self
        from triton.runtime import interpreter as interp

        san = self
        grid_call = interp.GridExecutor.__call__

        def call(executor, *args, **kwargs):
            stack = san._stack()
            stack.append((executor.fn.__name__, _tensor_args(executor.fn, args, kwargs)))
            try:
                return grid_call(executor, *args, **kwargs)
            finally:
                stack.pop()

        interp.GridExecutor.__call__ = call
        B = interp.InterpreterBuilder
        masked_load, masked_store = B.create_masked_load, B.create_masked_store
        atomic_rmw, atomic_cas = B.create_atomic_rmw, B.create_atomic_cas

        # The policy arguments after the mask differ between Triton releases (3.6 passes one more than 3.9).
        def create_masked_load(b, ptrs, mask, other, *policy):
            return masked_load(b, ptrs, san._check(b, "load", ptrs, mask), other, *policy)

        def create_masked_store(b, ptrs, value, mask, *policy):
            return masked_store(b, ptrs, value, san._check(b, "store", ptrs, mask), *policy)

        def create_atomic_rmw(b, rmw_op, ptr, val, mask, sem, scope):
            return atomic_rmw(b, rmw_op, ptr, val, san._check(b, "atomic_rmw", ptr, mask), sem, scope)

        def create_atomic_cas(b, ptr, cmp, val, sem, scope):
            full = interp.TensorHandle(np.ones(np.shape(ptr.data), dtype=bool), interp.tl.int1)
            if not san._check(b, "atomic_cas", ptr, full).data.all():
                return interp.TensorHandle(np.array(cmp.data, copy=True), cmp.dtype.scalar)  # dropped
            return atomic_cas(b, ptr, cmp, val, sem, scope)

        B.create_masked_load, B.create_masked_store = create_masked_load, create_masked_store
        B.create_atomic_rmw, B.create_atomic_cas = create_atomic_rmw, create_atomic_cas
        self._installed = True
        return self

    @contextmanager
    def collect(self):
        start = len(self.violations)
        found: list[MemoryViolation] = []
        try:
            yield found
        finally:
            found.extend(self.violations[start:])
            del self.violations[start:]

    # -- internals ------------------------------------------------------------------------------------
    def _stack(self) -> list:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def _check(self, builder, op, ptrs, mask):
        from triton.runtime import interpreter as interp

        addr = np.asarray(ptrs.data)
        m = np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape).copy()  # Trap 4 correction
        stack = self._stack()
        if stack and m.any():
            kernel, args = stack[-1]
            es = interp._get_np_dtype(ptrs.get_element_ty()).itemsize
            a = addr.astype(np.uint64)
            ok = np.zeros(addr.shape, dtype=bool)
            for arg in args:
                ok |= (a >= arg.start) & (a + es <= arg.end)
            bad = m & ~ok
            if bad.any():
                self._record(builder, kernel, args, op, a[bad], es, int(bad.sum()))
                m &= ok
        return interp.TensorHandle(m, interp.tl.int1)

    def _record(self, builder, kernel, args, op, bad_addrs, es, lanes):
        if len(self.violations) >= MAX_VIOLATIONS or not args:
            return
        first = int(bad_addrs[0])

        def distance(arg):
            return 0 if arg.start <= first < arg.end else min(abs(first - arg.start), abs(first - arg.end))

        near = min(args, key=distance)
        inside = any(x.alloc_start <= first and first + es <= x.alloc_end for x in args)
        pid = tuple(int(v) for v in (builder.grid_idx or (0, 0, 0)))
        self.violations.append(
            MemoryViolation(kernel, op, near.name, first - near.start, near.end - near.start, es, pid, lanes, inside)
        )


SANITIZER = InterpreterSanitizer()
