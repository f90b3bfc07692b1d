"""Stand-ins for the compiled ops vLLM's sparse-attention indexer (DeepSeek-V3.2 / GLM-5) calls, from
`_C_stable_libtorch`: `torch.ops._C_cache_ops.indexer_k_quant_and_cache` / `cp_gather_indexer_k_quant_cache` and
`torch.ops._C.top_k_per_row_prefill` / `top_k_per_row_decode` / `persistent_topk` / `cooperative_topk`.

Each follows its kernel's addressing, not the tensors' metadata: the kernels take raw data pointers and index them
with the sizes and strides their launchers pass (often not the tensor's own strides), so a stand-in reads and
writes through a flat view of each argument's storage at the kernel's offsets. An access outside an argument's
view is recorded in `VIOLATIONS.violations` (inside_allocation when it still lands in the tensor's storage, which
the stand-in then reads or writes as the GPU would; outside it, nothing is written and a read is taken as -inf
for a score, 0 for a length, or skips the element). Plain torch; CPU and CUDA tensors.
"""

from __future__ import annotations

import itertools

import torch

from fuzzer.support.interp.sanitizer import VIOLATIONS, MemoryViolation
from fuzzer.support.standins.cache_ops import refuse_empty_grid

INDEXER_OPS_SOURCE = (
    "vLLM csrc/libtorch_stable/cache_kernels.cu @ 00eb0c874eb54594184ace2b4711db1df48ba85c "
    "(indexer_k_quant_and_cache_kernel, cp_gather_indexer_k_quant_cache_kernel and their launchers); "
    "csrc/libtorch_stable/sampler.cu @ 030ea52effcb05071543c8c42b8f0145e94cee43 (topKPerRowJob, topKPerRowPrefill, "
    "topKPerRowDecode, top_k_per_row_prefill/decode launchers); csrc/libtorch_stable/cooperative_topk.cu "
    "@ 1daf3b4c2eecc19288332c6503aeb2d5aeb181c6 (host checks; 0.33.0's texts: <=64 rows, stride multiple of 4); "
    "persistent_topk host checks and launcher (topk.cu, a 2026 version: FilteredTopKRaggedTransform above 32 rows, "
    "the persistent kernel below); tests/kernels/test_top_k_per_row.py @ 01b3e82bbb3ac370a016288f346cc6a26612f9e4 "
    "(_assert_exact_topk: -1 fill past min(length, k), no duplicates). vLLM 0.33.0's Python: _custom_ops.py, "
    "model_executor/layers/sparse_attn_indexer.py (\"mxfp8\" when mqa_logits_use_mx_scales()), "
    "model_executor/layers/indexer_topk.py, utils/deep_gemm.py (mqa_logits_use_mx_scales: the scale as four equal "
    "UE8M0 bytes), v1/attention/ops/common.py (pack_ue8m0_x4). The exact 0.33.0 commits of the .cu files were not "
    "available; the CUDA source of the \"mxfp8\" form was not found (modelled from the Python docs above), nor "
    "persistent_topk.cuh / cooperative_topk.cuh (their selection modelled from the tests' contract)."
)

_FP8_MAX = 448.0  # kFp8ScaleDivisor off gfx942


def _violation(op: str, argument: str, index: int, limit: int, elem_bytes: int, access: str, lanes: int,
               inside: bool) -> None:
    VIOLATIONS.violations.append(MemoryViolation(
        kernel=f"{op} (attnfuzz stand-in)", op=access, argument=argument, byte_offset=index * elem_bytes,
        argument_bytes=limit * elem_bytes, element_bytes=elem_bytes, program_id=(0, 0, 0), lanes=lanes,
        inside_allocation=inside))


