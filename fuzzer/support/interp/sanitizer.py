"""Bounds checking for Triton's interpreter (CPU), plus the interpreter corrections kernels need.

The interpreter has no out-of-bounds detection: loads and stores are raw memcpy on host addresses and CPU
tensors are used in place (measured.md, Trap 3). We wrap its memory entry points and check every active
lane's address against the byte ranges of the launched kernel's tensor arguments. An out-of-bounds lane is
recorded and masked off (a load yields `other`, a store is dropped), so the process survives to report it,
much as compute-sanitizer lets a kernel run on after reporting.

Correction applied here: a scalar `mask=` on a scalar pointer reaches the interpreter's native load as a
0-d numpy bool and fails with "mask has unsupported dtype" (Trap 4); masks are broadcast to the pointer
shape as a bool array, which is what the compiled kernel does.

A campaign also makes the interpreter cheaper per operation (`speed_up_interpreter`, before `install()`), never
changing what an operation computes or which accesses are checked (tests/fuzzer/support/test_interp_speedups.py):
interpreted, each Triton operation costs tens of microseconds of Triton's front end in Python (type checks,
broadcasting, shape bookkeeping) against a few of numpy work, and a kernel runs its body once per program, so a case's
cost grows with its grid (the index remap: tokens x top-k width / 128 programs). A reproducer runs one case and leaves
the interpreter as Triton ships it, as a campaign does with ATTNFUZZ_INTERP_FAST=0 (to measure the difference).
"""

from __future__ import annotations

import builtins
import dataclasses
import inspect
import os
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
        past = self.byte_offset - self.argument_bytes
        rel = f"{past} bytes after the end of" if past >= 0 else f"{-self.byte_offset} bytes before"
        return (f"out-of-bounds {self.op} of {self.element_bytes} bytes in {self.kernel} (program {self.program_id}): "
                f"{self.lanes} lane(s), first {rel} `{self.argument}` ({self.argument_bytes} bytes; {where})")


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


class Violations:
    """Where bounds checks report: the interpreter's (InterpreterSanitizer, below) and the stand-ins' own, into one
    list. `collect()` gathers those of the calls made inside it. A reproducer whose interpreted kernels go unchecked
    still collects its stand-ins' reports here."""

    def __init__(self, violations: list[MemoryViolation] | None = None) -> None:
        self.violations: list[MemoryViolation] = [] if violations is None else violations

    @contextmanager
    def collect(self):
        start = len(self.violations)
        found: list[MemoryViolation] = []
        try:
            yield found
        finally:
            found.extend(self.violations[start:])
            del self.violations[start:]


VIOLATIONS = Violations()


class InterpreterSanitizer(Violations):
    """Install once per process; `collect()` gathers the violations of the calls made inside it (the stand-ins'
    among them: one list with VIOLATIONS)."""

    def __init__(self) -> None:
        super().__init__(VIOLATIONS.violations)
        self._local = threading.local()
        self._installed = False

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

        B.create_masked_load, B.create_masked_store = _taking(create_masked_load), _taking(create_masked_store)
        B.create_atomic_rmw, B.create_atomic_cas = _taking(create_atomic_rmw), _taking(create_atomic_cas)
        self._installed = True
        return self

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
            active = a[m]
            lo, hi = int(active.min()), int(active.max()) + es
            if any(arg.start <= lo and hi <= arg.end for arg in args):  # every active lane inside one argument
                return interp.TensorHandle(m, interp.tl.int1)
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


# -- a cheaper interpreter ------------------------------------------------------------------------------------
# Each speed-up replaces one piece of Triton's interpreter or front end with one that returns the same thing with
# less Python, and is applied only where the piece looks as it does in the Triton releases it was measured on (3.9),
# checked by building the same objects both ways; anything else goes to the original. Measured on the index remap
# (2,048 columns, 8 tokens, 128 programs): 0.46 s of CPU before, ~0.15 s after; the overflow checks were half of it.

_SPED_UP: list[str] = []


