"""What a target hands the reproducer renderer: data and functions, never code in strings
(`fuzzer.artifacts.repro` renders).

A reproducer's `main()` runs, top to bottom: `prepare` (what the target's prepare() did: stand-ins, shims),
the injected bug if any, `setup` (the saved step loaded, vLLM's config built), `call` (the vLLM calls, inside
the interpreter's bounds check on a CPU), then the judge named here, then prints `report`. Each of those is a
`Call`: one line `assign = fn(param=expression, ...)`, where `fn` is the very function of `fuzzer.support`
the target's run() calls; the reproducer shows its source. Expressions may use the constants, the literal
tensors, `T` (the tensors loaded from tensors.safetensors), `DEVICE`, what earlier calls assigned, and
`found` (a list a call may add the problems its own checks saw to). An argument may also be a function of
`fuzzer.support` itself, passed uncalled (repro.py imports it by name): a target whose path a choice decides
(which backend) passes the function of its choice (or a tuple of them), so that the reproducer carries that path's
code only.

Leaf module: the standard library only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

JUDGES = ("index", "index_contract", "attention", "dcp", "dsv4")  # fuzzer/artifacts/repro_judges.py: judge_<name>


@dataclass(frozen=True)
class Judge:
    """Which check the script runs: `judge_<name>(**args)`, each argument an expression in main()'s scope."""

    name: str
    args: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in JUDGES:
            raise ValueError(f"judge {self.name!r}: one of {', '.join(JUDGES)}")


@dataclass(frozen=True)
class Call:
    """One line of a reproducer's main(): `assign = fn(param=expression, ...)` (`assign` empty: the value is
    dropped). `fn` is a module-level function of `fuzzer.support`; its source is copied into repro.py."""

    fn: Callable
    args: Mapping[str, str | Callable | tuple[Callable, ...]] = field(default_factory=dict)  # parameter -> expression
    # (or support function, or a tuple of them)
    assign: str = ""
    note: str = ""  # a comment at the end of the line: why this call is here


@dataclass(frozen=True)
class ReproSpec:
    about: str  # the docstring's lines after the finding's: the shrunk case, where the inputs come from
    call: tuple[Call, ...]  # the vLLM calls, top to bottom
    judge: Judge
    prepare: tuple[Call, ...] = ()  # before the injected bug: what the target's prepare() installs
    setup: tuple[Call, ...] = ()  # after it, outside the bounds check: vLLM's config, the cache, the metadata
    report: Mapping[str, str] = field(default_factory=dict)  # label -> expression, printed after judging
    constants: Mapping[str, Any] = field(default_factory=dict)  # NAME = repr(value), at module level
    literals: Mapping[str, Any] = field(default_factory=dict)  # int tensors written as torch.tensor literals
    tensors: Mapping[str, Any] = field(default_factory=dict)  # saved to tensors.safetensors, loaded as T
    bounds_checked: bool = False  # run the call under the interpreter's bounds checker (CPU)


def memory_finding(finding) -> bool:
    """A memory finding: the bounds checks saw an access outside its tensors, or a verdict of class A."""
    return bool(finding.observation.memory) or any(v.bug_class == "A" for v in finding.verdicts)


def unchecked_unless_memory(spec: ReproSpec, finding, stand_ins: str = "") -> ReproSpec:
    """`spec` without the interpreter's bounds checker where the finding is not a memory one: its CPU reproducer runs
    vLLM's interpreted kernels unchecked, as its GPU reproducer runs without compute-sanitizer (a run the checker saw
    nothing in is the same without it); `stand_ins`: what still checks (the stand-ins' own bounds checks)."""
    if not spec.bounds_checked or memory_finding(finding):
        return spec
    return dataclasses.replace(spec, bounds_checked=False, about=spec.about + (
        "\nNot a memory finding: vLLM's Triton kernels run interpreted without attnfuzz's bounds checker (a memory "
        "finding's reproducer has it)" + (f"; {stand_ins}" if stand_ins else "") + "."))
