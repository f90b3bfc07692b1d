"""Stand-ins for vLLM's compiled KV-cache ops (`torch.ops._C_cache_ops.*`, in `_C_stable_libtorch`)."""

from __future__ import annotations

import torch

from fuzzer.support.errors import EmptyLaunch
from fuzzer.support.interp.sanitizer import VIOLATIONS, MemoryViolation


def _violation(op: str, argument: str, index: int, limit: int, elem_bytes: int, access: str = "store") -> None:
    VIOLATIONS.violations.append(MemoryViolation(
        kernel=f"{op} (attnfuzz stand-in)", op=access, argument=argument, byte_offset=index * elem_bytes,
        argument_bytes=limit * elem_bytes, element_bytes=elem_bytes, program_id=(0, 0, 0), lanes=1,
        inside_allocation=False))


def refuse_empty_grid(op: str, num_tokens: int) -> None:
    """The CUDA op launches one block per token with no launch check, so 0 tokens is a failed launch that surfaces
    as "CUDA error: invalid argument" wherever the next launch is (bench/cache_ops_check.py's 0-token rows)."""
    if num_tokens == 0:
        raise EmptyLaunch(f"CUDA error: invalid argument (attnfuzz stand-in of {op}: called with 0 tokens; the real "
                          "op's empty grid fails to launch and the next kernel launch raises this error)")


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, kv_cache_dtype: str, scale: torch.Tensor,
                         skip_scale: bool = False) -> None:
    """`ops.concat_and_cache_mla`: token i's (kv_c | k_pe) goes to cache[slot // block_size, slot % block_size].

    A negative slot is a padding token and is skipped, as in the CUDA kernel. Unquantized caches
    ("auto"/"bfloat16"/"float16") and the per-tensor fp8 one ("fp8"/"fp8_e4m3", a uint8 cache): each element of
    both parts as the kernel's `fp8::scaled_convert` makes it, e4m3(float(x) / *scale) rounded to nearest even and
    saturated to +-448 (`__NV_SATFINITE`); `skip_scale` (vLLM passes it when the scale is 1.0) divides by nothing.
    The fp8_ds_mla layout comes with the FlashMLA target (`flashmla_ops.concat_and_cache_mla`).
    """
    if kv_cache_dtype not in ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3"):
        raise ValueError(f"attnfuzz's concat_and_cache_mla stand-in does not write kv_cache_dtype={kv_cache_dtype!r}")
    refuse_empty_grid("concat_and_cache_mla", slot_mapping.shape[0])
    num_blocks, block_size = kv_cache.shape[:2]
    if kv_cache_dtype.startswith("fp8"):
        x = torch.cat([kv_c, k_pe], dim=-1).float()
        if not skip_scale:
            x = x / scale.float().reshape(-1)[0].to(x.device)
        entry = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).view(kv_cache.dtype)
    else:
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
    # Tokens up to the first that stops the kernel: past token_to_seq, a request id outside cu_seq_lens, or past
    # its request's end (`if (token_id >= batch_end) return;`): nothing is written from there on.
    t = torch.arange(min(num_tokens, tts.numel()))
    b = tts[: len(t)]
    stop = (b < 0) | (b >= cu.numel() - 1)
    stop |= t >= cu[(b + 1).clamp(0, cu.numel() - 1)]
    end = int(stop.nonzero()[0]) if stop.any() else len(t)
    t, b = t[:end], b[:end]
    pos = t - cu[b] + (starts[b] if starts is not None else 0)
    at = b * block_table.stride(0) + torch.div(pos, block_size, rounding_mode="floor")
    bad_at = (at < 0) | (at >= flat_table.numel()) | (pos < 0)
    block = torch.where(bad_at, 0, flat_table[at.clamp(0, max(flat_table.numel() - 1, 0))])
    bad_block = ~bad_at & ((block < 0) | (block >= num_blocks))
    bad_dst = ~bad_at & ~bad_block & (t >= dst.shape[0])
    for i in (bad_at | bad_block | bad_dst).nonzero().flatten().tolist():  # each a fault of the real op, in order
        if bad_at[i]:
            _violation(op, "block_table", int(at[i]), flat_table.numel(), 4, access="load")
        elif bad_block[i]:
            _violation(op, "src_cache", int(block[i]) * block_size + int(pos[i]) % block_size, num_blocks * block_size,
                       entry_elems * src_cache.element_size(), access="load")
        else:
            _violation(op, "dst", int(t[i]), dst.shape[0], head_dim * dst.element_size())
    ok = ~(bad_at | bad_block | bad_dst)
    if ok.any():  # each entry's first head_dim elements, whatever the entry holds
        raw = src_cache[block[ok].to(src_cache.device), (pos[ok] % block_size).to(src_cache.device)]
        raw = raw.reshape(int(ok.sum()), -1)[:, :head_dim]
        if quantized:
            value = raw.view(torch.uint8).view(torch.float8_e4m3fn).float() * scale.float().reshape(-1)[0]
        else:
            value = raw
        dst[t[ok].to(dst.device)] = value.to(dst.dtype)
    if end < min(num_tokens, tts.numel()):
        b_stop = int(tts[end])
        if not 0 <= b_stop < cu.numel() - 1:
            _violation(op, "cu_seq_lens", b_stop + 1, cu.numel(), 4, access="load")
    elif num_tokens > tts.numel():
        _violation(op, "token_to_seq", tts.numel(), tts.numel(), 4, access="load")