def _taking(entry):
    """`entry` as the interpreter's builder method, refusing from here a call it cannot take: Triton passes its
    arguments by position and their number changes between releases (3.6 once passed one more than a wrapper took).
    Unwrapped, that TypeError is raised in Triton's frame and reads as the kernel's; raised here, it is the checker's
    (CheckerBroke), and a reproducer tells it by this module's frame."""
    code = entry.__code__
    least, most = code.co_argcount, (1 << 30 if code.co_flags & inspect.CO_VARARGS else code.co_argcount)

    def method(*args):
        if not least <= len(args) <= most:
            from fuzzer.support.errors import CheckerBroke  # deferred: its module imports torch (`attnfuzz list` must not)

            raise CheckerBroke(f"attnfuzz's bounds checker cannot take Triton's call {entry.__name__} with "
                               f"{len(args)} arguments (it takes {least}{'+' if most > least else ''})")
        return entry(*args)

    method.__name__ = entry.__name__
    return method


def speed_up_interpreter() -> tuple[str, ...]:
    """Apply the speed-ups (once per process, under TRITON_INTERPRET=1 only: the front-end ones would also run for
    compiled kernels); returns what was applied, in words."""
    if _SPED_UP or os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("ATTNFUZZ_INTERP_FAST") == "0":
        return tuple(_SPED_UP)
    from triton.language import core
    from triton.language.semantic import TritonSemantic
    from triton.runtime import interpreter as interp

    for speed_up in (_no_discarded_overflow_checks, _cached_np_dtypes, _cached_block_types, _cached_tensor_shapes,
                     _no_broadcast_of_equal_shapes, _cached_builtin_names):
        try:
            done = speed_up(interp, core, TritonSemantic)
        except Exception:  # a Triton this does not know: that piece stays as Triton ships it
            done = None
        if done:
            _SPED_UP.append(done)
    return tuple(_SPED_UP)


def _no_discarded_overflow_checks(interp, core, semantic):
    """The interpreter's options say `sanitize_overflow=True` and `debug=False`: every integer add, sub and mul
    is recomputed in int64 and compared against its type's range (five more front-end operations), and then
    `device_assert` returns at once because debug is off, so the result is thrown away; the compiled kernel drops
    the same checks. With debug on (never, as Triton 3.9 builds the interpreter's options) they stay."""
    options = interp.interpreter_builder.options
    if options.debug or not options.sanitize_overflow:
        return None
    interp.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return "integer overflow checks whose assert is off (debug=False) are not computed"


def _cached_np_dtypes(interp, core, semantic):
    """`_get_np_dtype` builds an 18-entry dict of numpy dtypes on every call (every load, store, splat, reduce and
    bounds check); the answer for a scalar type is fixed."""
    original = interp._get_np_dtype
    cache: dict[str, object] = {}

    def _get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, core.block_type):
            tt_dtype = tt_dtype.element_ty
        found = cache.get(tt_dtype.name)
        if found is None:
            found = cache[tt_dtype.name] = original(tt_dtype)
        return found

    for t in (core.int32, core.bfloat16, core.pointer_type(core.float32), core.block_type(core.int1, [4])):
        if _get_np_dtype(t) != original(t):
            return None
    interp._get_np_dtype = _get_np_dtype
    return "numpy dtypes of Triton's types cached"


def _shape_key(core, shape):
    """A list or Triton tuple of ints (or constexpr ints) as a tuple of ints; None for anything else."""
    values = shape.values if isinstance(shape, core.tuple) else shape
    if not isinstance(values, (list, builtins.tuple)):
        return None
    out = []
    for s in values:
        if type(s) is core.constexpr:
            s = s.value
        if type(s) is not int:
            return None
        out.append(s)
    return builtins.tuple(out)


def _cached_block_types(interp, core, semantic):
    """`block_type(element, shape)` unwraps, validates and formats its shape every time one is made (tens per
    operation); what it derives from (shape, str(element)) is cached. Shapes it would reject never reach the cache."""
    cls = core.block_type
    original = cls.__init__
    cache: dict[tuple, tuple] = {}

    def __init__(self, element_ty, shape):
        key = _shape_key(core, shape) if isinstance(shape, (list, core.tuple)) else None
        name = getattr(element_ty, "name", None)
        if key is not None and isinstance(name, str):
            found = cache.get((name, key))
            if found is not None:
                self.element_ty = element_ty
                self.shape, self.numel, self.name = found
                return
        original(self, element_ty, shape)
        if key is not None and isinstance(name, str):
            cache[(name, key)] = (self.shape, self.numel, self.name)

    def make():
        return [cls(core.int32, [2, 8]), cls(core.pointer_type(core.int32), core.tuple([core.constexpr(8)]))]

    made = make()
    if any(set(vars(t)) != {"element_ty", "shape", "numel", "name"} for t in made):
        return None
    cls.__init__ = __init__
    if any(vars(a) != vars(b) for again in (make(), make()) for a, b in zip(made, again)):  # a miss, then a hit
        cls.__init__ = original
        return None
    return "block types' shapes, sizes and names cached"


