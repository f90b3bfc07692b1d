"""Stand-ins for vLLM's compiled KV-cache ops (`torch.ops._C_cache_ops.*`, in `_C_stable_libtorch`)."""

from __future__ import annotations

import torch

from fuzzer.interp.sanitizer import SANITIZER, MemoryViolation


def _violation(op: str, argument: str, index: int, limit: int, elem_bytes: int, access: str = "store") -> None:
    SANITIZER.violations.append(MemoryViolation(
        kernel=f"{op} (attnfuzz stand-in)", op=access, argument=argument, byte_offset=index * elem_bytes,
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


# vLLM's csrc get_fp8_kv_cache_data_type: these names dispatch the gather's flat e4m3 dequantization. Note
# "fp8_ds_mla" is among them: the op reads a 656-byte entry's first 576 bytes as e4m3 with one global scale
# (the misuse behind vLLM issue 48611, bug 2); only cp_gather_and_upconvert_fp8_kv_cache reads that layout.
_FLAT_FP8 = ("fp8", "fp8_e4m3", "fp8_ds_mla")
_UNQUANTIZED = ("auto", "bfloat16", "float16")


def gather_and_maybe_dequant_cache(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
                                   cu_seq_lens: torch.Tensor, token_to_seq: torch.Tensor, num_tokens: int,
                                   kv_cache_dtype: str, scale: torch.Tensor,
                                   seq_starts: torch.Tensor | None = None) -> None:
    """`ops.gather_and_maybe_dequant_cache` (csrc/cache_kernels.cu): output token t of request b = token_to_seq[t]
    is position t - cu_seq_lens[b] (+ seq_starts[b]) of that request, read through block_table[b] as dst.size(-1)
    elements of the cache's element type from the entry's start; quantized dtypes convert each byte as e4m3
    times `*scale`. A token past its request's end stops the CUDA block (nothing written), as in the kernel."""
    op = "gather_and_maybe_dequant_cache"
    head_dim = dst.shape[-1]
    if head_dim not in (320, 576):
        raise RuntimeError(f"{op} only support the head_dim to 320 or 576 for better performance")
    if kv_cache_dtype not in _FLAT_FP8 + _UNQUANTIZED:
        raise RuntimeError(f"Unsupported fp8 kv cache data type: {kv_cache_dtype}")
    for name, t in (("block_table", block_table), ("cu_seq_lens", cu_seq_lens)) + (
            (("seq_starts", seq_starts),) if seq_starts is not None else ()):
        if t.dtype != torch.int32:
            raise RuntimeError(f"{name} must be int32")
    num_blocks, block_size = src_cache.shape[:2]
    quantized = kv_cache_dtype in _FLAT_FP8
    entry_elems = src_cache.shape[2:].numel()
    if head_dim > entry_elems:  # the kernel reads head_dim elements of each entry, whatever the entry holds
        _violation(op, "src_cache", head_dim, entry_elems, src_cache.element_size(), access="load")
    tts, cu = token_to_seq.long().cpu(), cu_seq_lens.long().cpu()
    starts = seq_starts.long().cpu() if seq_starts is not None else None
    table = block_table.long().cpu()
    flat_table = table.reshape(-1) if table.is_contiguous() else table.contiguous().reshape(-1)
    for t in range(num_tokens):
        if t >= tts.numel():
            return _violation(op, "token_to_seq", t, tts.numel(), 4, access="load")
        b = int(tts[t])
        if not 0 <= b < cu.numel() - 1:
            return _violation(op, "cu_seq_lens", b + 1, cu.numel(), 4, access="load")
        if t >= int(cu[b + 1]):
            return  # `if (token_id >= batch_end) return;`
        pos = t - int(cu[b]) + (int(starts[b]) if starts is not None else 0)
        at = b * block_table.stride(0) + pos // block_size
        if not 0 <= at < flat_table.numel() or pos < 0:
            _violation(op, "block_table", at, flat_table.numel(), 4, access="load")
            continue
        block = int(flat_table[at])
        if not 0 <= block < num_blocks:
            _violation(op, "src_cache", block * block_size + pos % block_size, num_blocks * block_size,
                       entry_elems * src_cache.element_size(), access="load")
            continue
        if t >= dst.shape[0]:
            _violation(op, "dst", t, dst.shape[0], head_dim * dst.element_size())
            continue
        raw = src_cache[block, pos % block_size].reshape(-1)[:head_dim]
        if quantized:
            value = raw.view(torch.uint8).view(torch.float8_e4m3fn).float() * scale.float().reshape(-1)[0]
        else:
            value = raw
        dst[t] = value.to(dst.dtype)
