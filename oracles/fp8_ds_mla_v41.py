"""Pure-torch model of DeepSeek-V4.1's 528-byte MXFP8 record (FlashMLA's ModelType::V41, what V4.1 layers write on
SM100) and its paged layout, from the format's definition (vLLM's deepseek_v41 cache_utils header and
`_use_v41_mxfp8_kv_record` comment), independent of vLLM's writer and readers.

A record holds one 512-wide latent, all of it (RoPE included) as float8_e4m3fn, one UE8M0 exponent per 32 values
(value 2^(byte - 127)). Records are interleaved, each token's scales after its own data, so a page of `entries`
records is `entries` whole 528-byte rows and slot s lives at byte (s % entries) * 528 of page s // entries:

    [i * 528, i * 528 + 512)        record i's 512 fp8 values
    [i * 528 + 512, (i + 1) * 528)  record i's 16 scale bytes

Works on CPU and CUDA.
"""

from __future__ import annotations

import torch

DIM, BLOCK, DATA, SCALES, ENTRY = 512, 32, 512, 16, 528
NUM_BLOCKS = DIM // BLOCK  # 16
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4


def page_bytes(entries: int) -> int:
    """Whole records, padded to a multiple of 512 (the V4.1 page alignment; 32 or more records need none)."""
    return -(-entries * ENTRY // 512) * 512


def _exponents(values: torch.Tensor) -> torch.Tensor:
    """The UE8M0 exponent of each 32-wide block: the least power of two s with max(amax, 1e-4) / s <= 448, exactly."""
    amax = values.float().unflatten(-1, (NUM_BLOCKS, BLOCK)).abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    mantissa, exponent = torch.frexp(amax / FP8_MAX)
    return exponent - (mantissa == 0.5).to(exponent.dtype)


def quantize(values: torch.Tensor) -> torch.Tensor:
    """bf16 [n, 512] -> records uint8 [n, 528] (data then scales): the encoding the format defines."""
    e = _exponents(values)
    scaled = values.float().unflatten(-1, (NUM_BLOCKS, BLOCK)) / torch.exp2(e.float())[..., None]
    data = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8).flatten(-2)
    return torch.cat([data, (e + 127).clamp(0, 255).to(torch.uint8)], dim=-1)


def dequantize(records: torch.Tensor) -> torch.Tensor:
    """records uint8 [n, 528] -> float32 [n, 512]: float(fp8) * 2^(scale byte - 127), exact in bf16."""
    data = records[:, :DATA].contiguous().view(torch.float8_e4m3fn).float().unflatten(-1, (NUM_BLOCKS, BLOCK))
    scale = torch.exp2(records[:, DATA:ENTRY].float() - 127.0)
    return (data * scale[..., None]).flatten(-2)


def read_records(pages: torch.Tensor, slots: torch.Tensor, entries: int) -> torch.Tensor:
    """uint8 [n, 528]: the records at `slots` of a raw paged cache uint8 [num_blocks, page bytes]."""
    slots = slots.to(pages.device).long()
    block, offset = slots // entries, slots % entries
    return pages[block[:, None], offset[:, None] * ENTRY + torch.arange(ENTRY, device=pages.device)]


def error_bound(values: torch.Tensor, records: torch.Tensor) -> torch.Tensor:
    """float32 [n, 512]: half an e4m3 step (2^-4 relative) or its subnormal step (2^-9 of the block's scale)."""
    scale = torch.exp2(records[:, DATA:ENTRY].float() - 127.0).repeat_interleave(BLOCK, dim=-1)
    return 2**-4 * values.float().abs() + 2**-9 * scale
