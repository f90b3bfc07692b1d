"""Torch stand-ins for the compiled ops FlashMLA-sparse calls (`vllm._flashmla_C`, `_C_cache_ops`).

Semantics follow FlashMLA's interface docstrings (vllm/third_party/flashmla/flash_mla_interface.py) and its
reference (deepseek-ai/FlashMLA tests/ref.py): natural-log LSE; a row with nothing to attend to gives
out 0 and LSE +inf. Where the real kernel would read or write outside a tensor, the stand-in records a
MemoryViolation (as the interpreter sanitizer does) and skips that entry instead of reading garbage.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from fuzzer.support.errors import StandInRefused
from fuzzer.support.interp.sanitizer import VIOLATIONS, MemoryViolation
from fuzzer.support.standins.cache_ops import concat_and_cache_mla as plain_concat_and_cache_mla
from fuzzer.support.standins.cache_ops import refuse_empty_grid

# fp8_ds_mla entry: 512 fp8 NoPE | 4 fp32 tile scales | 64 bf16 RoPE = 656 bytes
NOPE, TILE, SCALES_AT, ROPE_AT, ENTRY_BYTES, FP8_MAX = 512, 128, 512, 528, 656, 448.0
# DeepSeek-V4 record: a 576-byte data row (448 fp8 NoPE, 64 bf16 RoPE) and an 8-byte scale row (7 UE8M0 + pad)
V4_NOPE, V4_BLOCK, V4_DATA, V4_SCALES, V4_ENTRY_BYTES = 448, 64, 576, 8, 584
# DeepSeek-V4.1 record (SM100's ModelType::V41): 512 fp8 values, then their 16 UE8M0 scales (one per 32), interleaved
V41_DIM, V41_BLOCK, V41_ENTRY_BYTES = 512, 32, 528
# DeepSeek-V4.1's NVFP4 compressed record (ModelType::V41_FP4, nvfp4_ds_mla): 256 bytes of e2m1 pairs (even element in
# the low nibble), then 32 e4m3 scales of 16 values each; only the mega-attention kernel reads it
V41_NVFP4_PACKED, V41_NVFP4_BLOCK, V41_NVFP4_ENTRY_BYTES = 256, 16, 288
# DeepSeek-V3.2's nvfp4_ds_mla entry (SM100): 512 e2m1 NoPE (256 bytes) | 64 e4m3 RoPE, unscaled | 32 e4m3 NoPE scales
# of 16 values each, permuted (block s's at byte 320 + 8 * (s & 3) + (s >> 2)) = 352 bytes
NVFP4_PACKED, NVFP4_ROPE_AT, NVFP4_SCALES_AT, NVFP4_BLOCK, NVFP4_ENTRY_BYTES = 256, 256, 320, 16, 352
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _violation(op: str, argument: str, access: str, index: int, limit: int, elem_bytes: int) -> None:
    VIOLATIONS.violations.append(MemoryViolation(
        kernel=f"{op} (attnfuzz stand-in)", op=access, argument=argument, byte_offset=index * elem_bytes,
        argument_bytes=limit * elem_bytes, element_bytes=elem_bytes, program_id=(0, 0, 0), lanes=1,
        inside_allocation=False))


def _report(op: str, argument: str, bad: torch.Tensor, values: torch.Tensor, limit: int, elem_bytes: int) -> None:
    for v in values[bad].tolist()[:8]:  # the first few name the bug
        _violation(op, argument, "load", int(v), limit, elem_bytes)


def _sparse_attention(q: torch.Tensor, gathered: torch.Tensor, invalid: torch.Tensor, sm_scale: float, d_v: int):
    """q [T, H, D], gathered [T, K, D] (fp32), invalid [T, K] -> out [T, H, d_v] fp32, max_logits, lse [T, H]."""
    gathered = gathered.masked_fill(invalid[..., None], 0.0)  # masked rows may hold the cache's NaN poison
    logits = torch.einsum("thd,tkd->thk", q.float(), gathered) * sm_scale
    logits.masked_fill_(invalid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    max_logits = logits.amax(dim=-1) if logits.shape[-1] else lse.clone()
    empty = lse == float("-inf")
    p = torch.exp(logits - torch.where(empty, float("inf"), lse)[..., None])  # empty row: all weights 0
    out = torch.einsum("thk,tkd->thd", p, gathered[..., :d_v])
    return out, max_logits, lse.masked_fill(empty, float("inf"))


def _topk_length_mask(op: str, topk_length, shape, device) -> torch.Tensor:
    """True past each row's topk_length (the kernel does not look there)."""
    if topk_length is None:
        return torch.zeros(shape, dtype=torch.bool, device=device)
    k = shape[-1]
    lengths = topk_length.reshape(-1).long()
    _report(op, "indices", lengths > k, lengths, k, 4)  # the kernel would read indices past the row
    return torch.arange(k, device=device) >= lengths.view(*shape[:-1], 1)


