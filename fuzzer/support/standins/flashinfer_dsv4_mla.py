"""Stand-in for FlashInfer's `trtllm_batch_decode_sparse_mla_dsv4` on an emulated SM100 device (backend "auto" ->
trtllm-gen), as vLLM 0.33.0's DeepSeek-V4 and V4.1 FlashInfer layers (`DeepseekV4FlashInferMLAAttention` of
vllm/models/deepseek_v4/nvidia/flashinfer_sparse.py and of deepseek_v41's) call it: varlen query, one combined sparse
table whose first 128 columns index the SWA pool and the rest the compressed pool, storage-offset indices.

Source of truth: vLLM 0.33.0 pins flashinfer-python 0.7.2.post1; no attnfuzz host installs it and the kernel runs on
SM100 only. What was read, from FlashInfer's repository as attnfuzz's mirror holds it (main at fb28d724, 2026-08-22):
- `flashinfer/mla/_core.py`: `trtllm_batch_decode_sparse_mla_dsv4` (the docstring: "The first 128 columns of
  sparse_indices are SWA entries into swa_kv_cache; remaining columns are compressed entries into
  compressed_kv_cache. sparse_topk_lens gives the total active sparse length for each query token and must include
  the fixed 128 SWA entries. seq_lens provides the original KV sequence length for the SWA validity window"; the
  output is bf16), `_resolve_dsv4_sparse_mla_backend`, `_check_dsv4_sparse_mla_inputs`,
  `_normalize_dsv4_sparse_mla_kv_cache` (3-D caches only with kv_layout "HND", the default vLLM leaves),
  `_normalize_dsv4_topk_lens`, and the checks made only under FLASHINFER_VALIDATE_INPUTS (lengths in
  [128, capacity], seq_lens >= the request's query length), which are off by default: a call that breaks them runs.
- `tests/attention/test_trtllm_gen_sparse_mla_dsv4.py`: its reference (`ref_sparse_attn_decode`: scores q.k x
  sm_scale over both segments, -1 entries and entries past a segment's length masked, the sink as
  out x 1 / (1 + e^(sink - lse)), a token with no key 0) and its "seq_lens-driven SWA masking" case: the kernel
  takes min(128, pos + 1) SWA columns for the query at position pos = seq_len - q_len + i of its request.
- The storage-offset form: the mirror's function has no `sparse_indices_are_storage_offsets` (nor the RopeQuant
  outputs `dsv4_output_scale`, `dsv4_inv_rope_cos_sin_cache`), which vLLM 0.33.0 passes (True); its meaning is read
  from FlashInfer's benchmark (`map_sparse_indices(..., page_stride_rows=cache.stride(0) // 512)` before passing
  True) and vLLM's `_remap_flashinfer_index` ("FlashInfer's DSv4 kernel indexes sparse KV by physical token stride"):
  entry e is the row at element e x the pool's token stride from its base, whatever the pool's page stride (vLLM
  issue 47783: under the packed KV layout the page stride is longer than block_size rows).
NOT public, said in the result (`not_public`) and never guessed silently: a -1 inside a segment's active columns
(vLLM's builder comment: "the kernel treats every entry of its active ranges as a key"; read here as a zero row,
what the TMA's out-of-bounds fill gives), a length under 128 or past the table, seq_lens under the request's query
length (positions before 0), and which heads-dtype pairs have cubins.

Refused (`StandInRefused`: could not test): `sparse_indices_are_storage_offsets=False` (the mapping the release
does then is not in the source read), the RopeQuant outputs, tensor bmm scales, `backend` other than "auto", HCA
metadata, and the SM120-only segment arguments (FlashInfer's own ValueError, as it raises it on SM100).

A read outside the pool's allocation is recorded as a memory violation and the entry skipped; a read of a row inside
the allocation that is not one of the pool's rows (a packed page's rows of other components) is recorded too
(`GapRead`) and skipped.
"""

from __future__ import annotations

import torch

