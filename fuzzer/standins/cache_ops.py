"""Stand-ins for vLLM's compiled KV-cache ops (`torch.ops._C_cache_ops.*`, in `_C_stable_libtorch`)."""

from __future__ import annotations

import torch

from fuzzer.interp.sanitizer import SANITIZER, MemoryViolation


def _violation(op: str, argument: str, index: int, limit: int, elem_bytes: int) -> None:
    SANITIZER.violations.append(MemoryViolation(
        kernel=f"{op} (attnfuzz stand-in)", op="store", argument=argument, byte_offset=index * elem_bytes,
        argument_bytes=limit * elem_bytes, element_bytes=elem_bytes, program_id=(0, 0, 0), lanes=1,
        inside_allocation=False))


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, kv_cache_dtype: str, scale: torch.Tensor) -> None:
    """`ops.concat_and_cache_mla`: token i's (kv_c | k_pe) goes to cache[slot // block_size, slot % block_size].

    A negative slot is a padding token and is skipped, as in the CUDA kernel. Unquantized caches only
    ("auto"/"bfloat16"/"float16"): the quantized layouts come with the FlashMLA target.
    """
    if kv_cache_dtype not in ("auto", "bfloat16", "float16"):
        raise ValueError(f"attnfuzz's concat_and_cache_mla stand-in does not write kv_cache_dtype={kv_cache_dtype!r}")
    num_blocks, block_size = kv_cache.shape[:2]
    entry = torch.cat([kv_c, k_pe], dim=-1).to(kv_cache.dtype)
    slots = slot_mapping.long()
    capacity = num_blocks * block_size
    for slot in slots[slots >= capacity].tolist()[:8]:  # each one an out-of-bounds write in the real op
        _violation("concat_and_cache_mla", "kv_cache", slot, capacity, kv_cache.shape[-1] * kv_cache.element_size())
    keep = (slots >= 0) & (slots < capacity)
    kv_cache[slots[keep] // block_size, slots[keep] % block_size] = entry[keep]