def cp_gather_cache(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor, cu_seq_lens: torch.Tensor,
                    batch_size: int, seq_starts: torch.Tensor | None = None) -> None:
    """`ops.cp_gather_cache` (csrc/cache_kernels.cu, the unquantized context gather; DCP's on a bf16 cache): request
    b's rows cu_seq_lens[b] .. cu_seq_lens[b + 1] of dst are its positions (+ seq_starts[b]) read through
    block_table[b] (its row stride), each a whole entry of the cache's element type, copied as is. A request whose
    cu_seq_lens go backwards copies nothing (its splits are inactive); nothing checks dst's rows or the table's
    width (each a fault of the real op here)."""
    op = "cp_gather_cache"
    for name, t in (("block_table", block_table), ("cu_seq_lens", cu_seq_lens)) + (
            (("seq_starts", seq_starts),) if seq_starts is not None else ()):
        if t.dtype != torch.int32:
            raise RuntimeError(f"{name} must be int32")
    if src_cache.dtype != dst.dtype:
        raise RuntimeError("src_cache and dst must have the same dtype")
    num_blocks, block_size = src_cache.shape[:2]
    entry_elems = src_cache.shape[2:].numel()
    cu = cu_seq_lens.long().cpu()
    if batch_size + 1 > cu.numel():  # the grid has batch_size blocks in x: each reads cu_seq_lens[b + 1]
        _violation(op, "cu_seq_lens", cu.numel(), cu.numel(), 4, access="load")
        batch_size = cu.numel() - 1
    starts = seq_starts.long().cpu() if seq_starts is not None else torch.zeros(batch_size, dtype=torch.long)
    flat_table = block_table.reshape(-1).long().cpu() if block_table.is_contiguous() else \
        block_table.contiguous().reshape(-1).long().cpu()
    dst_rows = dst.reshape(dst.shape[0], -1)
    for b in range(batch_size):
        first, n = int(cu[b]), int(cu[b + 1] - cu[b])
        if n <= 0:
            continue
        pos = torch.arange(n) + int(starts[b])
        at = b * block_table.stride(0) + torch.div(pos, block_size, rounding_mode="floor")
        bad_at = (at < 0) | (at >= flat_table.numel())
        block = torch.where(bad_at, 0, flat_table[at.clamp(0, max(flat_table.numel() - 1, 0))])
        bad_block = ~bad_at & ((block < 0) | (block >= num_blocks))
        rows = first + torch.arange(n)
        bad_dst = ~bad_at & ~bad_block & ((rows < 0) | (rows >= dst.shape[0]))
        for i in (bad_at | bad_block | bad_dst).nonzero().flatten().tolist()[:4]:
            if bad_at[i]:
                _violation(op, "block_table", int(at[i]), flat_table.numel(), 4, access="load")
            elif bad_block[i]:
                _violation(op, "src_cache", int(block[i]) * block_size + int(pos[i]) % block_size,
                           num_blocks * block_size, entry_elems * src_cache.element_size(), access="load")
            else:
                _violation(op, "dst", int(rows[i]), dst.shape[0], entry_elems * dst.element_size())
        ok = ~(bad_at | bad_block | bad_dst)
        if ok.any():
            entries = src_cache[block[ok].to(src_cache.device), (pos[ok] % block_size).to(src_cache.device)]
            dst_rows[rows[ok].to(dst.device)] = entries.reshape(int(ok.sum()), -1)
