"""Arithmetic corrections for Triton's interpreter (CPU), so bf16 and fp8 kernels mean something there.

The interpreter (triton 3.9, `triton/runtime/interpreter.py`) keeps bf16 as raw uint16 bit patterns and fp8
as raw uint8 bit patterns (`_get_np_dtype`), and several of its operations treat those containers wrongly
(measured.md, Trap 2). `install_corrections()` replaces the affected `InterpreterBuilder` methods at class
level, like the sanitizer does for loads and stores; each replacement handles only the cases it corrects and
hands everything else to the original method. `install(*corrections)` installs some of them (`correct_floats`,
`correct_e2m1x2_asm`, `correct_index_scalar`): a path whose kernels need fewer installs (and its reproducer carries)
only those.

Rounding is torch's `.to()` (round to nearest even, as the compiled `cvt.rn.*` casts on NVIDIA), with the
two places where torch and the compiled Triton cast differ set to what the GPU does (measured: Triton 3.6
on an H200, `x.to(...)` in a kernel): `cvt.rn.satfinite` clamps fp8 overflow and infinities to the largest
finite value (torch 2.13 already does so for e4m3fn, but sends e5m2 overflow to inf), and NaN becomes the
positive canonical NaN (fp8 0x7F, bf16 0x7FFF; torch keeps the sign, bf16 0x7FC0 or 0xFFFF). Everything else,
ties and subnormals included, was byte-identical between torch, the GPU and these corrections.
"""

from __future__ import annotations

import re

import numpy as np

DOT = "dot-bf16-fp16-fp8: tl.dot on the operands' true values, fp32 accumulation (triton#11584)"
CAST_TO_FP8 = "cast-to-fp8: float->fp8e4nv/fp8e5 rounded to nearest even, satfinite (triton#8322)"
CAST_FROM_FP8 = "cast-from-fp8: fp8->float of NaN/inf codes"
CAST_BF16 = "cast-bf16: float/int<->bf16 rounded to nearest even (the interpreter truncated)"
INLINE_ASM_E2M1X2 = ("inline-asm-e2m1x2: PTX `cvt.rn.satfinite.e2m1x2.f32` (NVFP4 writers) emulated; other inline asm "
                     "still refused")
ARITH_BF16 = ("arith-bf16: bf16 + - * / on the operands' values, rounded to nearest even (the interpreter used their "
              "uint16 bits)")
INDEX_SCALAR = ("index-scalar: a scalar used as an index is its one element (Triton 3.6 took int() of a 1-element "
                "array: NumPy 2 refuses)")
CORRECTIONS: tuple[str, ...] = (DOT, CAST_TO_FP8, CAST_FROM_FP8, CAST_BF16, ARITH_BF16, INLINE_ASM_E2M1X2, INDEX_SCALAR)

_INSTALLED: dict = {}  # correct_* -> the names it returned: the corrections in force in this process
_TORCH: dict = {}  # triton dtype -> torch dtype, for the types corrected here
_LUTS: dict = {}  # fp8 triton dtype -> float32[256] values of its codes
_SATFINITE = {"fp8e4nv": 448.0, "fp8e5": 57344.0}


