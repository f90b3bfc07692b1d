"""What attnfuzz checks of a vLLM call where Python would not fail at the call itself: the shape of what it returns
(a tensor where a pair was expected is unpacked row by row, and judged), and a method that this release's class only
declares (a base class's abstract method answers in its place, raising NotImplementedError as a bug would). Either
raises CallMoved in attnfuzz's frame: could not test, naming the call (a campaign and a reproducer alike)."""

from __future__ import annotations

from fuzzer.support.errors import CallMoved


def returned(result, n: int, call: str):
    """`result` of vLLM's `call`, checked to be what attnfuzz takes apart: an n-tuple, or with n 1 one value (no
    tuple)."""
    got = len(result) if isinstance(result, tuple) else 1
    if got != n:
        what = f"a {got}-tuple" if isinstance(result, tuple) else f"one {type(result).__name__}"
        raise CallMoved(f"{call} returned {what}, where attnfuzz takes {'one value' if n == 1 else f'a {n}-tuple'} "
                        f"apart: this release moved what it returns")
    return result


def implemented(obj, name: str):
    """`obj.<name>`, a method attnfuzz calls, checked to be implemented: this release's class may only declare it
    (an abstract method of a base class), its implementation moved elsewhere."""
    method = getattr(obj, name)
    if getattr(method, "__isabstractmethod__", False):
        owner = obj if isinstance(obj, type) else type(obj)
        raise CallMoved(f"{owner.__name__}.{name} is only declared (abstract) in this release: it moved")
    return method
