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
    _interpreted_constexprs()
    SHIMS.append("triton interpreter: InterpretedFunction.constexprs (the compiled JITFunction's list of "
                 "constexpr parameter positions, which vLLM's kernel launcher counts)")
    return SHIMS


def _interpreted_constexprs() -> None:
    """vLLM's `kernel_launcher` reads `kernel.constexprs` (positions of the constexpr parameters, as the
    compiled `JITFunction` has them) to size its cached launch; the interpreter's function lacks it."""
    import inspect

    from triton.runtime.interpreter import InterpretedFunction

    if hasattr(InterpretedFunction, "constexprs"):
        return

    def constexprs(self) -> list[int]:
        params = inspect.signature(self.fn).parameters.values()
        return [i for i, p in enumerate(params) if "constexpr" in str(p.annotation)]

    InterpretedFunction.constexprs = property(constexprs)
