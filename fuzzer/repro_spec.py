"""What a target hands the reproducer renderer: data, never a script (`fuzzer.artifacts.repro` renders).

A reproducer's `main()` runs, top to bottom: `prepare` (what the target's prepare() did: stand-ins, shims),
the injected bug if any, `setup` (load the saved step, build vLLM's config), `call` (the vLLM calls, inside
the interpreter's bounds check on a CPU), then the judge named here, then `report`. Code snippets are
statements at main()'s indentation; they may use the constants, the literal tensors, `T` (the tensors
loaded from tensors.safetensors), `DEVICE`, the support modules under their aliases, and `found` (a list
the call may add problems to that its own checks saw). The call assigns what the judge's arguments name.

Leaf module: the standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

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
class ReproSpec:
    about: str  # the docstring's lines after the finding's: the shrunk case, where the inputs come from
    call: str  # the vLLM calls, top to bottom
    judge: Judge
    prepare: str = ""  # before the injected bug: what the target's prepare() installs
    setup: str = ""  # after it, outside the bounds check: the saved step loaded, vLLM's config built
    report: str = ""  # after judging, before the BUG lines: what ran (routes, stand-ins)
    imports: tuple[str, ...] = ()  # module-level import lines the snippets need (stdlib, torch, vLLM)
    constants: Mapping[str, Any] = field(default_factory=dict)  # NAME = repr(value), at module level
    literals: Mapping[str, Any] = field(default_factory=dict)  # int tensors written as torch.tensor literals
    tensors: Mapping[str, Any] = field(default_factory=dict)  # saved to tensors.safetensors, loaded as T
    support: Mapping[str, str] = field(default_factory=dict)  # alias -> fuzzer.support module main() imports
    bounds_checked: bool = False  # run the call under the interpreter's bounds checker (CPU)