def flash_mla_sparse_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
                         attn_sink: Optional[torch.Tensor] = None, topk_length: Optional[torch.Tensor] = None,
                         out: Optional[torch.Tensor] = None):
    """`sparse_prefill_fwd`: q [s_q, h_q, d_qk] bf16, kv [s_kv, 1, d_qk] bf16, indices [s_q, 1, topk] int32.
    Indices < 0 or >= s_kv are invalid by contract (masked, not a fault). Returns (out, max_logits, lse)."""
    assert kv.shape[1] == 1 and indices.shape[1] == 1 and d_v == 512, "h_kv must be 1, d_v 512"
    s_kv = kv.shape[0]
    idx = indices[:, 0, :].long()
    invalid = (idx < 0) | (idx >= s_kv) | _topk_length_mask("flash_mla_sparse_fwd", topk_length, idx.shape, idx.device)
    gathered = kv[:, 0][idx.masked_fill(invalid, 0)].float()
    o, max_logits, lse = _sparse_attention(q, gathered, invalid, sm_scale, d_v)
    if attn_sink is not None:
        o = o * torch.sigmoid(lse - attn_sink.float()[None]).nan_to_num(0.0)[..., None]
    if out is None:
        out = torch.empty(q.shape[0], q.shape[1], d_v, dtype=q.dtype, device=q.device)
    out.copy_(o)
    return out, max_logits, lse


@dataclasses.dataclass
class FlashMLASchedMeta:
    """The real one's shape-consistency contract: initialised on first use, reusable only with the same shapes."""

    have_initialized: bool = False
    config: Optional[tuple] = None
    tile_scheduler_metadata: Optional[torch.Tensor] = None
    num_splits: Optional[torch.Tensor] = None


def get_mla_metadata(*args, **kwargs):
    return FlashMLASchedMeta(), None