from fuzzer.support.errors import StandInRefused
from fuzzer.support.interp.sanitizer import VIOLATIONS, MemoryViolation
from fuzzer.support.standins.flashinfer_trtllm_mla import (
    LOG2E,
    _attend,
    _check,
    _check_shape_dtype_device,
    _undocumented,
    _violation,
)

OP = "trtllm_batch_decode_sparse_mla_dsv4"
KERNEL = f"{OP} (attnfuzz stand-in: trtllm-gen DeepSeek-V4 sparse MLA, SM100)"
SWA_COLUMNS = 128  # _DSV4_HCA_WINDOW_CAPACITY; "the fixed 128 SWA entries"
HEADS = (8, 16, 32, 64, 128)


class GapRead(MemoryViolation):
    """A read of a row inside the pool's allocation that is not one of its rows (a packed page's other rows)."""

    def describe(self) -> str:
        return (f"out-of-bounds {self.op} of {self.element_bytes} bytes in {self.kernel}: a row at byte "
                f"{self.byte_offset} of `{self.argument}` that is no row of it (inside its allocation: between its "
                f"pages' rows, where a packed page keeps other components)")


def _refuse(what: str) -> StandInRefused:
    return StandInRefused(f"attnfuzz's stand-in of FlashInfer's {OP} does not model {what} (vLLM's DeepSeek-V4 "
                          "FlashInfer layers never pass it)")


