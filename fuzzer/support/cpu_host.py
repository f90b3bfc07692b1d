"""What a CPU needs before vLLM's Triton kernels run on it: Triton's interpreter corrected and vLLM kept from
asking for an accelerator. torch, triton and vLLM only."""

from __future__ import annotations

from fuzzer.support.interp.corrections import CORRECTIONS, install_corrections
from fuzzer.support.standins.cpu_shims import install_cpu_shims


def prepare_cpu_host() -> list[str]:
    """attnfuzz's corrections of Triton's interpreter (its bf16 dot and casts), and no pinned host memory (a CPU has
    no accelerator to pin it for); returns what was installed, in words. Once per process."""
    install_corrections()
    return [*install_cpu_shims(), *(f"interpreter correction: {c}" for c in CORRECTIONS)]