class _Flat:
    """A tensor argument as the kernel sees it: a typed pointer to its first element. Offsets are in elements of
    `dtype` (the kernel's reinterpretation; the tensor's own when None) from that pointer."""

    def __init__(self, op: str, name: str, t: torch.Tensor, dtype: torch.dtype | None = None):
        self.op, self.name = op, name
        dtype = dtype or t.dtype
        self.elem = torch.empty(0, dtype=dtype).element_size()
        storage = t.untyped_storage()
        self.flat = torch.empty(0, dtype=dtype, device=t.device).set_(
            storage, 0, (storage.nbytes() // self.elem,), (1,))
        base_bytes = t.storage_offset() * t.element_size()
        self.base = base_bytes // self.elem
        view_bytes = (1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))) * t.element_size() \
            if t.numel() else 0
        self.extent = view_bytes // self.elem

    def check(self, offs: torch.Tensor, access: str) -> torch.Tensor:
        """Record the offsets outside the view (one violation per call, its first offending lane); return the mask of
        those inside the storage, which the GPU would touch."""
        offs = offs.reshape(-1)
        bad = (offs < 0) | (offs >= self.extent)
        absolute = offs + self.base
        in_storage = (absolute >= 0) & (absolute < self.flat.numel())
        if bool(bad.any()):
            first = int(bad.nonzero()[0])
            _violation(self.op, self.name, int(offs[first]), self.extent, self.elem, access, int(bad.sum()),
                       bool(in_storage[first]))
        return in_storage

    def load(self, offs: torch.Tensor, fill) -> torch.Tensor:
        offs = offs.reshape(-1).long().cpu()
        ok = self.check(offs, "load")
        out = torch.full((offs.numel(),), fill, dtype=self.flat.dtype, device=self.flat.device)
        if bool(ok.any()):
            out[ok.to(out.device)] = self.flat[(offs[ok] + self.base).to(self.flat.device)]
        return out

    def store(self, offs: torch.Tensor, values: torch.Tensor) -> None:
        offs = offs.reshape(-1).long().cpu()
        values = values.reshape(-1).to(self.flat.device, self.flat.dtype)
        ok = self.check(offs, "store")
        if bool(ok.any()):
            self.flat[(offs[ok] + self.base).to(self.flat.device)] = values[ok.to(values.device)]


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise RuntimeError(message)


def _ue8m0(scale: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(scale)))


def indexer_k_quant_and_cache(k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                              quant_block_size: int, kv_cache_dtype: str) -> None:
    """`indexer_k_quant_and_cache` (vLLM's wrapper passes scale_fmt, "ue8m0" or another string, or "mxfp8"):
    token t = 0..k.size(0)-1 goes to slot s = slot_mapping[t] (int64; negative: skipped), i.e. block s // block_size,
    row s % block_size of a cache viewed per block (kv_cache.stride(0) bytes apart) as block_size*head_dim e4m3
    bytes, row-major, then the scales as fp32 (4 bytes each). The kernel reads k as a dense [tokens, head_dim]
    array from its first element and slot_mapping for every token of k, whatever their strides and lengths.

    Scale: one warp quantizes 128 elements (32 lanes x 4), so amax is over each 128-wide group of the token,
    NaN ignored (fmaxf), whatever quant_block_size; scale = max(amax, 1e-4) / 448; "ue8m0" and "mxfp8" round it up
    to a power of two, exp2(ceil(log2(scale))). Values: e4m3(float(x) / scale), round to nearest even, saturated at
    +-448 (NaN stays NaN). The group's lane 0 writes the scale to scale slot (row*head_dim + 128*group) /
    quant_block_size of the block, so with quant_block_size < 128 only every (128/quant_block_size)-th slot is
    written. "mxfp8": the scale's biased exponent byte four times (`pack_ue8m0_x4`) instead of the fp32.

    Not read from source: the "mxfp8" branch (no CUDA source found; modelled on mqa_logits_use_mx_scales' docs and
    the Triton writer's MX_SCALE form). Two tokens with one slot race in the kernel; the stand-in keeps the last.
    0 tokens: an empty grid, which fails to launch (raised here, as cache_ops' stand-ins do).
    """
    op = "indexer_k_quant_and_cache"
    num_tokens, head_dim = k.shape[0], k.shape[1]
    _need(k.device == kv_cache.device, "k and kv_cache must be on the same device")
    _need(k.device == slot_mapping.device, "k and slot_mapping must be on the same device")
    _need(quant_block_size != 0 and head_dim % quant_block_size == 0,
          "head_dim must be divisible by quant_block_size")
    _need(k.dtype in (torch.float32, torch.float16, torch.bfloat16),
          f"Unsupported input type of kv cache: {k.dtype}")
    _need(slot_mapping.dtype == torch.int64, f"expected scalar type Long but found {slot_mapping.dtype}")
    refuse_empty_grid(op, num_tokens)
    block_size, stride0 = kv_cache.shape[1], kv_cache.stride(0)
    use_pow2 = kv_cache_dtype in ("ue8m0", "mxfp8")
    slots = _Flat(op, "slot_mapping", slot_mapping).load(torch.arange(num_tokens), -1).long().cpu()
    tokens = (slots >= 0).nonzero().flatten()
    if tokens.numel() == 0:
        return
    # The last token writing a slot wins (the kernel races; one order is as good as another).
    uniq, inverse = torch.unique(slots[tokens], return_inverse=True)
    last = torch.full((uniq.numel(),), -1, dtype=torch.long).scatter_reduce_(0, inverse, tokens, "amax")
    tokens = last
    slot = slots[tokens]
    blk, row = slot // block_size, slot % block_size
    dims = torch.arange(head_dim)
    x = _Flat(op, "k", k).load(tokens[:, None] * head_dim + dims, float("nan")).reshape(-1, head_dim).float()
    groups = (head_dim + 127) // 128
    pad = torch.zeros(x.shape[0], groups * 128, dtype=torch.float32, device=x.device)
    pad[:, :head_dim] = torch.nan_to_num(x.abs(), nan=0.0)
    amax = pad.reshape(-1, groups, 128).amax(-1)
    scale = amax.clamp_min(1e-4) / _FP8_MAX
    if use_pow2:
        scale = _ue8m0(scale)
    per_dim = scale.repeat_interleave(128, dim=1)[:, :head_dim]
    q = (x / per_dim).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    cache = _Flat(op, "kv_cache", kv_cache, torch.uint8)
    cache.store(blk[:, None] * stride0 + row[:, None] * head_dim + dims, q)
    g = torch.arange(groups)
    scale_idx = (blk[:, None] * stride0 + block_size * head_dim
                 + torch.div((row[:, None] * head_dim + 128 * g) * 4, quant_block_size, rounding_mode="floor"))
    scale_byte = torch.div(scale_idx, 4, rounding_mode="floor") * 4
    if kv_cache_dtype == "mxfp8":
        exponent = (scale.contiguous().view(torch.int32) >> 23) & 0xFF
        scale_bytes = exponent.to(torch.uint8)[..., None].expand(*exponent.shape, 4)
    else:
        scale_bytes = scale.contiguous().view(torch.uint8).reshape(*scale.shape, 4)
    cache.store(scale_byte[..., None] + torch.arange(4), scale_bytes)


