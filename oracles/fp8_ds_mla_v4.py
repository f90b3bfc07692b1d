"""Pure-torch model of DeepSeek-V4's 584-byte fp8_ds_mla record and its paged layout, from the format's definition
(FlashMLA's interface docstring, vLLM's cache_utils kernel comments), independent of vLLM's writer and readers.

A record holds one 512-wide latent: a 576-byte data row (448 float8_e4m3fn NoPE values, then 64 bfloat16 RoPE
values) and an 8-byte scale row (7 UE8M0 exponents, one per 64 NoPE values, value 2^(byte - 127); one pad byte).
A page of `entries` records stores every data row first, then every scale row, padded to a multiple of 576:

    [0, entries * 576)                      data rows, record i at i * 576
    [entries * 576, entries * 584)          scale rows, record i at entries * 576 + i * 8

Slot s lives in page s // entries, as record s % entries. Works on CPU and CUDA.
"""

from __future__ import annotations

import torch

NOPE, ROPE, BLOCK = 448, 64, 64
DATA, SCALES, ENTRY = 576, 8, 584
NUM_BLOCKS = NOPE // BLOCK  # 7
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4


def page_bytes(entries: int) -> int:
    return -(-entries * ENTRY // DATA) * DATA


def _exponents(values: torch.Tensor) -> torch.Tensor:
    """The UE8M0 exponent of each 64-wide NoPE block: the least power of two s with max(amax, 1e-4) / s <= 448,
    exactly (from the float's exponent bits, no log2 rounding)."""
    amax = values[..., :NOPE].float().unflatten(-1, (NUM_BLOCKS, BLOCK)).abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    mantissa, exponent = torch.frexp(amax / FP8_MAX)
    return exponent - (mantissa == 0.5).to(exponent.dtype)


def quantize(values: torch.Tensor) -> torch.Tensor:
    """bf16 [n, 512] -> records uint8 [n, 584] (data row then scale row): the encoding the format defines."""
    e = _exponents(values)
    scaled = values[:, :NOPE].float().unflatten(-1, (NUM_BLOCKS, BLOCK)) / torch.exp2(e.float())[..., None]
    nope = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8).flatten(-2)
    rope = values[:, NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)
    scales = torch.zeros(len(values), SCALES, dtype=torch.uint8, device=values.device)
    scales[:, :NUM_BLOCKS] = (e + 127).to(torch.uint8)
    return torch.cat([nope, rope, scales], dim=-1)


def dequantize(records: torch.Tensor) -> torch.Tensor:
    """records uint8 [n, 584] -> float32 [n, 512]: NoPE = float(fp8) * 2^(scale byte - 127), RoPE as stored. Exact
    in bf16 (3 mantissa bits times a power of two), as the kernels dequantize it."""
    nope = records[:, :NOPE].contiguous().view(torch.float8_e4m3fn).float().unflatten(-1, (NUM_BLOCKS, BLOCK))
    scale = torch.exp2(records[:, DATA:DATA + NUM_BLOCKS].float() - 127.0)
    rope = records[:, NOPE:DATA].contiguous().view(torch.bfloat16).float()
    return torch.cat([(nope * scale[..., None]).flatten(-2), rope], dim=-1)


def read_records(pages: torch.Tensor, slots: torch.Tensor, entries: int) -> torch.Tensor:
    """uint8 [n, 584]: the records at `slots` of a raw paged cache uint8 [num_blocks, page bytes]."""
    slots = slots.to(pages.device).long()
    block, offset = slots // entries, slots % entries
    data = pages[block[:, None], offset[:, None] * DATA + torch.arange(DATA, device=pages.device)]
    scales = pages[block[:, None], entries * DATA + offset[:, None] * SCALES + torch.arange(SCALES, device=pages.device)]
    return torch.cat([data, scales], dim=-1)


def error_bound(values: torch.Tensor, records: torch.Tensor) -> torch.Tensor:
    """float32 [n, 512]: how far a record's value may lie from the bf16 value written: half an e4m3 step (2^-4
    relative) or its subnormal step (2^-9 of the block's scale) for NoPE; nothing for the bf16 RoPE."""
    scale = torch.exp2(records[:, DATA:DATA + NUM_BLOCKS].float() - 127.0).repeat_interleave(BLOCK, dim=-1)
    nope = 2**-4 * values[:, :NOPE].float().abs() + 2**-9 * scale
    return torch.cat([nope, torch.zeros_like(values[:, NOPE:], dtype=torch.float32)], dim=-1)
