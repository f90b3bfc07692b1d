"""What a CPU needs before vLLM's Triton kernels run on it: Triton's interpreter corrected and vLLM kept from
asking for an accelerator. torch, triton and vLLM only."""

from __future__ import annotations

from fuzzer.support.interp.corrections import EVERY, install
from fuzzer.support.standins.cpu_shims import install_cpu_shims


def prepare_cpu_host() -> list[str]:
    """attnfuzz's corrections of Triton's interpreter (all of them: its bf16 dot and casts, ...), and no pinned host
    memory (a CPU has no accelerator to pin it for); returns what was installed, in words. Once per process."""
    return prepare_cpu_host_for(*EVERY)


def prepare_cpu_host_for(*corrections) -> list[str]:
    """prepare_cpu_host with only the interpreter corrections a path's kernels need (`corrections`: the correct_* of
    fuzzer.support.interp.corrections); returns what was installed, in words."""
    return [*install_cpu_shims(), *interpreter_corrections(*corrections)]


def interpreter_corrections(*corrections) -> list[str]:
    """Triton's interpreter corrected by `corrections` (the correct_* of fuzzer.support.interp.corrections); what
    was installed, in words as every result names it."""
    return [f"interpreter correction: {name}" for name in install(*corrections)]
