"""What vLLM's CUDA-built Python needs to run its CPU tensors on a host without an accelerator.

These change no computation: they stop vLLM from asking for an accelerator (pinned host memory), and fill gaps of
Triton's interpreter (what a compiled kernel has or does the same).
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
    _boolean_masks()
    SHIMS.append("triton interpreter: load/store masks taken as bool (it keeps `tl.max(x) < 0 & mask` as int32 and "
                 "then refuses it; a GPU compiles it to i1, the same lanes)")
    return SHIMS


def _boolean_masks() -> None:
    """Triton's interpreter computes an int1 scalar from a reduction's comparison `&` an int1 vector as int32 (numpy's
    promotion; 0.34's `_neutralize_dcp_empty_rows_kernel`: `is_empty & (head_offsets < num_heads)`), and its masked
    load and store then raise "mask has unsupported dtype". The mask's lanes are 0 and 1 either way: taken as bool."""
    import numpy as np
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    if getattr(builder.create_masked_store, "_attnfuzz_bool_mask", False):
        return
    load, store = builder.create_masked_load, builder.create_masked_store

    def as_bool(mask):
        data = np.asarray(mask.data)
        return mask if data.dtype == bool else interp.TensorHandle(data.astype(bool), interp.tl.int1)

    def create_masked_load(b, ptrs, mask, other, *policy):
        return load(b, ptrs, as_bool(mask), other, *policy)

    def create_masked_store(b, ptrs, value, mask, *policy):
        return store(b, ptrs, value, as_bool(mask), *policy)

    create_masked_load._attnfuzz_bool_mask = create_masked_store._attnfuzz_bool_mask = True
    builder.create_masked_load, builder.create_masked_store = create_masked_load, create_masked_store


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
