"""Pure-torch model of vLLM's ``fp8_ds_mla`` KV-cache entry (DeepSeek V3.2 geometry).

vLLM ships no torch quantize/dequantize for this format (only the CUDA writer
``concat_and_cache_mla``, the Triton writer in ``fused_norm_rope`` and the CUDA
reader ``cp_gather_and_upconvert_fp8_kv_cache``), so the oracle needs its own.
One 656-byte entry per token:

    bytes [0, 512)    512 float8_e4m3fn NoPE values, four 128-element tiles
    bytes [512, 528)  four float32 tile scales (tile i covers NoPE [128 i, 128 i + 128))
    bytes [528, 656)  64 bfloat16 RoPE values, unquantized

Dequantization is NoPE = float(fp8) * tile scale, RoPE copied. Writers and readers
disagree about the scale convention (bug class K), hence ``SCALE_CONVENTIONS``.
Works for any leading shape, on CPU and CUDA, and is deterministic.
"""

import torch

ENTRY_BYTES = 656
NOPE_DIM = 512
ROPE_DIM = 64
TILE = 128
NUM_TILES = NOPE_DIM // TILE
FP8_MAX = 448.0
SCALE_OFFSET = NOPE_DIM  # byte 512: four float32 scales
ROPE_OFFSET = NOPE_DIM + 4 * NUM_TILES  # byte 528: 64 bf16 RoPE values
FLT_MIN = torch.finfo(torch.float32).tiny  # 2**-126
POW2_SCALE_FLOOR = 1e-4  # the Triton writer's floor; rounds up to 2**-13

# "arbitrary":  scale = max(amax/448, FLT_MIN) stored unrounded (older CUDA concat_and_cache_mla).
# "pow2":       scale = max(amax/448, 1e-4) rounded up to a power of two (Triton writer in
#               fused_norm_rope, newer CUDA writer): amax 336 -> 1.0, zero tile -> 2**-13.
# "e8m0_trunc": a *reader* convention: SM100 FlashMLA decode keeps only the exponent of the
#               stored fp32 scale (mantissa truncated), e.g. a stored 0.75 is read as 0.5.
SCALE_CONVENTIONS = ("arbitrary", "pow2", "e8m0_trunc")
WRITER_CONVENTIONS = ("arbitrary", "pow2")
READERS = ("as_stored", "e8m0_trunc")


def _ceil_pow2(s: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= s (s > 0, fp32), i.e. exact 2**ceil(log2(s)).

    Done on the exponent bits, not with a float log2, which for s just above a
    power of two can round to the power itself and leave amax/s above 448.
    """
    mantissa, exponent = torch.frexp(s)  # s = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    return torch.ldexp(torch.ones_like(s), exponent)


def tile_scales(kv_c: torch.Tensor, convention: str = "arbitrary") -> torch.Tensor:
    """float32 [..., 4] tile scales a writer with `convention` stores for kv_c [..., 512]."""
    if convention not in WRITER_CONVENTIONS:
        raise ValueError(
            f"writer convention must be one of {WRITER_CONVENTIONS}, got {convention!r} "
            "(e8m0_trunc is a reader convention: see read_scales / dequantize(reader=...))"
        )
    amax = kv_c.float().unflatten(-1, (NUM_TILES, TILE)).abs().amax(dim=-1)
    s = amax / FP8_MAX
    if convention == "arbitrary":
        return torch.clamp(s, min=FLT_MIN)
    return _ceil_pow2(torch.clamp(s, min=POW2_SCALE_FLOOR))


def read_scales(stored: torch.Tensor, convention: str = "as_stored") -> torch.Tensor:
    """The scales a reader actually multiplies by, given the stored float32 scales.

    "as_stored" (SM90 FlashMLA, cp_gather_and_upconvert; "arbitrary" and "pow2" are
    accepted as aliases) returns them unchanged; "e8m0_trunc" (SM100 FlashMLA decode)
    keeps only the fp32 exponent, i.e. 2**floor(log2(s)), by masking the mantissa bits.
    """
    stored = stored.to(torch.float32)
    if convention in ("as_stored", "arbitrary", "pow2"):
        return stored
    if convention == "e8m0_trunc":
        return (stored.view(torch.int32) & 0x7F800000).view(torch.float32)
    raise ValueError(f"unknown scale reader {convention!r}")


def quantize(kv_c: torch.Tensor, k_pe: torch.Tensor, convention: str = "arbitrary") -> torch.Tensor:
    """Write entries as vLLM's writers do: kv_c [..., 512], k_pe [..., 64] -> uint8 [..., 656].

    NoPE / tile scale is cast to float8_e4m3fn (round to nearest even, saturating at
    +-448 like the CUDA writer's clamp / Triton's satfinite cast); RoPE is stored as bf16.
    """
    assert kv_c.shape[-1] == NOPE_DIM and k_pe.shape[-1] == ROPE_DIM, (kv_c.shape, k_pe.shape)
    assert kv_c.shape[:-1] == k_pe.shape[:-1], (kv_c.shape, k_pe.shape)
    scales = tile_scales(kv_c, convention)
    x = kv_c.float().unflatten(-1, (NUM_TILES, TILE)) / scales.unsqueeze(-1)
    nope = x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).flatten(-2).view(torch.uint8)
    scale_bytes = scales.contiguous().view(torch.uint8)
    rope_bytes = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)
    return torch.cat([nope, scale_bytes, rope_bytes], dim=-1)


def split_entry(entries: torch.Tensor):
    """uint8 [..., 656] -> (nope_fp8 uint8 [..., 512], scales float32 [..., 4], rope bf16 [..., 64])."""
    assert entries.dtype == torch.uint8 and entries.shape[-1] == ENTRY_BYTES, (entries.dtype, entries.shape)
    nope = entries[..., :SCALE_OFFSET]
    scales = entries[..., SCALE_OFFSET:ROPE_OFFSET].contiguous().view(torch.float32)
    rope = entries[..., ROPE_OFFSET:].contiguous().view(torch.bfloat16)
    return nope, scales, rope


def dequantize(entries: torch.Tensor, reader: str = "as_stored") -> torch.Tensor:
    """uint8 [..., 656] -> float32 [..., 576]: NoPE = float(fp8) * tile scale (as `reader`
    sees it), RoPE copied. vLLM's upconvert then rounds to bf16; callers comparing its
    output bit-for-bit should apply `.to(torch.bfloat16)` themselves."""
    nope, scales, rope = split_entry(entries)
    values = nope.contiguous().view(torch.float8_e4m3fn).float().unflatten(-1, (NUM_TILES, TILE))
    values = (values * read_scales(scales, reader).unsqueeze(-1)).flatten(-2)
    return torch.cat([values, rope.float()], dim=-1)


def dequantize_flat_fp8(entries: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """The WRONG reading of a layout-unaware gather (bug class E): bytes [0, 576) read
    as flat fp8 times one global scale, so tile scales are ignored and the scale bytes
    plus half the RoPE bytes are decoded as fp8 (may contain NaN). -> float32 [..., 576]."""
    assert entries.dtype == torch.uint8 and entries.shape[-1] == ENTRY_BYTES, (entries.dtype, entries.shape)
    flat = entries[..., : NOPE_DIM + ROPE_DIM].contiguous().view(torch.float8_e4m3fn)
    return flat.float() * scale
