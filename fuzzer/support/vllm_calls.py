"""What attnfuzz checks of a vLLM call where Python would not fail at the call itself, or would fail inside vLLM (so
that the failure would read as vLLM's answer): the shape of what it returns (a tensor where a pair was expected is
unpacked row by row, and judged); a method that this release's class only declares (a base class's abstract method
answers in its place, raising NotImplementedError as a bug would) or no longer defines at all (a base class's
fallback of the old name answers, another method than the one attnfuzz means to test); a keyword that the callee
takes into **kwargs and passes on where no parameter of that name is left (a renamed keyword: the TypeError comes
from vLLM's own frame, or the keyword is dropped silently). Each is told by the feature (signatures, where a method
is defined), never by a version string, and raises CallMoved in attnfuzz's frame: could not test, naming the call (a
campaign and a reproducer alike)."""

from __future__ import annotations

import inspect

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


def implemented(obj, name: str, below: type | None = None):
    """`obj.<name>`, a method attnfuzz calls, checked to be implemented: this release's class may only declare it
    (an abstract method of a base class), its implementation moved elsewhere. `below`: a generic base class whose own
    `<name>` is a fallback (an identity, a default) for classes that do not define theirs; the method attnfuzz calls
    must be defined by a class below it, where a class that renamed or dropped its own leaves the fallback to answer
    in its place."""
    method = getattr(obj, name)
    owner = obj if isinstance(obj, type) else type(obj)
    if getattr(method, "__isabstractmethod__", False):
        raise CallMoved(f"{owner.__name__}.{name} is only declared (abstract) in this release: it moved")
    if below is not None:
        defined_by = next((c for c in owner.__mro__ if name in vars(c)), None)
        if defined_by is None or not (issubclass(defined_by, below) and defined_by is not below):
            by = "no class" if defined_by is None else f"{defined_by.__module__}.{defined_by.__qualname__}"
            raise CallMoved(f"{owner.__name__}.{name} is {by}'s fallback in this release, not {owner.__name__}'s own: "
                            f"{owner.__name__} renamed or dropped it")
    return method


def named_keywords(callee, call: str, **kwargs) -> dict:
    """`kwargs`, checked to be named parameters of what takes them: of `callee`, or where `callee` takes them into its
    **kwargs, of what it passes them on to (a class's constructor: the next constructor of its class's MRO, as
    `super().__init__(..., **kwargs)` passes them), or read by name out of those **kwargs (a string constant of the
    code that takes them). A keyword none of them names is one this release renamed or dropped: passed on, its
    TypeError would come from vLLM's frame (read as vLLM's answer), or the keyword would be dropped without a word.
    Returns `kwargs`, to be passed on."""
    chain = ([vars(c)["__init__"] for c in callee.__mro__ if "__init__" in vars(c) and c is not object]
             if isinstance(callee, type) else [callee])
    named, through = set(), []
    for f in chain:
        try:
            params = inspect.signature(f).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature: it names what it takes, Python checks
            return kwargs
        named |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        kw = next((p.name for p in params if p.kind == p.VAR_KEYWORD), None)
        if kw is None:
            break  # what it does not name, Python refuses
        through.append(f"{f.__qualname__}(**{kw})")
        # A keyword read out of **kwargs by name (`mla_args["kv_lora_rank"]`): a string constant of its code.
        code = getattr(inspect.unwrap(f), "__code__", None)
        named |= {c for c in (code.co_consts if code else ()) if isinstance(c, str)}
    missing = [k for k in kwargs if k not in named]
    if missing:
        where = f" ({' > '.join(through)} {'takes it' if len(missing) == 1 else 'take them'} in)" if through else ""
        raise CallMoved(f"{call}: no parameter named {', '.join(missing)} in this release{where}: a keyword attnfuzz "
                        f"passes was renamed or dropped")
    return kwargs