def trtllm_batch_decode_sparse_mla_dsv4(
        query, swa_kv_cache, workspace_buffer, sparse_indices=None, compressed_kv_cache=None, sparse_topk_lens=None,
        seq_lens=None, out=None, bmm1_scale=1.0, bmm2_scale=1.0, sinks=None, kv_layout="HND", cum_seq_lens_q=None,
        max_q_len=None, enable_pdl=None, swa_topk_lens=None, extra_sparse_indices=None, extra_sparse_topk_lens=None,
        backend="auto", hca_swa_indices=None, hca_compressed_block_tables=None, hca_seq_lens=None,
        hca_is_causal=True, hca_use_persistent=False, hca_sparse_indices_format=None,
        sparse_indices_are_storage_offsets=False, dsv4_output_scale=None, dsv4_inv_rope_cos_sin_cache=None):
    """FlashInfer's trtllm_batch_decode_sparse_mla_dsv4 on an emulated SM100 (attnfuzz's stand-in)."""
    if backend != "auto":
        raise _refuse(f"backend={backend!r} (vLLM passes the default, 'auto')")
    hca = dict(hca_swa_indices=hca_swa_indices, hca_compressed_block_tables=hca_compressed_block_tables,
               hca_seq_lens=hca_seq_lens, hca_is_causal=None if hca_is_causal else False,
               hca_use_persistent=hca_use_persistent or None, hca_sparse_indices_format=hca_sparse_indices_format)
    unexpected = [name for name, value in hca.items() if value is not None]
    _check(ValueError, (bool(unexpected), f"backend='trtllm-gen' does not accept {', '.join(unexpected)}"))
    if dsv4_output_scale is not None or dsv4_inv_rope_cos_sin_cache is not None:
        raise _refuse("the RopeQuant outputs (dsv4_output_scale, dsv4_inv_rope_cos_sin_cache: the fused inverse RoPE "
                      "and fp8 quantization of the output)")
    if isinstance(bmm1_scale, torch.Tensor) or isinstance(bmm2_scale, torch.Tensor):
        raise _refuse("on-device (tensor) bmm scales")
    _check(ValueError, (swa_topk_lens is not None or extra_sparse_indices is not None
                        or extra_sparse_topk_lens is not None,
                        "swa_topk_lens, extra_sparse_indices, and extra_sparse_topk_lens are only supported on "
                        "SM120/SM121"),
           (sparse_topk_lens is None or compressed_kv_cache is None or seq_lens is None,
            "backend='trtllm-gen' requires compressed_kv_cache, sparse_topk_lens, and seq_lens"),
           (sparse_indices is None, "backend='trtllm-gen' requires sparse_indices"))
    if not sparse_indices_are_storage_offsets:
        raise _refuse("sparse_indices_are_storage_offsets=False (what this release maps logical slots to is not in "
                      "the source read)")
    swa, comp, lens, batch, q_len, q_flat, out_shape, cu = _check_inputs(
        query, swa_kv_cache, sparse_indices, compressed_kv_cache, sparse_topk_lens, out, sinks, kv_layout,
        cum_seq_lens_q, max_q_len)
    if out is None:  # FlashInfer: torch.empty; NaN here
        out = torch.full(out_shape, float("nan"), dtype=torch.bfloat16, device=query.device)
    _check_shape_dtype_device(seq_lens, (batch,), torch.int32, query.device, "seq_lens")
    tokens, heads = q_flat.shape[0], q_flat.shape[1]
    table = sparse_indices.reshape(tokens, -1).long()
    width = table.shape[1]
    # Each token's request and position (cum_seq_lens_q, or q_len tokens a request); tokens past the last request's
    # end belong to none and are not computed.
    cu_host = cu.cpu().long() if cu is not None else torch.arange(batch + 1) * q_len
    seq_host = seq_lens.cpu().long()
    request = torch.full((tokens,), -1, dtype=torch.long)
    position = torch.zeros(tokens, dtype=torch.long)
    for b in range(batch):
        lo, hi = int(cu_host[b]), min(int(cu_host[b + 1]), tokens)
        if hi > lo:
            request[lo:hi] = b
            position[lo:hi] = seq_host[b] - (int(cu_host[b + 1]) - lo) + torch.arange(hi - lo)
    real = request >= 0
    if (real & (position < 0)).any():
        _undocumented("seq_lens under the request's query length (a query position before 0; FlashInfer checks it "
                      "only with FLASHINFER_VALIDATE_INPUTS): no SWA column taken", (real & (position < 0)).nonzero())
    total = lens.cpu().long()
    if (real & ((total < SWA_COLUMNS) | (total > width))).any():
        _undocumented(f"sparse_topk_lens outside [{SWA_COLUMNS}, {width}] (FlashInfer checks it only with "
                      "FLASHINFER_VALIDATE_INPUTS): clamped", (real & ((total < SWA_COLUMNS) | (total > width))).nonzero())
    cols = torch.arange(width)[None, :]
    swa_active = cols < (position + 1).clamp(0, SWA_COLUMNS)[:, None]
    comp_active = (cols >= SWA_COLUMNS) & (cols < total.clamp(SWA_COLUMNS, width)[:, None])
    active = (swa_active | comp_active) & real[:, None]
    table_host = table.cpu()
    negative = active & (table_host < 0)
    if negative.any():
        _undocumented("a -1 entry inside a segment's active columns: read as a zero row (vLLM: the kernel treats "
                      "every entry of its active ranges as a key)", negative.any(-1).nonzero())
    keep = active & ~negative
    keep &= _in_pool(swa, "swa_kv_cache", table_host, keep & (cols < SWA_COLUMNS))
    keep &= _in_pool(comp, "compressed_kv_cache", table_host, keep & (cols >= SWA_COLUMNS))
    rows_swa, rows_comp = _rows(swa), _rows(comp)
    # One table of both pools' rows: compressed entries shifted past the SWA pool's.
    rows = torch.cat([rows_swa, rows_comp])
    idx = torch.where(cols < SWA_COLUMNS, table_host, table_host + len(rows_swa)).clamp(min=0)
    o, lse2 = _attend(q_flat.float(), rows, idx.to(rows.device), keep.to(rows.device), negative.to(rows.device),
                      float(bmm1_scale), None)
    if sinks is not None:  # out x 1 / (1 + e^(sink - lse)), natural log (the test's reference)
        o = o * torch.sigmoid(lse2 / LOG2E - sinks.float()[None, :]).nan_to_num(0.0)[..., None]
    o = o * float(bmm2_scale)
    flat_out = out.view(tokens, heads, 512)
    flat_out[real.to(out.device)] = o[real.to(o.device)].to(out.dtype)
    return out