def _values(data, tl_dtype) -> np.ndarray:
    """The true values of an interpreter container (bf16: uint16 bits, fp8: uint8 bits) as float32."""
    data = np.asarray(data)
    if tl_dtype.name == "bf16":  # bf16 is the top half of an fp32: exact, subnormals and NaN included
        return (data.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if tl_dtype in _LUTS:
        return _LUTS[tl_dtype][data]
    return data.astype(np.float32)


def _encode(values, tl_dtype) -> np.ndarray:
    """Round float32 values to `tl_dtype` as the compiled cast does; return the interpreter's container."""
    import torch

    v = np.asarray(values, dtype=np.float32)
    if tl_dtype.name in ("fp16", "fp32"):
        return v.astype(np.float16 if tl_dtype.name == "fp16" else np.float32)
    if tl_dtype.name in _SATFINITE:
        v = np.clip(v, -_SATFINITE[tl_dtype.name], _SATFINITE[tl_dtype.name])  # NaN stays NaN
    t = torch.from_numpy(v.reshape(-1).copy()).to(_TORCH[tl_dtype])
    bits = t.view(torch.int16).numpy().view(np.uint16) if tl_dtype.name == "bf16" else t.view(torch.uint8).numpy()
    bits[np.isnan(v.reshape(-1))] = 0x7FFF if tl_dtype.name == "bf16" else 0x7F
    return bits.reshape(v.shape)


_E2M1_CVT = re.compile(r"cvt\.rn\.satfinite\.e2m1x2\.f32\s+\w+\s*,\s*\$(\d+)\s*,\s*\$(\d+)")


def _e2m1(x: np.ndarray) -> np.ndarray:
    """float32 -> e2m1 codes as `cvt.rn.satfinite` rounds (PTX ISA: to nearest, ties to even, saturating at 6; the sign
    kept): each bound is where the next code is taken, a tie going up where the upper code is even."""
    m = np.abs(x)
    code = sum((m > 0.25, m >= 0.75, m > 1.25, m >= 1.75, m > 2.5, m >= 3.5, m > 5.0), np.zeros(m.shape, np.uint32))
    return code | (np.signbit(x).astype(np.uint32) << np.uint32(3))


def _e2m1x2_asm(asm: str, values) -> np.ndarray | None:
    """The result of the two inline-asm forms vLLM's NVFP4 writers use, or None for any other asm: the byte of
    `cvt.rn.satfinite.e2m1x2.f32 d, a, b` (a in the high nibble, b in the low) widened to 32 bits, as both the
    `cvt.u32.u8` form and the `mov.b32 {t,t,t,t}; and.b32 255` form give it. $0 is the output; $k the (k-1)th arg."""
    m = _E2M1_CVT.search(asm)
    if m is None or ("cvt.u32.u8" not in asm and "and.b32" not in asm):
        return None
    hi, lo = (np.asarray(values[int(g) - 1].data, dtype=np.float32) for g in m.groups())
    return (_e2m1(hi) << np.uint32(4)) | _e2m1(lo)


class _AsmCall:
    """What `tl.inline_asm_elementwise` reads of the builder's call: its one result."""

    def __init__(self, handle):
        self.handle = handle

    def get_result(self, i: int):
        assert i == 0, "one output register"
        return self.handle


def install_corrections() -> tuple[str, ...]:
    """Every correction (EVERY: a campaign's, whatever its kernels reach), once per process; returns CORRECTIONS."""
    return install(*EVERY)


def install(*corrections) -> tuple[str, ...]:
    """`corrections` (the correct_* below: those a path's kernels need) installed, each once per process; the names
    of those corrections."""
    import triton.language as tl
    from triton.runtime import interpreter as interp

    for correct in corrections:
        if correct not in _INSTALLED:
            _INSTALLED[correct] = correct(tl, interp, interp.InterpreterBuilder)
    return tuple(name for correct in corrections for name in _INSTALLED[correct])


def correct_floats(tl, interp, B) -> tuple[str, ...]:
    """bf16/fp8 kernels' arithmetic: tl.dot, fp8 and bf16 casts, bf16 + - * / (DOT, CAST_*, ARITH_BF16)."""
    import torch

    _TORCH.update({tl.bfloat16: torch.bfloat16, tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2})
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    _LUTS.update({t: codes.view(_TORCH[t]).float().numpy() for t in (tl.float8e4nv, tl.float8e5)})
    dot, cast_impl, fp_to_fp = B.create_dot, B.cast_impl, B.create_fp_to_fp
    low = (tl.bfloat16, tl.float16, tl.float8e4nv, tl.float8e5)
    fp8 = (tl.float8e4nv, tl.float8e5)
    floats = (tl.bfloat16, tl.float16, tl.float32, *fp8)

    def create_dot(b, a, c, d, input_precision, max_num_imprecise_acc):
        """Was: `np.matmul(a.data, b.data, dtype=acc)` on the containers, so bf16 operands entered the product
        as the integers of their uint16 bit patterns (errors ~1e10). Now: each operand is widened to its
        exact float32 value (bf16 by shifting its bits into the top half of an fp32), multiplied with fp32
        accumulation, and the accumulator `d` is added, as the tensor cores do for bf16/fp16/fp8 inputs with
        an fp32 accumulator. fp32/fp64/int8 dots and fp16 accumulators go to the original unchanged."""
        if a.dtype.scalar in low and c.dtype.scalar in low and np.asarray(d.data).dtype == np.float32:
            out = np.matmul(_values(a.data, a.dtype.scalar), _values(c.data, c.dtype.scalar)) + d.data
            return interp.TensorHandle(out.astype(np.float32), d.dtype.scalar)
        return dot(b, a, c, d, input_precision, max_num_imprecise_acc)

    def create_fp_to_fp(b, src, dst_type, rounding_mode):
        """Was: `_convert_float`, whose round-to-nearest adds the guard bit to the truncated mantissa without
        carrying into the exponent (it ORs the overflowed mantissa into the exponent field, so x.111|1 with an
        odd exponent drops to 2^e), rounds ties away from zero instead of to even, re-truncates results that
        land in the subnormal range, does not saturate, and decodes fp8 NaN/inf codes as finite numbers (e4m3fn 0x7F as
        480). Now: the source's exact value is rounded by `_encode` (torch's round to nearest even, satfinite,
        canonical NaN), for fp8 <-> bf16/fp16/fp32/fp8 under the default rounding mode; other cases (rtz,
        fp64 sources, AMD fp8 types) go to the original."""
        s, t = src.dtype.scalar, dst_type.scalar
        rtne = rounding_mode in (None, interp._ir.ROUNDING_MODE.RTNE)
        if (s in fp8 or t in fp8) and s in floats and t in floats and rtne:
            return interp.TensorHandle(_encode(_values(src.data, s), t), t)
        return fp_to_fp(b, src, dst_type, rounding_mode)

    def cast_impl_(b, src, dst_type):
        """Was: fp32<->bf16 through `_convert_float(..., rounding_mode=None)`, i.e. truncation (half of all
        fp32->bf16 casts one ulp low, against `cvt.rn.bf16.f32` on the GPU; `get_bf16` constants and the
        implicit cast of `tl.store` included), and every other bf16 cast as `astype` on the uint16 bits
        (int/fp64 <-> bf16 garbage). Now: bf16 is decoded exactly and encoded by `_encode` (round to nearest even,
        canonical NaN); ints and fp64 go through float32 first, a second rounding only past 24 significant bits."""
        s, t = src.dtype.scalar, dst_type.scalar
        if s == t or tl.bfloat16 not in (s, t):
            return cast_impl(b, src, dst_type)
        if s == tl.bfloat16:
            vals = interp.TensorHandle(_values(src.data, s), tl.float32)
            return vals if t == tl.float32 else cast_impl(b, vals, dst_type)
        vals = np.asarray(src.data)
        return interp.TensorHandle(_encode(vals.astype(np.float32), t), t)

    def bf16_arith(stock, op):
        """Was: numpy's `op` on the two uint16 bit patterns (`binary_op`), e.g. 1.0 * 1.0 -> 0x3F80**2 cut to 16 bits.
        Now, where both operands are bf16: `op` on their exact values in fp32, the result rounded to bf16 by
        `_encode` (nearest even, canonical NaN; overflow to inf), which is the correctly rounded bf16 result (fp32's
        24 bits >= 2 * 8 + 2, so the double rounding cannot differ) as compiled bf16 arithmetic gives it. Other
        dtypes go to the original."""

        def create(b, lhs, rhs):
            if lhs.dtype.scalar != tl.bfloat16 or rhs.dtype.scalar != tl.bfloat16:
                return stock(b, lhs, rhs)
            with np.errstate(all="ignore"):  # inf/nan results are the answer, not a warning
                out = op(_values(lhs.data, tl.bfloat16), _values(rhs.data, tl.bfloat16)).astype(np.float32)
            return interp.TensorHandle(_encode(out, tl.bfloat16), tl.bfloat16)

        return create

    for name, op in (("create_fadd", np.add), ("create_fsub", np.subtract), ("create_fmul", np.multiply),
                     ("create_fdiv", np.divide)):
        setattr(B, name, bf16_arith(getattr(B, name), op))
    B.cast_impl, B.create_dot, B.create_fp_to_fp = cast_impl_, create_dot, create_fp_to_fp
    return DOT, CAST_TO_FP8, CAST_FROM_FP8, CAST_BF16, ARITH_BF16


def correct_e2m1x2_asm(tl, interp, B) -> tuple[str, ...]:
    """The inline asm of vLLM's NVFP4 cache writers emulated (INLINE_ASM_E2M1X2)."""
    inline_asm = B.create_inline_asm

    def create_inline_asm(b, inlineAsm, constraints, values, type, isPure, pack):
        """Was: NotImplementedError for every inline asm. Now: the e2m1x2 conversion vLLM's NVFP4 cache writers
        make (one output register, pack 1) computed as the PTX ISA defines it; any other asm still refused."""
        one = pack == 1 and constraints.startswith("=r,") and len(type) == 1
        out = _e2m1x2_asm(inlineAsm, values) if one else None
        if out is None:
            return inline_asm(b, inlineAsm, constraints, values, type, isPure, pack)
        scalar = getattr(type[0], "scalar", type[0])
        handle = interp.TensorHandle(out.astype(np.int32 if scalar.name == "int32" else np.uint32), scalar)
        return _AsmCall(handle)

    B.create_inline_asm = create_inline_asm
    return (INLINE_ASM_E2M1X2,)


def correct_index_scalar(tl, interp, B) -> tuple[str, ...]:
    """A scalar's `__index__` as Triton 3.9 takes it (INDEX_SCALAR)."""
    patch_lang_tensor = interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        """Was (Triton 3.6): a scalar's `__index__` is `int()` of its one-element array, which NumPy 2 refuses, so
        `range(0, index_width, BLOCK)` over a scalar argument (vLLM's SWA index kernel) raised TypeError. Now: its
        one element, as Triton 3.9 takes it (`.squeeze()`)."""
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interp._patch_lang_tensor = _patch_lang_tensor
    return (INDEX_SCALAR,)


EVERY = (correct_floats, correct_e2m1x2_asm, correct_index_scalar)  # CORRECTIONS' code