def dequantize_fp8_ds_mla(entries: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 656] -> bf16 [..., 576]: NoPE = fp8 x its tile's fp32 scale (rounded to bf16), RoPE copied."""
    e = entries.reshape(-1, ENTRY_BYTES).contiguous()
    nope = e[:, :NOPE].view(torch.float8_e4m3fn).float().view(-1, NOPE // TILE, TILE)
    scales = e[:, SCALES_AT:ROPE_AT].view(torch.float32)
    rope = e[:, ROPE_AT:].view(torch.bfloat16)
    out = torch.cat([(nope * scales[..., None]).reshape(-1, NOPE).to(torch.bfloat16), rope], dim=-1)
    return out.view(*entries.shape[:-1], NOPE + rope.shape[-1])


def _v4_records(k_cache: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """fp32 [n, 512] of the DeepSeek-V4 records (584 bytes a token) at `idx` (valid, page * page_size + offset) of
    k_cache [pages, page_size, 1, 584], whose page block holds page_size data rows (448 fp8 NoPE, 64 bf16 RoPE)
    and then page_size scale rows (7 UE8M0 exponents, one pad byte); k_cache.stride(0) is the page's bytes."""
    pages, page_size = k_cache.shape[:2]
    page = torch.as_strided(k_cache, (pages, k_cache.stride(0)), (k_cache.stride(0), 1))
    block, offset = idx // page_size, idx % page_size
    data = page[block[:, None], offset[:, None] * V4_DATA + torch.arange(V4_DATA, device=idx.device)]
    scale_at = page_size * V4_DATA + offset[:, None] * V4_SCALES + torch.arange(V4_NOPE // V4_BLOCK, device=idx.device)
    exponent = page[block[:, None], scale_at].float() - 127.0
    nope = data[:, :V4_NOPE].contiguous().view(torch.float8_e4m3fn).float().view(-1, V4_NOPE // V4_BLOCK, V4_BLOCK)
    nope = (nope * torch.exp2(exponent)[..., None]).reshape(-1, V4_NOPE)
    return torch.cat([nope, data[:, V4_NOPE:].contiguous().view(torch.bfloat16).float()], dim=-1)


def _v41_records(k_cache: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """fp32 [n, 512] of the DeepSeek-V4.1 records (528 bytes a token) at `idx` (valid, page * page_size + offset) of
    k_cache [pages, page_size, 1, 528]: record i of a page at byte i * 528, its 512 fp8 values then 16 scales."""
    pages, page_size = k_cache.shape[:2]
    page = torch.as_strided(k_cache, (pages, k_cache.stride(0)), (k_cache.stride(0), 1))
    block, offset = idx // page_size, idx % page_size
    rec = page[block[:, None], offset[:, None] * V41_ENTRY_BYTES + torch.arange(V41_ENTRY_BYTES, device=idx.device)]
    data = rec[:, :V41_DIM].contiguous().view(torch.float8_e4m3fn).float().view(-1, V41_DIM // V41_BLOCK, V41_BLOCK)
    return (data * torch.exp2(rec[:, V41_DIM:].float() - 127.0)[..., None]).reshape(-1, V41_DIM)


def _e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [n, b] -> float32 [n, 2b]: two e2m1 values a byte, the even element in the low nibble."""
    lut = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    return lut[torch.stack([packed & 0xF, packed >> 4], dim=-1).long()].flatten(-2)


def _v41_nvfp4_records(k_cache: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """fp32 [n, 512] of V4.1's NVFP4 records (288 bytes a token) at `idx` (valid) of k_cache [pages, page_size, 1,
    288]: record i of a page at byte i * 288, its 512 e2m1 values then 32 e4m3 scales, e2m1 x scale."""
    pages, page_size = k_cache.shape[:2]
    page = torch.as_strided(k_cache, (pages, k_cache.stride(0)), (k_cache.stride(0), 1))
    block, offset = idx // page_size, idx % page_size
    rec = page[block[:, None], offset[:, None] * V41_NVFP4_ENTRY_BYTES
               + torch.arange(V41_NVFP4_ENTRY_BYTES, device=idx.device)]
    scale = rec[:, V41_NVFP4_PACKED:].contiguous().view(torch.float8_e4m3fn).float()
    values = _e2m1(rec[:, :V41_NVFP4_PACKED]).view(-1, V41_DIM // V41_NVFP4_BLOCK, V41_NVFP4_BLOCK)
    return (values * scale[..., None]).reshape(-1, V41_DIM)


def _nvfp4_scale_bytes(device) -> torch.Tensor:
    s = torch.arange(NOPE // NVFP4_BLOCK, device=device)
    return NVFP4_SCALES_AT + 8 * (s & 3) + (s >> 2)


def dequantize_nvfp4_ds_mla(entries: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 352] -> bf16 [..., 576]: each e2m1 NoPE value x its block's e4m3 scale (exact in bf16), then the
    e4m3 RoPE values."""
    e = entries.reshape(-1, NVFP4_ENTRY_BYTES)
    scale = e[:, _nvfp4_scale_bytes(e.device)].contiguous().view(torch.float8_e4m3fn).float()
    nope = _e2m1(e[:, :NVFP4_PACKED]).view(-1, NOPE // NVFP4_BLOCK, NVFP4_BLOCK) * scale[..., None]
    rope = e[:, NVFP4_ROPE_AT:NVFP4_SCALES_AT].contiguous().view(torch.float8_e4m3fn).float()
    out = torch.cat([nope.reshape(-1, NOPE), rope], dim=-1).to(torch.bfloat16)
    return out.view(*entries.shape[:-1], NOPE + rope.shape[-1])


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float32 -> e2m1 codes as PTX `cvt.rn.satfinite.e2m1x2.f32` rounds: to nearest, ties to the even code, past 6
    to 6, the sign kept (a tie goes up where the upper code is even)."""
    m = x.abs()
    code = ((m > 0.25).to(torch.uint8) + (m >= 0.75) + (m > 1.25) + (m >= 1.75) + (m > 2.5) + (m >= 3.5) + (m > 5.0))
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def quantize_nvfp4_ds_mla(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """[n, 512] + [n, 64] -> uint8 [n, 352], as vLLM's Triton writer of the entry (`_fused_norm_rope_kernel`'s
    MLA_CACHE_NVFP4 branch in deepseek_v32/common/kernels.py, "in lockstep with concat_and_cache_nvfp4_ds_mla
    (CUDA)") computes it: per 16-wide block sf = e4m3(max(amax * fp32(1/6), 2^-9)) (satfinite), each value times
    fp32(1 / sf) rounded to e2m1, two a byte (the even element low); the RoPE as e4m3 (satfinite); the scales
    permuted."""
    tiles = kv_c.float().view(-1, NOPE // NVFP4_BLOCK, NVFP4_BLOCK)
    sixth = torch.tensor(1.0 / 6.0, dtype=torch.float32, device=kv_c.device)
    sf = torch.maximum(tiles.abs().amax(dim=-1) * sixth, torch.tensor(2.0**-9, device=kv_c.device))
    sf = sf.clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    codes = _e2m1_codes(tiles * (1.0 / sf.float())[..., None]).view(-1, NVFP4_PACKED, 2)
    out = torch.empty(tiles.shape[0], NVFP4_ENTRY_BYTES, dtype=torch.uint8, device=kv_c.device)
    out[:, :NVFP4_PACKED] = codes[..., 0] | (codes[..., 1] << 4)
    out[:, NVFP4_ROPE_AT:NVFP4_SCALES_AT] = k_pe.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    out[:, _nvfp4_scale_bytes(kv_c.device)] = sf.view(torch.uint8)
    return out


def _decode_keys(op: str, k_cache, indices, topk_length, b: int, s_q: int, argument: str):
    """(keys fp32 [b * s_q, topk, d], invalid [b * s_q, topk]) one sparse decode list reads: -1 is skipped, anything
    else outside the cache a fault (reported, then skipped), and entries past a row's topk_length are not read."""
    pages, page_size = k_cache.shape[:2]
    idx = indices.reshape(b * s_q, -1).long()
    oob = (idx != -1) & ((idx < 0) | (idx >= pages * page_size))
    _report(op, argument, oob, idx, pages * page_size, k_cache.shape[-1])
    lengths = None if topk_length is None else topk_length.reshape(-1).long().repeat_interleave(s_q)
    invalid = (idx == -1) | oob | _topk_length_mask(op, lengths, idx.shape, idx.device)
    safe = idx.masked_fill(invalid, 0)
    if k_cache.shape[-1] == V4_ENTRY_BYTES:
        keys = _v4_records(k_cache, safe.flatten()).view(*idx.shape, -1)
    elif k_cache.shape[-1] == V41_ENTRY_BYTES:
        keys = _v41_records(k_cache, safe.flatten()).view(*idx.shape, -1)
    elif k_cache.shape[-1] == V41_NVFP4_ENTRY_BYTES:
        keys = _v41_nvfp4_records(k_cache, safe.flatten()).view(*idx.shape, -1)
    elif k_cache.shape[-1] == NVFP4_ENTRY_BYTES:
        keys = dequantize_nvfp4_ds_mla(k_cache[:, :, 0][safe // page_size, safe % page_size]).float()
    else:  # entries honour the page stride of a strided cache
        keys = dequantize_fp8_ds_mla(k_cache[:, :, 0][safe // page_size, safe % page_size]).float()
    return keys, invalid


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                           num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None,
                           attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                           extra_topk_length=None, out=None, enable_batch_invariant=False):
    """Sparse fp8 decode (`sparse_decode_fwd`) only: q [b, s_q, h_q, d], k_cache uint8 [pages, page_size, 1, bytes]
    in the layout its bytes per token name (656: DeepSeek-V3.2, d 576; 352: DeepSeek-V3.2's nvfp4_ds_mla entry, which
    only SM100's kernel reads, d 576; 584: DeepSeek-V4, d 512; 528: DeepSeek-V4.1's MXFP8 record, which only SM100's
    kernel reads, d 512), indices
    [b, s_q, topk] = page * page_size + offset, -1 invalid; only the leftmost topk_length[i] of batch i's indices
    are read. extra_k_cache / extra_indices_in_kvcache / extra_topk_length: a second list attended together with the
    first. attn_sink [h_q] scales the output by exp(lse) / (exp(lse) + exp(attn_sink)). Returns out
    [b, s_q, h_q, head_dim_v], lse [b, h_q, s_q] (of the scores, the sink not included)."""
    meta = tile_scheduler_metadata
    assert isinstance(meta, FlashMLASchedMeta) and num_splits is None
    assert indices is not None and is_fp8_kvcache and not causal, "stand-in covers sparse fp8 decode only"
    assert k_cache.shape[-1] in (ENTRY_BYTES, NVFP4_ENTRY_BYTES, V4_ENTRY_BYTES, V41_ENTRY_BYTES), \
        f"{k_cache.shape[-1]} bytes a token: not a layout here"
    assert (extra_k_cache is None) == (extra_indices_in_kvcache is None), "extra_k_cache comes with its indices"
    config = (q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1], k_cache.shape[2], causal, is_fp8_kvcache,
              indices.shape[-1], None if extra_k_cache is None else extra_k_cache.shape[1],
              None if extra_indices_in_kvcache is None else extra_indices_in_kvcache.shape[-1], enable_batch_invariant)
    if not meta.have_initialized:
        meta.have_initialized, meta.config = True, config
    else:  # the real wrapper asserts the same, field by field
        assert meta.config == config, f"sched_meta reused with other shapes: {meta.config} vs {config}"
    softmax_scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    b, s_q, h_q, d = q.shape
    keys, invalid = _decode_keys("flash_mla_with_kvcache", k_cache, indices, topk_length, b, s_q, "k_cache")
    if extra_k_cache is not None:
        assert extra_k_cache.shape[-1] == k_cache.shape[-1], "extra_k_cache must share k_cache's layout"
        extra, extra_invalid = _decode_keys("flash_mla_with_kvcache", extra_k_cache, extra_indices_in_kvcache,
                                            extra_topk_length, b, s_q, "extra_k_cache")
        keys, invalid = torch.cat([keys, extra], dim=1), torch.cat([invalid, extra_invalid], dim=1)
    o, _, lse = _sparse_attention(q.reshape(b * s_q, h_q, d), keys, invalid, softmax_scale, head_dim_v)
    if attn_sink is not None:
        o = o * torch.sigmoid(lse - attn_sink.float()[None]).nan_to_num(0.0)[..., None]
    o = o.view(b, s_q, h_q, head_dim_v)
    if out is None:
        out = torch.empty_like(o, dtype=q.dtype)
    out.copy_(o)
    return out, lse.view(b, s_q, h_q).transpose(1, 2).contiguous()


def concat_mla_q(ql_nope: torch.Tensor, q_pe: torch.Tensor, q_out: torch.Tensor) -> None:
    """`ops.concat_mla_q`: q_out[t, h] = ql_nope[t, h] | q_pe[t, h] for the input's heads (q_out may have more)."""
    t, h, nope = ql_nope.shape
    if q_out.shape[0] < t or q_out.shape[1] < h or q_out.shape[2] != nope + q_pe.shape[-1]:
        _violation("concat_mla_q", "q_out", "store", q_out.numel(), q_out.numel(), q_out.element_size())
        return
    q_out[:t, :h, :nope] = ql_nope
    q_out[:t, :h, nope:] = q_pe


def _gather_request(op, src_cache, dst, block_table, b: int, start: int, pos: torch.Tensor,
                    dequantize=dequantize_fp8_ds_mla) -> None:
    """Request b's positions `pos`, dequantized, to dst[start + i]; every index it follows bounds-checked."""
    num_blocks, block_size = src_cache.shape[:2]
    if start + len(pos) > dst.shape[0]:
        _violation(op, "dst", "store", start + len(pos) - 1, dst.shape[0], dst.shape[-1] * dst.element_size())
        pos = pos[: max(0, dst.shape[0] - start)]
    col = pos // block_size
    bad_col = col >= block_table.shape[1]
    _report(op, "block_table", bad_col, b * block_table.shape[1] + col, block_table.numel(), 4)
    blocks = block_table[b].long()[col.clamp(max=block_table.shape[1] - 1)]
    bad = ~bad_col & ((blocks < 0) | (blocks >= num_blocks))
    _report(op, "src_cache", bad, blocks * block_size + pos % block_size, num_blocks * block_size, src_cache.shape[-1])
    ok = ~(bad_col | bad)
    first = pos[0] if len(pos) else 0
    dst[start + pos[ok] - first] = dequantize(src_cache[blocks[ok], (pos % block_size)[ok]]).to(dst.dtype)


def cp_gather_and_upconvert_fp8_kv_cache(src_cache, dst, block_table, workspace_starts, batch_size, seq_starts=None,
                                         host_cache=None, host_row_ids=None, device_row_ids=None) -> None:
    """`ops.cp_gather_and_upconvert_fp8_kv_cache`: request b's positions [0, n_b) (from seq_starts[b]) go, dequantized,
    to dst[workspace_starts[b] + i]; n_b is the gap to the next start (the last one: to dst's end)."""
    assert host_cache is None and host_row_ids is None and device_row_ids is None, "HiSparse host rows not covered"
    if src_cache.shape[-1] * src_cache.element_size() != ENTRY_BYTES:  # what it would read is not an fp8_ds_mla entry
        raise ValueError(f"cp_gather_and_upconvert_fp8_kv_cache: src_cache rows of "
                         f"{src_cache.shape[-1] * src_cache.element_size()} bytes, the fp8_ds_mla entry is {ENTRY_BYTES}")
    starts = workspace_starts[:batch_size].long().tolist() + [dst.shape[0]]
    for b in range(batch_size):
        pos = torch.arange(starts[b + 1] - starts[b], device=dst.device)
        if seq_starts is not None:
            pos = pos + int(seq_starts[b])
        _gather_request("cp_gather_and_upconvert_fp8_kv_cache", src_cache, dst, block_table, b, starts[b], pos)


def cp_gather_and_upconvert_nvfp4_kv_cache(src_cache, dst, block_table, workspace_starts, batch_size) -> None:
    """`ops.cp_gather_and_upconvert_nvfp4_kv_cache` (vLLM's docstring: src [num_blocks, block_size, 352] uint8, dst bf16
    [total_tokens, 576]): request b's positions [0, n_b) go, dequantized, to dst[workspace_starts[b] + i], n_b the gap
    to the next start (the last one: to dst's end), as the fp8 op it sits beside (its CUDA source is not in vLLM's
    wheel: this row extent is read from the call site, which sizes dst to the chunk's total)."""
    if src_cache.shape[-1] != NVFP4_ENTRY_BYTES or dst.shape[-1] != NOPE + 64:
        raise StandInRefused(f"cp_gather_and_upconvert_nvfp4_kv_cache: src rows of {src_cache.shape[-1]} bytes, dst "
                             f"rows of {dst.shape[-1]} (only 352 -> 576 is the op's form)")
    starts = workspace_starts[:batch_size].long().tolist() + [dst.shape[0]]
    for b in range(batch_size):
        pos = torch.arange(starts[b + 1] - starts[b], device=dst.device)
        _gather_request("cp_gather_and_upconvert_nvfp4_kv_cache", src_cache, dst, block_table, b, starts[b], pos,
                        dequantize_nvfp4_ds_mla)


def _ceil_pow2(s: torch.Tensor) -> torch.Tensor:
    mantissa, exponent = torch.frexp(s)
    return torch.ldexp(torch.ones_like(s), exponent - (mantissa == 0.5).to(exponent.dtype))


def quantize_fp8_ds_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, scale_convention: str = "pow2") -> torch.Tensor:
    """[n, 512] + [n, 64] -> uint8 [n, 656]. "pow2": max(amax/448, 1e-4) rounded up to a power of two (newer CUDA
    and the Triton writer); "arbitrary": max(amax/448, FLT_MIN) unrounded (older CUDA writer)."""
    tiles = kv_c.float().view(-1, NOPE // TILE, TILE)
    s = tiles.abs().amax(dim=-1) / FP8_MAX
    s = _ceil_pow2(s.clamp(min=1e-4)) if scale_convention == "pow2" else s.clamp(min=torch.finfo(torch.float32).tiny)
    fp8 = (tiles / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8).view(-1, NOPE)
    return torch.cat([fp8, s.view(torch.uint8), k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)], dim=-1)


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale, scale_convention="pow2"):
    """`ops.concat_and_cache_mla` for "fp8_ds_mla" and "nvfp4_ds_mla" (per-entry scales; `scale` is ignored, as in the
    CUDA op); unquantized dtypes go to the plain stand-in."""
    if kv_cache_dtype not in ("fp8_ds_mla", "nvfp4_ds_mla"):
        return plain_concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale)
    refuse_empty_grid("concat_and_cache_mla", slot_mapping.shape[0])
    num_blocks, block_size = kv_cache.shape[:2]
    slots, capacity = slot_mapping.long(), num_blocks * block_size
    for slot in slots[slots >= capacity].tolist()[:8]:
        _violation("concat_and_cache_mla", "kv_cache", "store", slot, capacity, kv_cache.shape[-1])
    keep = (slots >= 0) & (slots < capacity)
    entries = (quantize_nvfp4_ds_mla(kv_c[keep], k_pe[keep]) if kv_cache_dtype == "nvfp4_ds_mla" else
               quantize_fp8_ds_mla(kv_c[keep], k_pe[keep], scale_convention))
    kv_cache[slots[keep] // block_size, slots[keep] % block_size] = entries


def cp_gather_and_upconvert_fp8_kv_cache_seq_lens(src_cache, dst, block_table, seq_lens, workspace_starts,
                                                  batch_size) -> None:
    """The op as 0.23 declares it: request b's positions [0, seq_lens[b]) go, dequantized, to
    dst[workspace_starts[b] + i] (later releases take seq_starts and derive each length from the next start)."""
    for b in range(batch_size):
        pos = torch.arange(int(seq_lens[b]), device=dst.device)
        _gather_request("cp_gather_and_upconvert_fp8_kv_cache", src_cache, dst, block_table, b,
                        int(workspace_starts[b]), pos)