def _check_inputs(query, swa_kv_cache, sparse_indices, compressed_kv_cache, sparse_topk_lens, out, sinks, kv_layout,
                  cum_seq_lens_q, max_q_len):
    """_core.py _check_dsv4_sparse_mla_inputs (allow_sm120_packed_kv=False), its checks in their order."""
    if cum_seq_lens_q is not None:
        _check(ValueError, (query.ndim != 3, f"Expected query.ndim == 3 when cum_seq_lens_q is provided, got "
                                             f"{query.ndim}"),
               (cum_seq_lens_q.dtype != torch.int32,
                f"cum_seq_lens_q must have dtype torch.int32, got {cum_seq_lens_q.dtype}"),
               (cum_seq_lens_q.ndim != 1, f"Expected cum_seq_lens_q.ndim == 1, got {cum_seq_lens_q.ndim}"))
        batch = cum_seq_lens_q.numel() - 1
        _check(ValueError, (batch <= 0, f"Expected cum_seq_lens_q.numel() >= 2, got {cum_seq_lens_q.numel()}"),
               (cum_seq_lens_q.device != query.device,
                f"cum_seq_lens_q must be on query device {query.device}, got {cum_seq_lens_q.device}"))
        sum_q, heads, head_dim = query.shape
        _check(ValueError, (max_q_len is None, "max_q_len is required when cum_seq_lens_q is provided to avoid an "
                                               "implicit device-to-host synchronization"))
        _check(ValueError, (max_q_len <= 0, f"Expected max_q_len > 0, got {max_q_len}"))
        q_len, q_flat, out_shape = max_q_len, query, (sum_q, heads, 512)
    else:
        _check(ValueError, (query.ndim != 4, f"Expected query.ndim == 4, got {query.ndim}"))
        batch, q_len, heads, head_dim = query.shape
        sum_q = batch * q_len
        _check(ValueError, (max_q_len is not None and max_q_len != q_len,
                            f"Expected max_q_len == {q_len} for dense query input, got {max_q_len}"))
        q_flat, out_shape = query.flatten(0, 1), (batch, q_len, heads, 512)
    _check(ValueError, (query.dtype not in (torch.bfloat16, torch.float8_e4m3fn),
                        f"DeepSeek V4 sparse MLA only supports BF16 or FP8 E4M3 query, got {query.dtype}"),
           (head_dim != 512, f"Expected query head dim 512, got {head_dim}"),
           (heads not in HEADS, f"Expected 8, 16, 32, 64, or 128 query heads, got {heads}"),
           (sparse_indices.dtype != torch.int32,
            f"sparse_indices must have dtype torch.int32, got {sparse_indices.dtype}"),
           (sparse_indices.device != query.device,
            f"sparse_indices must be on query device {query.device}, got {sparse_indices.device}"),
           (sparse_indices.ndim != 2, f"Expected flattened sparse_indices.ndim == 2, got {sparse_indices.ndim}"))
    _check(ValueError, (tuple(sparse_indices.shape[:-1]) != (sum_q,),
                        f"Expected sparse_indices.shape[:-1] == {(sum_q,)}, got {tuple(sparse_indices.shape[:-1])}"),
           (sparse_indices.size(-1) < SWA_COLUMNS,
            f"sparse_indices must include the fixed 128 SWA entries, got {sparse_indices.size(-1)}"),
           (sparse_indices.size(-1) % 4 != 0,
            f"sparse_indices last dimension must be a multiple of 4, got {sparse_indices.size(-1)}"))
    pools = []
    for cache, name in ((swa_kv_cache, "swa_kv_cache"), (compressed_kv_cache, "compressed_kv_cache")):
        cache = _normalize_cache(cache, kv_layout, name)
        _check(ValueError, (cache.dtype != query.dtype,
                            f"{name} dtype must match query dtype, got {cache.dtype} and {query.dtype}"),
               (cache.size(-1) != 512, f"Expected {name} head dim 512, got {cache.size(-1)}"))
        pools.append(cache)
    # _normalize_dsv4_topk_lens
    _check(ValueError, (sparse_topk_lens.dtype != torch.int32,
                        f"sparse_topk_lens must have dtype torch.int32, got {sparse_topk_lens.dtype}"),
           (sparse_topk_lens.device != query.device,
            f"sparse_topk_lens must be on device {query.device}, got {sparse_topk_lens.device}"),
           (sparse_topk_lens.ndim != 1, f"Expected flattened sparse_topk_lens.ndim == 1, got {sparse_topk_lens.ndim}"),
           (sparse_topk_lens.ndim == 1 and sparse_topk_lens.size(0) != sum_q,
            f"Expected flattened sparse_topk_lens.shape == ({sum_q},), got {tuple(sparse_topk_lens.shape)}"))
    if cum_seq_lens_q is not None:
        _check_shape_dtype_device(cum_seq_lens_q, (batch + 1,), torch.int32, query.device, "cum_seq_lens_q")
    if out is not None:
        _check_shape_dtype_device(out, out_shape, torch.bfloat16, query.device, "out")
    if sinks is not None:
        _check_shape_dtype_device(sinks, (heads,), torch.float32, query.device, "sinks")
    return pools[0], pools[1], sparse_topk_lens, batch, q_len, q_flat, out_shape, cum_seq_lens_q