def _cached_tensor_shapes(interp, core, semantic):
    """`tensor(handle, type)` rebuilds its shape as a Triton tuple of constexprs (a tuple type per element) for
    every value an operation makes; for a block type the (immutable) numel and shape are shared."""
    cls = core.tensor
    original = cls.__init__
    cache: dict[tuple, tuple] = {}

    def __init__(self, handle, type):
        if isinstance(type, core.block_type):
            key = _shape_key(core, type.shape)
            found = cache.get(key) if key is not None else None
            if found is not None:
                self.handle, self.type, self.dtype = handle, type, type.element_ty
                self.numel, self.shape = found
                return
            original(self, handle, type)
            if key is not None:
                cache[key] = (self.numel, self.shape)
            return
        original(self, handle, type)

    ty = core.block_type(core.int32, [4, 8])
    before = cls(None, ty)
    if set(vars(before)) != {"handle", "shape", "numel", "type", "dtype"}:
        return None
    cls.__init__ = __init__
    first, second = cls(None, ty), cls(None, ty)
    if not all(vars(t).keys() == vars(before).keys() and t.numel.value == before.numel.value
               and [s.value for s in t.shape] == [s.value for s in before.shape] and t.dtype == before.dtype
               for t in (first, second)):
        cls.__init__ = original
        return None
    return "tensors' shapes shared per block shape"


def _no_broadcast_of_equal_shapes(interp, core, semantic):
    """`broadcast_impl_value` on two blocks of one shape returns both unchanged, after building the broadcast
    shape and comparing Triton tuples element by element; equal shapes return at once."""
    original = semantic.broadcast_impl_value

    def broadcast_impl_value(self, lhs, rhs):
        lt, rt = getattr(lhs, "type", None), getattr(rhs, "type", None)
        if isinstance(lt, core.block_type) and isinstance(rt, core.block_type):
            key = _shape_key(core, lt.shape)
            if key is not None and key == _shape_key(core, rt.shape):
                return lhs, rhs
        return original(self, lhs, rhs)

    semantic.broadcast_impl_value = broadcast_impl_value
    return "broadcasts of blocks of one shape skipped (they return both operands unchanged)"


def _cached_builtin_names(interp, core, semantic):
    """`_patch_builtin(pkg)` (each launch, and each call of a @triton.jit function from a kernel: tl.sum's and
    tl.cumsum's combine functions, a kernel's helpers) scans every member of triton.language, its core, math and
    tensor with `inspect.getmembers` to find the builtins to wrap: ~4 ms a call, 40% of the index remap's counting
    path. Which names are builtins is fixed once Triton is imported; they are found once per package (a name already
    wrapped, by an outer launch or an earlier call, is recognised by the builtin its wrapper holds), and each call
    wraps those that are builtins at that moment, in the same (sorted) order."""
    original = interp._patch_builtin
    names: dict[int, tuple[object, list[str]]] = {}

    def builtin_names(pkg) -> list[str]:
        found = names.get(id(pkg))
        if found is None or found[0] is not pkg:
            listed = []
            for name, member in inspect.getmembers(pkg):
                wrapped = (getattr(member, "__kwdefaults__", None) or {}).get("member")  # `_patch_attr`'s wrapper
                if core.is_builtin(member) or core.is_builtin(wrapped):
                    listed.append(name)
            found = names[id(pkg)] = (pkg, listed)
        return found[1]

    def _patch_builtin(pkg, builder, scope):
        for name in builtin_names(pkg):
            member = getattr(pkg, name, None)
            if core.is_builtin(member):
                interp._patch_attr(pkg, name, member, builder, scope)

    if list(inspect.signature(original).parameters) != ["pkg", "builder", "scope"] or not hasattr(interp, "_patch_attr"):
        return None
    interp._patch_builtin = _patch_builtin
    return "the builtins of triton.language found once, not by scanning every member on each kernel or function call"
