"""Pure-torch model of DeepSeek-V4.1's 288-byte NVFP4 compressed-cache record (FlashMLA's ModelType::V41_FP4, what
V4.1's layers write under `--kv-cache-dtype nvfp4_ds_mla` for the compressed K cache only), from the format's
definition (vLLM 0.33.0's `deepseek_v41/common/ops/cache_utils.py` header and the layer's comment), independent of
vLLM's writer and readers.

A record holds one 512-wide latent (RoPE dims included) as e2m1 with one float8_e4m3fn scale per 16 values, in
natural order (no permutation, unlike V3.2's 352-byte entry). Records are interleaved, each token's scales after its
own data, so slot s lives at byte (s % entries) * 288 of page s // entries:

    [i * 288, i * 288 + 256)        record i's 512 e2m1 values, two a byte, the even element in the low nibble
    [i * 288 + 256, (i + 1) * 288)  record i's 32 e4m3 scales

Works on CPU and CUDA.
"""

from __future__ import annotations

import torch

from oracles.nvfp4_ds_mla import E2M1_MAX, decode_e2m1

DIM, BLOCK, PACKED, ENTRY = 512, 16, 256, 288
NUM_SCALES = DIM // BLOCK  # 32


def page_bytes(entries: int) -> int:
    """Whole records, padded to a multiple of 512 (the V4.1 page alignment)."""
    return -(-entries * ENTRY // 512) * 512


def scales(records: torch.Tensor) -> torch.Tensor:
    """float32 [n, 32]: each 16-wide block's e4m3 scale."""
    return records[:, PACKED:ENTRY].contiguous().view(torch.float8_e4m3fn).float()


def dequantize(records: torch.Tensor) -> torch.Tensor:
    """records uint8 [n, 288] -> float32 [n, 512]: e2m1 x its block's scale (exact in bf16)."""
    values = decode_e2m1(records[:, :PACKED]).unflatten(-1, (NUM_SCALES, BLOCK))
    return (values * scales(records)[..., None]).flatten(-2)


def read_records(pages: torch.Tensor, slots: torch.Tensor, entries: int) -> torch.Tensor:
    """uint8 [n, 288]: the records at `slots` of a raw paged cache uint8 [num_blocks, page bytes]."""
    slots = slots.to(pages.device).long()
    block, offset = slots // entries, slots % entries
    return pages[block[:, None], offset[:, None] * ENTRY + torch.arange(ENTRY, device=pages.device)]


def error_bound(values: torch.Tensor, records: torch.Tensor) -> torch.Tensor:
    """float32 [n, 512]: half the e2m1 step at the element's magnitude in units of its scale (0.25, 0.5 or 1), plus
    what saturation at 6 x scale cuts off (the scale is e4m3 of amax / 6, so it may land under it)."""
    s = scales(records).repeat_interleave(BLOCK, dim=-1)
    x = values.float().abs()
    r = x / s
    return torch.where(r < 2, 0.25, torch.where(r < 4, 0.5, 1.0)) * s + (x - E2M1_MAX * s).clamp(min=0)
