"""What vLLM's CUDA-built Python needs to run its CPU tensors on a host without an accelerator.

These change no computation: they only stop vLLM from asking for an accelerator (pinned host memory).
Results list them, like stand-ins.
"""

from __future__ import annotations

SHIMS: list[str] = []


def install_cpu_shims() -> list[str]:
    if SHIMS:
        return SHIMS
    import vllm.utils.torch_utils as torch_utils

    if getattr(torch_utils, "PIN_MEMORY", False):
        torch_utils.PIN_MEMORY = False  # pin_memory() raises "Cannot access accelerator device" on CPU
    SHIMS.append("vllm.utils.torch_utils.PIN_MEMORY=False")
    return SHIMS