def _normalize_cache(cache, kv_layout, name):
    """_normalize_dsv4_sparse_mla_kv_cache: -> [num_pages, 1, page_size, 512] (HND strides)."""
    if cache.ndim == 3:
        _check(ValueError, (kv_layout == "NHD", f"{name} with ndim == 3 is only valid for kv_layout='HND'; got "
                                                f"kv_layout={kv_layout}"))
        cache = cache.unsqueeze(1)
    elif cache.ndim != 4:
        raise ValueError(f"Expected {name}.ndim == 3 or 4, got {cache.ndim}")
    if kv_layout == "HND":
        _check(ValueError, (cache.size(1) != 1, f"Expected {name}.shape[1] == 1, got {cache.size(1)}"))
        return cache
    if kv_layout == "NHD":
        _check(ValueError, (cache.size(2) != 1, f"Expected {name}.shape[2] == 1, got {cache.size(2)}"))
        return cache.transpose(-3, -2)
    raise ValueError(f"kv_layout must be either 'HND' or 'NHD', got {kv_layout}")


def _rows(pool: torch.Tensor) -> torch.Tensor:
    """Every row the kernel can address in `pool` [pages, 1, page_size, 512]: row e at element e x token stride from
    the pool's base, up to the end of its allocation (the TMA view: a row a token, unbounded above)."""
    stride = pool.stride(-2)
    _check(RuntimeError, (pool.stride(-1) != 1, "the pool's rows are not contiguous (the TMA descriptor needs them)"))
    elements = pool.untyped_storage().nbytes() // pool.element_size() - pool.storage_offset()
    count = max(0, (elements - 512) // stride + 1)
    return torch.as_strided(pool, (count, 512), (stride, 1))


def _in_pool(pool: torch.Tensor, name: str, table: torch.Tensor, reads: torch.Tensor) -> torch.Tensor:
    """False where a read entry is no row of `pool`: past its allocation (a violation outside it) or inside it between
    its pages' rows (a packed page's other components: GapRead); each recorded, up to 4 a pool."""
    ok = torch.ones_like(reads)
    if not reads.any():
        return ok
    stride, page_stride = pool.stride(-2), pool.stride(0)
    elements = pool.untyped_storage().nbytes() // pool.element_size() - pool.storage_offset()
    entries = table[reads]
    start = entries * stride
    past = start + 512 > elements
    within = start % page_stride
    gap = ~past & ((start // page_stride >= pool.shape[0]) | (within % stride != 0)
                   | (within // stride >= pool.shape[2]))
    for e in entries[past].unique()[:4].tolist():
        _violation(KERNEL, name, e * stride, elements, pool.element_size())
    for e in entries[gap].unique()[:4].tolist():
        VIOLATIONS.violations.append(GapRead(
            kernel=KERNEL, op="load", argument=name, byte_offset=e * stride * pool.element_size(),
            argument_bytes=elements * pool.element_size(), element_bytes=pool.element_size(), program_id=(0, 0, 0),
            lanes=1, inside_allocation=True))
    bad = torch.zeros_like(reads)
    bad[reads] = past | gap
    return ~bad