def cp_gather_indexer_k_quant_cache(kv_cache: torch.Tensor, dst_k: torch.Tensor, dst_scale: torch.Tensor,
                                    block_table: torch.Tensor, cu_seq_lens: torch.Tensor) -> None:
    """`cp_gather_indexer_k_quant_cache`: output token t = 0..dst_k.size(0)-1 belongs to the request b < B =
    block_table.size(0) with cu_seq_lens[b] <= t < cu_seq_lens[b+1] (none: t is left unwritten; several: the
    kernel races, the stand-in takes the last); its position p = t - cu_seq_lens[b] is read through
    block_table[b * block_table.size(1) + p // block_size] (the table read as dense rows of size(1), whatever its
    stride). head_dim = dst_k.size(1) bytes are copied from block*kv_cache.stride(0) + (p % block_size)*head_dim to
    dst_k's t*dst_k.stride(0); the scale (4 bytes, as read: fp32 or the "mxfp8" bytes) from the block's scale
    region at ((p % block_size)*head_dim)*4/quant_block_size, quant_block_size = head_dim*4 / dst_scale.size(1), to
    dst_scale's float (t*dst_k.stride(0)) / quant_block_size -- dst_k's row stride, not dst_scale's.

    A -1 or out-of-range block id reads outside kv_cache: recorded, the token left unwritten. 0 output tokens: an
    empty grid (raised, as the writer's). Not determined: the 0.33.0 commit's exact text (read: a 2026 version).
    """
    op = "cp_gather_indexer_k_quant_cache"
    batch_size, num_tokens, head_dim = block_table.shape[0], dst_k.shape[0], dst_k.shape[1]
    for name, t in (("dst_k", dst_k), ("dst_scale", dst_scale), ("block_table", block_table),
                    ("cu_seq_lens", cu_seq_lens)):
        _need(kv_cache.device == t.device, f"kv_cache and {name} must be on the same device")
    _need(dst_scale.shape[1] != 0, "integer division by zero (dst_scale.size(1) == 0)")
    quant_block_size = head_dim * 4 // dst_scale.shape[1]
    _need(quant_block_size != 0 and head_dim % quant_block_size == 0, "head_dim must be divisible by quant_block_size")
    for name, t in (("block_table", block_table), ("cu_seq_lens", cu_seq_lens)):
        _need(t.dtype == torch.int32, f"expected scalar type Int but found {t.dtype} ({name})")
    refuse_empty_grid(op, num_tokens)
    block_size, stride0 = kv_cache.shape[1], kv_cache.stride(0)
    cu = _Flat(op, "cu_seq_lens", cu_seq_lens).load(torch.arange(batch_size + 1), 0).long().cpu()
    t = torch.arange(num_tokens)
    inside = (cu[None, :-1] <= t[:, None]) & (t[:, None] < cu[None, 1:])  # [tokens, B]
    has = inside.any(1)
    batch = torch.where(has, batch_size - 1 - inside.flip(1).int().argmax(1), -1)
    t, batch = t[has], batch[has]
    if t.numel() == 0:
        return
    pos = t - cu[batch]
    blocks = _Flat(op, "block_table", block_table).load(
        batch * block_table.shape[1] + torch.div(pos, block_size, rounding_mode="floor"), -(2 ** 31)).long().cpu()
    in_block = pos % block_size
    src_row = blocks * stride0 + in_block * head_dim
    cache = _Flat(op, "kv_cache", kv_cache, torch.uint8)
    n_cache = cache.flat.numel()
    # A block id that sends the read outside the cache's storage faults on the GPU: nothing of that token lands.
    reach = (src_row + cache.base >= 0) & (src_row + cache.base + head_dim <= n_cache)
    dims = torch.arange(head_dim)
    values = cache.load(src_row[:, None] + dims, 0).reshape(-1, head_dim)
    token_stride = dst_k.stride(0) * dst_k.element_size()
    keep = reach.to(values.device)
    _Flat(op, "dst_k", dst_k, torch.uint8).store((t[reach, None] * token_stride + dims), values[keep])
    groups = (head_dim + 127) // 128
    g = torch.arange(groups) * 128
    src_scale = blocks[:, None] * stride0 + block_size * head_dim + torch.div(
        (in_block[:, None] * head_dim + g) * 4, quant_block_size, rounding_mode="floor")
    src_scale = torch.div(src_scale, 4, rounding_mode="floor") * 4
    scale = cache.load(src_scale[..., None] + torch.arange(4), 0).reshape(-1, groups, 4)
    dst_float = torch.div(t[:, None] * dst_k.stride(0) + g, quant_block_size, rounding_mode="floor")
    _Flat(op, "dst_scale", dst_scale, torch.uint8).store(
        (dst_float[reach] * 4)[..., None] + torch.arange(4), scale[keep])


