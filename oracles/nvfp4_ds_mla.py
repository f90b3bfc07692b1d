"""Pure-torch model of DeepSeek-V3.2's 352-byte `nvfp4_ds_mla` cache entry (SM100's FlashMLA), from the format's
definition (vLLM 0.33.0's FlashMLA-sparse backend docstring and the layout comment of its Triton writer in
`deepseek_v32/common/kernels.py`), independent of vLLM's writer and readers.

An entry holds one 512-wide latent (NoPE) and 64 RoPE values:

    [0, 256)    512 e2m1 NoPE values, two a byte, the even element in the low nibble
    [256, 320)  64 float8_e4m3fn RoPE values, unscaled
    [320, 352)  32 float8_e4m3fn NoPE scales, one per 16 elements, permuted: block s's at byte 320 + 8 * (s & 3) + (s >> 2)

A page holds `block_size` whole entries back to back. Works on CPU and CUDA.
"""

from __future__ import annotations

import torch

NOPE, ROPE, BLOCK = 512, 64, 16
PACKED, ROPE_AT, SCALES_AT, ENTRY = 256, 256, 320, 352
NUM_SCALES = NOPE // BLOCK  # 32
E2M1_MAX, E4M3_MAX, SCALE_FLOOR = 6.0, 448.0, 2.0**-9
# e2m1 codes 0..15: sign bit 3, then magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def scale_byte(s: torch.Tensor | int):
    """The byte (from SCALES_AT) that holds NoPE block s's scale: the 8x4 -> 4x8 transpose FlashMLA reads."""
    return 8 * (s & 3) + (s >> 2)


def decode_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> float32 [..., 2n]: the low nibble is the even element."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).long()
    return lut[codes].flatten(-2)


def scales(entries: torch.Tensor) -> torch.Tensor:
    """float32 [n, 32]: each NoPE block's scale, un-permuted."""
    at = SCALES_AT + scale_byte(torch.arange(NUM_SCALES, device=entries.device))
    return entries[:, at].contiguous().view(torch.float8_e4m3fn).float()


def dequantize(entries: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 352] -> float32 [n, 576]: e2m1 x its block's e4m3 scale (exact in bf16), then the RoPE values."""
    nope = decode_e2m1(entries[:, :PACKED]).unflatten(-1, (NUM_SCALES, BLOCK)) * scales(entries)[..., None]
    rope = entries[:, ROPE_AT:SCALES_AT].contiguous().view(torch.float8_e4m3fn).float()
    return torch.cat([nope.flatten(-2), rope], dim=-1)


def error_bound(values: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
    """float32 [n, 576]: how far an entry may read back from the bf16 value written. NoPE: half the e2m1 step at the
    element's magnitude in units of its scale (0.25, 0.5 or 1), plus what saturation at 6 x scale cuts off (the scale
    is e4m3 of amax / 6, rounded to nearest, so it may land under it); RoPE: half an e4m3 step (2^-4 relative) or
    its subnormal step (2^-10), plus what saturation at 448 cuts off."""
    s = scales(entries).repeat_interleave(BLOCK, dim=-1)
    x = values[:, :NOPE].float().abs()
    r = x / s
    half_step = torch.where(r < 2, 0.25, torch.where(r < 4, 0.5, 1.0)) * s
    nope = half_step + (x - E2M1_MAX * s).clamp(min=0)
    r = values[:, NOPE:].float().abs()
    rope = 2**-4 * r + 2**-10 + (r - E4M3_MAX).clamp(min=0)
    return torch.cat([nope, rope], dim=-1)
