"""Pure-torch model of DeepSeek-V4's plain-row KV cache, what FlashInfer's DeepSeek-V4 / V4.1 layers on SM100
(FLASHINFER_MLA_SPARSE_DSV4 / _DSV41) store instead of a quantized record: each token's 512-wide latent as one row of
its element dtype, bf16 (1024 bytes) or per-tensor float8_e4m3fn (512 bytes, k_scale 1.0). A page of `entries` rows
holds slot s at byte (s % entries) * row bytes of page s // entries; under vLLM's packed KV layout a page is longer
than its rows (the other components of the block follow them), which this reader never looks at.

Works on CPU and CUDA; the same interface as fp8_ds_mla_v4 and fp8_ds_mla_v41 (read_records, dequantize,
error_bound), one reader per row dtype (`PlainRows(bytes)`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DIM = 512
DTYPES = {1024: torch.bfloat16, 512: torch.float8_e4m3fn}


@dataclass(frozen=True)
class PlainRows:
    ENTRY: int  # bytes a row: 1024 (bf16) or 512 (e4m3)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.ENTRY]

    def read_records(self, pages: torch.Tensor, slots: torch.Tensor, entries: int) -> torch.Tensor:
        """uint8 [n, row bytes]: the rows at `slots` of a raw paged cache uint8 [num_blocks, page bytes]."""
        slots = slots.to(pages.device).long()
        block, offset = slots // entries, slots % entries
        return pages[block[:, None], offset[:, None] * self.ENTRY + torch.arange(self.ENTRY, device=pages.device)]

    def dequantize(self, records: torch.Tensor) -> torch.Tensor:
        """uint8 [n, row bytes] -> float32 [n, 512]: the row's values (per-tensor fp8 at k_scale 1.0)."""
        return records.contiguous().view(self.dtype).float()

    def error_bound(self, values: torch.Tensor, records: torch.Tensor) -> torch.Tensor:
        """float32 [n, 512]: 0 for a bf16 row (the value itself); for e4m3 half a step (2^-4 relative) or half its
        subnormal step (2^-10), of values within +-448."""
        if self.dtype == torch.bfloat16:
            return torch.zeros(values.shape, dtype=torch.float32, device=values.device)
        return values.float().abs() * 2.0**-4 + 2.0**-10