def _order_keys(x: torch.Tensor) -> torch.Tensor:
    """The kernels' radix key of each fp32 score (convert_to_uint32: the smaller, the higher the score): +NaN ranks
    above +inf, -NaN below -inf, +0 above -0. int64 in [0, 2**32)."""
    bits = x.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    return torch.where(bits >= 0x80000000, bits, (~bits) & 0x7FFFFFFF)


_SELECT_CALLS = itertools.count()


def _select(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k highest scores in the kernels' order, highest first. Which of the scores equal to the k-th
    are taken is, in the kernels, the arrival order of shared-memory atomics (sampler.cu's processHistogramStep): it
    changes between calls on the same input. The stand-in takes them in an order drawn afresh for every call (from a
    count of calls, so a process repeats its choices), so code that needs two calls to agree on ties shows it."""
    order = torch.randperm(scores.numel(), generator=torch.Generator().manual_seed(next(_SELECT_CALLS)))
    composite = (_order_keys(scores) << 31) | order.to(scores.device)
    return torch.topk(composite, k, largest=False, sorted=True).indices


def _rows_topk(op: str, logits: _Flat, width: int, out: _Flat, out_stride: int, k: int, rows, stride1: int) -> None:
    """Per row r = (row, base, start, end): the scores at base + i*stride1 for i in [start, end), the k best written
    as i - start to out[row*out_stride ...]; a row of at most k positions writes start..end-1 as 0..len-1 without
    reading a score, then -1 up to k (from len, which may be negative: slots before the row)."""
    for r, base, start, end in rows:
        length = end - start
        dst = r * out_stride
        if length <= k:
            n = max(length, 0)
            out.store(dst + torch.arange(n), torch.arange(n, dtype=torch.int32))
            fill = torch.arange(length, k)
            if length < 0 and dst + length >= 0:  # inside indices but in the row before: _Flat cannot see it
                _violation(op, "indices", dst + length, out.extent, 4, "store", -length, True)
            out.store(dst + fill, torch.full((fill.numel(),), -1, dtype=torch.int32))
            continue
        cols = torch.arange(start, end)
        offs = base + cols * stride1
        # Past the logits' width but inside the tensor: the next row's scores (beyond the tensor, _Flat records it).
        outside_row = ((cols < 0) | (cols >= width)) & (offs >= 0) & (offs < logits.extent)
        if bool(outside_row.any()):
            first = int(outside_row.nonzero()[0])
            _violation(op, "logits", int(offs[first]), logits.extent, 4, "load", int(outside_row.sum()), True)
        scores = logits.load(offs, float("-inf"))
        best = _select(scores.float(), k).cpu()
        out.store(dst + torch.arange(k), best.to(torch.int32))


def _check_topk_dtypes(logits: torch.Tensor, indices: torch.Tensor, *ints: tuple[str, torch.Tensor]) -> None:
    _need(logits.dtype == torch.float32, f"expected scalar type Float but found {logits.dtype} (logits)")
    _need(indices.dtype == torch.int32, f"expected scalar type Int but found {indices.dtype} (indices)")
    for name, t in ints:
        _need(t.dtype == torch.int32, f"expected scalar type Int but found {t.dtype} ({name})")


def top_k_per_row_prefill(logits: torch.Tensor, rowStarts: torch.Tensor, rowEnds: torch.Tensor,
                          indices: torch.Tensor, numRows: int, stride0: int, stride1: int, topK: int) -> None:
    """`top_k_per_row_prefill`: row r < numRows scores logits[r*stride0 + i*stride1] for i in [rowStarts[r],
    rowEnds[r]) (the strides as passed; the row's width is not checked); indices[r*topK + j] (rows topK apart from
    the tensor's first element, whatever its stride) get the best topK as i - rowStarts[r], i.e. relative to the
    row's start. A row of at most topK positions gets 0..len-1 in order then -1; a longer one its topK best in no
    promised order (the stand-in writes them by descending score; ties: see _select). rowEnd < rowStart writes
    -1 from rowLen (< 0): into the previous row's tail (or before indices), recorded. 0 rows: an empty grid.
    NaN: ranked by bits (+NaN above +inf, -NaN below -inf), as the radix keys do."""
    op = "top_k_per_row_prefill"
    _check_topk_dtypes(logits, indices, ("rowStarts", rowStarts), ("rowEnds", rowEnds))
    refuse_empty_grid(op, numRows)
    starts = _Flat(op, "rowStarts", rowStarts).load(torch.arange(numRows), 0).long().tolist()
    ends = _Flat(op, "rowEnds", rowEnds).load(torch.arange(numRows), 0).long().tolist()
    rows = [(r, r * stride0, s, e) for r, (s, e) in enumerate(zip(starts, ends))]
    _rows_topk(op, _Flat(op, "logits", logits), logits.shape[1] if logits.dim() == 2 else 0,
               _Flat(op, "indices", indices), topK, topK, rows, stride1)


def top_k_per_row_decode(logits: torch.Tensor, next_n: int, seq_lens: torch.Tensor, indices: torch.Tensor,
                         numRows: int, stride0: int, stride1: int, topK: int) -> None:
    """`top_k_per_row_decode`: row r < numRows covers positions [0, end): a 2-D seq_lens (read flat) gives end =
    seq_lens[r], a 1-D one seq_lens[r // next_n] - next_n + r % next_n + 1, floored at 0; scores at
    logits[r*stride0 + i*stride1]; indices written as positions in the row (rowStart 0) at indices[r*topK + j];
    short rows 0..end-1 then -1; longer ones their topK
    best in no promised order (stand-in: descending score, ties: see _select). end past logits.size(1): the
    kernel reads past the row (the next row's scores, or past the tensor), recorded. The split-row path for
    >= 200,000 columns selects the same set. 0 rows: an empty grid."""
    op = "top_k_per_row_decode"
    _check_topk_dtypes(logits, indices, ("seqLens", seq_lens))
    _need(next_n > 0, "integer division by zero (next_n must be positive)")
    refuse_empty_grid(op, numRows)
    lens = _Flat(op, "seqLens", seq_lens)
    r = torch.arange(numRows)
    if seq_lens.dim() == 2:
        ends = lens.load(r, 0).long().cpu().clamp_min(0)
    else:
        ends = (lens.load(r // next_n, 0).long().cpu() - next_n + r % next_n + 1).clamp_min(0)
    rows = [(i, i * stride0, 0, int(e)) for i, e in enumerate(ends.tolist())]
    _rows_topk(op, _Flat(op, "logits", logits), logits.shape[1], _Flat(op, "indices", indices), topK, topK, rows,
               stride1)


def _workspace_topk(op: str, logits: torch.Tensor, lengths: torch.Tensor, output: torch.Tensor, k: int) -> None:
    """Host checks shared by persistent_topk and cooperative_topk (their order in the launchers), less "must be CUDA
    tensor" (the stand-ins also run on the CPU)."""
    _need(logits.dtype == torch.float32, "Only float32 supported")
    _need(lengths.dtype == torch.int32, "lengths must be int32")
    _need(output.dtype == torch.int32, "output must be int32")
    _need(logits.dim() == 2, "logits must be 2D")
    _need(lengths.dim() in (1, 2), "lengths must be 1D or 2D")
    _need(lengths.is_contiguous(), "lengths must be contiguous")
    _need(output.dim() == 2, "output must be 2D")
    num_rows = logits.shape[0]
    _need(lengths.numel() == num_rows, "lengths size mismatch")
    _need(output.shape[0] == num_rows and output.shape[1] == k, "output size mismatch")
    _need(k in (512, 1024, 2048), f"{op} supports k=512, k=1024, or k=2048, got k={k}")


def _run_workspace_topk(op: str, logits: torch.Tensor, lengths: torch.Tensor, output: torch.Tensor, k: int) -> None:
    ends = lengths.reshape(-1).long().cpu().clamp_min(0).tolist()
    stride = logits.stride(0)
    rows = [(r, r * stride, 0, e) for r, e in enumerate(ends)]
    _rows_topk(op, _Flat(op, "logits", logits), logits.shape[1], _Flat(op, "output", output), k, k, rows, 1)


def persistent_topk(logits: torch.Tensor, lengths: torch.Tensor, output: torch.Tensor, workspace: torch.Tensor,
                    k: int, max_seq_len: int) -> None:
    """`persistent_topk`: row r of logits (fp32, read at r*logits.stride(0) + i, unit column stride assumed) covers
    [0, lengths.flatten()[r]) -- per-row lengths, no next_n (vLLM expands draft rows itself); output[r*k + j] gets
    0..len-1 then -1 for a row of at most k, else its k best as positions in the row in no promised order
    (stand-in: descending score, ties: see _select). Lengths past the width read the next row, recorded.

    Not determined: persistent_topk.cuh's tie and NaN handling (modelled as top_k_per_row's radix keys), and whether
    max_seq_len clamps a row's length (vLLM's Python says it does; the FilteredTopK path taken above 32 rows never
    sees it): the stand-in does not clamp. 0 rows: nothing happens (the launcher still launches one group)."""
    op = "persistent_topk"
    _workspace_topk(op, logits, lengths, output, k)
    if logits.shape[0] > 32:
        pass  # FilteredTopKRaggedTransform: no workspace checks on this path
    else:
        _need(workspace.dtype == torch.uint8, "workspace must be uint8")
    _run_workspace_topk(op, logits, lengths, output, k)


COOPERATIVE_MAX_ROWS = 64


def cooperative_topk(logits: torch.Tensor, lengths: torch.Tensor, output: torch.Tensor, workspace: torch.Tensor,
                     k: int, max_seq_len: int) -> None:
    """`cooperative_topk`: persistent_topk's contract (max_seq_len unused: "kept for signature parity") with its
    refusals: more than 64 rows, k not 512/1024/2048, a row stride not a multiple of 4 (TMA's 16 bytes), a workspace
    that is not uint8. 0 rows: a (0, cluster) grid, whose launch fails ("cooperative_topk launch failed").
    Not determined: cooperative_topk.cuh's ties and NaN handling (modelled as the others); the tie workspace size
    check (its per-row entry size is not known here: not checked)."""
    op = "cooperative_topk"
    _workspace_topk(op, logits, lengths, output, k)
    num_rows, stride = logits.shape[0], logits.stride(0)
    _need(num_rows <= COOPERATIVE_MAX_ROWS,
          "cooperative_topk supports <=64 rows; use persistent_topk for larger batches")
    _need(stride % 4 == 0,
          f"cooperative_topk: stride must be multiple of 4 for TMA alignment, got stride (max_model_len)={stride}")
    _need(workspace.dtype == torch.uint8, "workspace must be uint8")
    _need(num_rows > 0, "cooperative_topk launch failed: invalid configuration argument")
    _run_workspace_topk(op, logits, lengths, output, k)
