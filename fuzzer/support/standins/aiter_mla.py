"""Stand-in for the AITER MLA decode ops vLLM's ROCM_AITER_MLA_SPARSE backend calls, on an emulated gfx950 (MI355X)
device: `aiter.get_mla_metadata_info_v1`, `aiter.get_mla_metadata_v1` (the persistent work plan), `aiter.mla.
mla_decode_fwd` (the paged MLA decode, persistent and split-KV), and `aiter.dtypes`. No attnfuzz host has an AMD GPU
or AITER (ROCm/aiter; vLLM 0.33.0 pins v0.1.21.post2, which the snapshot attnfuzz read lacks: its newest tag,
v0.1.20.post1, and main at e4048607 agree on every function below).

What each part was read from (ROCm/aiter):
- `aiter/ops/attention.py` `get_mla_metadata_info_v1`: the buffer shapes, copied for gfx950 (256 CUs, occupancy 1:
  `get_mla_decode_fwd_occupancy` without AITER's experimental kernels), and `get_mla_metadata_v1` (its docstring is
  the public contract of the plan: work_indptr per CU part; work_info 8 int32 a work item: bs_index, partial_index
  (-1: written straight to the output), q_start, q_end, kv_start, kv_end (page indices, here kv_indices positions:
  page_size 1), kv_offset; reduce_indptr grouping reduce_partial_map entries a final tile merges; reduce_final_map
  the tile's output rows). How the C++ planner (`csrc/kernels/mla/metadata/v1_2_device.cuh`) splits a batch and
  spreads work over CUs is not part of that contract: this planner splits a batch's KV range into pieces of at most
  `max(kv_granularity, ceil(len / max_split_per_batch))` entries (rounded to kv_granularity) while a global budget
  of `cu_num - 1` extra splits lasts, one tile a batch (every head), works dealt to CU parts in order, the
  reduce_indptr entries past the batch's tiles set to its end (empty groups: vLLM sizes the buffers for
  max_num_batched_tokens and the reduce reads every tile). Any split gives the same attention up to fp32 rounding:
  the merge is by LSE.
- `aiter/mla.py` `mla_decode_fwd`: its checks (`logit_cap <= 0`; the gfx950 persistent head dispatch: bf16 x bf16
  any head count, fp8 x fp8 16/32/64/128 heads, 48-112 folded onto 16-head tiles, else `assert False`) and
  semantics, with `op_tests/test_mla_sparse.py` (`torch_mla_extend`, `ref_masked_attention`) as the reference:
  batch b's queries qo_indptr[b]:qo_indptr[b+1] attend to cache rows kv_indices[kv_indptr[b]:kv_indptr[b+1]]
  (page_size 1), scores q.k x sm_scale (x q_scale x kv_scale for fp8), V the rows' first kv_lora_rank (512)
  elements (x kv_scale for fp8), causal within a batch (a one-token batch masks nothing), natural-log LSE. In
  persistent mode (work_meta_data given) the kernel reads the plan, not kv_indptr: each work item attends to
  kv_indices[kv_start:kv_end] for its q rows, into the output or a partial slot that the reduce
  (`mla_reduce_v1`) merges by LSE into reduce_final_map's rows. The ASM kernels quantize P to fp8 for an fp8 query
  (the reference's `attn_weights_exp.to(dtype)`); this stand-in computes in fp32 (the semantics, not that rounding).
- `aiter/utility/dtypes.py`: `fp8` is float8_e4m3fn on gfx950 (float8_e4m3fnuz on gfx942, not emulated).

NOT public, and said so in the result (`UNDOCUMENTED`) rather than guessed: a batch of no KV entries (the reference
gives NaN, 0/0; the output rows are left as they were here, and no LSE), and a plan whose CU parts hold work items
that a later call's kv_indptr no longer matches (the kernel follows the plan: so does this stand-in).

Refused (`StandInRefused`, could-not-test): page_size != 1, nhead_kv != 1, more than one query token a batch, CP
round robin, intra-batch mode, return_logits, a logit cap, an fp8 query over a bf16 cache (test_mla_sparse.py's
`check_support` says AITER has none), and dtypes other than bf16 and fp8.

Memory the kernel would reach outside its tensors (a kv_indices entry past the cache or below 0, a plan range past
kv_indices, a plan or partial index past its buffer) is recorded as a memory violation
(`fuzzer.support.interp.sanitizer`) and the entry skipped. `importable()` puts the stand-in up as `aiter`,
`aiter.mla` and `aiter.dtypes` for the span of a `with` block only.
"""

from __future__ import annotations

import contextlib
import math

import torch

from fuzzer.support.errors import StandInRefused
from fuzzer.support.interp.sanitizer import VIOLATIONS, MemoryViolation
from fuzzer.support.standins.importable import importable_as, stand_in_module

__version__ = "0.1.20.post1"  # what this stand-in follows (vLLM 0.33.0 pins 0.1.21.post2; see the docstring)
GFX, CU_NUM = "gfx950", 256  # MI355X
KERNEL = "aiter.mla.mla_decode_fwd (attnfuzz stand-in: AITER persistent MLA decode, gfx950)"
PLANNER = "aiter.get_mla_metadata_v1 (attnfuzz stand-in: AITER MLA work planner, gfx950)"
FP8 = torch.float8_e4m3fn
CHUNK_BYTES = 1 << 27

UNDOCUMENTED: list[tuple[str, list[int]]] = []


def _undocumented(what: str, rows) -> None:
    rows = rows.flatten().tolist() if isinstance(rows, torch.Tensor) else list(rows)
    UNDOCUMENTED.append((what, rows))


def _refuse(what: str) -> StandInRefused:
    return StandInRefused(f"attnfuzz's stand-in of AITER's MLA decode does not model {what} (vLLM's "
                          "ROCM_AITER_MLA_SPARSE backend never passes it)")


def _violation(kernel: str, argument: str, index: int, limit: int, elem_bytes: int, access: str = "load") -> None:
    VIOLATIONS.violations.append(MemoryViolation(
        kernel=kernel, op=access, argument=argument, byte_offset=index * elem_bytes, argument_bytes=limit * elem_bytes,
        element_bytes=elem_bytes, program_id=(0, 0, 0), lanes=1, inside_allocation=False))


# -- aiter.dtypes ------------------------------------------------------------------------------------------------

def _dtypes_module():
    module = stand_in_module("aiter.dtypes", False, __name__)
    names = dict(fp8=FP8, fp16=torch.float16, bf16=torch.bfloat16, fp32=torch.float32, i32=torch.int32,
                 u8=torch.uint8, i8=torch.int8, i64=torch.int64, u32=torch.uint32)
    for name, dtype in names.items():
        setattr(module, name, dtype)
    module.d_dtypes = dict(names)
    return module


# -- aiter/ops/attention.py ----------------------------------------------------------------------------------------

def get_mla_metadata_info_v1(batch_size, max_seqlen_qo, num_head_qo, q_dtype, kv_dtype, is_sparse, fast_mode=True,
                             num_kv_splits=32, intra_batch_mode=False, max_split_per_batch=-1):
    """aiter.get_mla_metadata_info_v1 for gfx950 (occupancy 1): the six buffers' (shape, dtype)."""
    assert num_head_qo % 8 == 0
    max_splits = CU_NUM  # get_mla_decode_fwd_max_splits: cu_num x occupancy
    effective_seqlen_qo = 1 if is_sparse else max_seqlen_qo
    packed_qo_len = effective_seqlen_qo * num_head_qo
    max_qo_tiles_per_batch = math.ceil(packed_qo_len / 16)
    bf16, fp8 = torch.bfloat16, FP8
    if (q_dtype == bf16 and kv_dtype == bf16 and packed_qo_len >= 64 and num_head_qo <= 64
            and (packed_qo_len < 128 or num_head_qo == 48)) or (
            q_dtype == fp8 and kv_dtype == fp8 and num_head_qo == 32 and effective_seqlen_qo == 3):
        max_qo_tiles_per_batch = (effective_seqlen_qo if num_head_qo * 2 > 64
                                  else math.ceil(packed_qo_len / 64))
    elif (num_head_qo == 16
          or (kv_dtype == fp8 and q_dtype == fp8 and ((num_head_qo == 32 and effective_seqlen_qo == 4)
                                                      or num_head_qo in (64, 128)))
          or (num_head_qo == 64 and q_dtype == fp8 and kv_dtype == fp8 and effective_seqlen_qo == 1)):
        max_qo_tiles_per_batch = math.ceil(packed_qo_len / 128)
    elif (packed_qo_len >= 128 or num_head_qo > 64) and kv_dtype == bf16 and q_dtype == bf16 and num_head_qo != 48:
        max_qo_tiles_per_batch = (effective_seqlen_qo if num_head_qo * 2 > 128
                                  else math.ceil(packed_qo_len / 128))
    batch_size = batch_size * max_seqlen_qo if is_sparse else batch_size
    tile_cnt = batch_size * max_qo_tiles_per_batch
    if fast_mode:
        max_work = (batch_size + max_splits - 1) * max_qo_tiles_per_batch
        max_split_tiles = min(batch_size + max_splits - 1, (max_splits - 1) * 2) * max_qo_tiles_per_batch
    else:
        max_work = max_split_tiles = tile_cnt * max_splits
    if max_split_per_batch > 0:
        per_tile_cap = min(max_splits, max_split_per_batch * batch_size)
        max_split_tiles = max(max_split_tiles, tile_cnt + per_tile_cap)
    if intra_batch_mode:
        raise _refuse("intra_batch_mode")
    return ((2, torch.uint64), (max_splits + 1, torch.int32), ((max_work, 8), torch.int32),
            (tile_cnt + 1, torch.int32), ((tile_cnt, 2), torch.int32), (max_split_tiles, torch.int32))


def get_mla_metadata_v1(seqlens_qo_indptr, seqlens_kv_indptr, kv_last_page_lens, num_heads_per_head_k, num_heads_k,
                        is_causal, work_metadata_ptrs, work_info_set, work_indptr, reduce_indptr, reduce_final_map,
                        reduce_partial_map, page_size=1, kv_granularity=16, max_seqlen_qo=-1, uni_seqlen_qo=-1,
                        fast_mode=True, topk=-1, max_split_per_batch=-1, intra_batch_mode=False,
                        is_cp_round_robin=False, mla_version=None, dtype_q_nope=None, dtype_q_rope=None,
                        dtype_kv_nope=None, dtype_kv_rope=None, dtype_q=None, dtype_kv=None):
    """aiter.get_mla_metadata_v1: the work plan in the documented layout (see the module docstring for what is this
    stand-in's own: the split points and the CU parts)."""
    if page_size != 1 or num_heads_k != 1:
        raise _refuse(f"page_size {page_size} / num_heads_k {num_heads_k} (sparse MLA: 1 and 1)")
    if intra_batch_mode or is_cp_round_robin:
        raise _refuse("intra_batch_mode or is_cp_round_robin")
    qo = seqlens_qo_indptr.cpu().long().tolist()
    kv = seqlens_kv_indptr.cpu().long().tolist()
    bs = len(qo) - 1
    if len(kv) < bs + 1:
        _violation(PLANNER, "seqlens_kv_indptr", len(kv), len(kv), 4)
        return
    if any(qo[b + 1] - qo[b] != 1 for b in range(bs)):
        raise _refuse("a batch of more than one query token (sparse MLA: one query token a batch)")
    budget = (min(CU_NUM, max_split_per_batch * bs) if max_split_per_batch > 0 else CU_NUM) - 1
    works, partials, tiles = [], [], []  # works: 8 ints; tiles: (first partial, end partial, q_start, q_end)
    for b in range(bs):
        start, end = kv[b], kv[b + 1]
        length = max(0, end - start)
        cap = max_split_per_batch if max_split_per_batch > 0 else CU_NUM
        piece = max(kv_granularity, -(-length // cap))
        piece = -(-piece // kv_granularity) * kv_granularity
        pieces = max(1, -(-length // piece))
        pieces = min(pieces, 1 + budget)
        budget -= pieces - 1
        if pieces == 1:
            works.append([b, -1, qo[b], qo[b + 1], start, end, 0, 0])
            tiles.append((len(partials), len(partials), qo[b], qo[b + 1]))
            continue
        first = len(partials)
        bounds = [start + min(length, i * -(-length // pieces)) for i in range(pieces + 1)]
        for i in range(pieces):
            works.append([b, len(partials), qo[b], qo[b + 1], bounds[i], bounds[i + 1], end - bounds[i + 1], 0])
            partials.append(len(partials))
        tiles.append((first, len(partials), qo[b], qo[b + 1]))
    for name, have, need in (("work_info_set", work_info_set.shape[0], len(works)),
                             ("reduce_partial_map", reduce_partial_map.shape[0], len(partials)),
                             ("reduce_final_map", reduce_final_map.shape[0], len(tiles)),
                             ("reduce_indptr", reduce_indptr.shape[0], len(tiles) + 1)):
        if need > have:  # the planner writes past a buffer vLLM sized with get_mla_metadata_info_v1
            _violation(PLANNER, name, have, have, 4, "store")
            return
    parts = work_indptr.shape[0] - 1
    per = -(-len(works) // parts) if works else 0
    work_indptr.copy_(torch.tensor([min(len(works), i * per) for i in range(parts + 1)], dtype=torch.int32))
    if works:
        work_info_set[: len(works)] = torch.tensor(works, dtype=torch.int32)
    reduce_indptr[: len(tiles) + 1] = torch.tensor([0] + [t[1] for t in tiles], dtype=torch.int32)
    reduce_indptr[len(tiles) + 1:] = len(partials)  # the tiles past the batch's: empty groups, the reduce merges none
    if tiles:
        reduce_final_map[: len(tiles)] = torch.tensor([[t[2], t[3]] for t in tiles], dtype=torch.int32)
    if partials:
        reduce_partial_map[: len(partials)] = torch.tensor(partials, dtype=torch.int32)
    # The first 64-bit words: where work_indptr and work_info start (the kernel's pointers).
    work_metadata_ptrs.view(torch.int64)[:2] = torch.tensor([work_indptr.data_ptr(), work_info_set.data_ptr()])
    # What the plan was made for: the kernel follows the plan, not a later kv_indptr (UNDOCUMENTED if they differ).
    _PLANS[work_info_set.data_ptr()] = (len(works), len(tiles), seqlens_kv_indptr[: bs + 1].clone())


_PLANS: dict[int, tuple[int, int, torch.Tensor]] = {}


# -- aiter/mla.py ----------------------------------------------------------------------------------------------------

def mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, page_size=1,
                   nhead_kv=1, sm_scale=None, logit_cap=0.0, num_kv_splits=None, num_kv_splits_indptr=None,
                   work_meta_data=None, work_indptr=None, work_info_set=None, reduce_indptr=None,
                   reduce_final_map=None, reduce_partial_map=None, q_scale=None, kv_scale=None,
                   intra_batch_mode=False, return_logits=False, return_lse=False, g_kv_indptr=None, cp_world_size=1,
                   cp_rank=0, causal=True):
    """aiter.mla.mla_decode_fwd on gfx950 (see the module docstring). Returns (logits, final_lse)."""
    assert logit_cap <= 0, f"{logit_cap=} is not support yet"
    if page_size != 1 or nhead_kv != 1 or max_seqlen_q != 1:
        raise _refuse(f"page_size {page_size}, nhead_kv {nhead_kv}, max_seqlen_q {max_seqlen_q} (sparse MLA: 1, 1, 1)")
    if cp_world_size != 1 or intra_batch_mode or return_logits:
        raise _refuse("CP round robin, intra_batch_mode or return_logits")
    if q.dtype not in (torch.bfloat16, FP8) or kv_buffer.dtype not in (torch.bfloat16, FP8):
        raise _refuse(f"query {q.dtype} over a {kv_buffer.dtype} cache")
    if q.dtype == FP8 and kv_buffer.dtype != FP8:
        raise _refuse("an fp8 query over a bf16 cache (test_mla_sparse.py check_support: no such AITER kernel)")
    _, _, _, head_dim = kv_buffer.shape
    if sm_scale is None:
        sm_scale = 1.0 / (head_dim ** 0.5)
    total_s, nhead, v_head_dim = o.shape
    persistent = work_meta_data is not None
    fp8 = q.dtype == FP8
    if persistent and not (kv_buffer.dtype == torch.bfloat16 or nhead in (16, 32, 64, 128)
                           or (nhead in range(32, 129, 16))):
        raise AssertionError(f"nhead={nhead} and max_seqlen_qo={max_seqlen_q} not supported")
    scale = float(sm_scale)
    v_scale = 1.0
    if fp8:
        qs = float(q_scale.view(-1)[0]) if q_scale is not None else 1.0
        ks = float(kv_scale.view(-1)[0]) if kv_scale is not None else 1.0
        scale *= qs * ks
        v_scale = ks
    elif kv_buffer.dtype == FP8:
        v_scale = float(kv_scale.view(-1)[0]) if kv_scale is not None else 1.0
        scale *= v_scale
    rows = kv_buffer.reshape(-1, head_dim)
    indices = kv_indices.long()
    final_lse = torch.full((total_s, nhead), float("nan"), dtype=torch.float32, device=q.device) if return_lse else None
    qf = q.float()
    if persistent:
        items = _plan_items(work_indptr, work_info_set, reduce_indptr, reduce_final_map, reduce_partial_map, kv_indptr,
                            indices.numel(), total_s)
        outputs = {}
        for b, partial, q0, q1, k0, k1 in items:
            outputs[(b, partial)] = (q0, q1, *_attend_range(qf[q0:q1], rows, indices[k0:k1], scale, v_head_dim))
        for b, partial, q0, q1, k0, k1 in items:
            if partial < 0:
                q0, q1, out, lse = outputs[(b, partial)]
                _write(o, final_lse, q0, q1, out, lse, v_scale, b, k1 - k0)
        for q0, q1, group in _reduce_groups(reduce_indptr, reduce_final_map, reduce_partial_map, items):
            if not 0 <= q0 <= q1 <= total_s:
                _violation("aiter mla_reduce_v1 (attnfuzz stand-in)", "o", q1, total_s, 1, "store")
                continue
            parts = [outputs[key][2:] for key in group]
            lse = torch.logsumexp(torch.stack([p[1] for p in parts]), 0)
            weights = [torch.exp(p[1] - lse).nan_to_num(0.0) for p in parts]
            out = sum(w[..., None] * p[0] for w, p in zip(weights, parts))
            _write(o, final_lse, q0, q1, out, lse, v_scale, group[0][0], 1 if torch.isfinite(lse).all() else 0)
    else:
        ptr = kv_indptr.long().cpu().tolist()
        qo = qo_indptr.long().cpu().tolist()
        for b in range(len(qo) - 1):
            k0, k1 = ptr[b], ptr[b + 1]
            if k1 > indices.numel():
                _violation(KERNEL, "kv_indices", k1 - 1, indices.numel(), 4)
                k1 = indices.numel()
            out, lse = _attend_range(qf[qo[b]:qo[b + 1]], rows, indices[k0:max(k0, k1)], scale, v_head_dim)
            _write(o, final_lse, qo[b], qo[b + 1], out, lse, v_scale, b, max(0, k1 - k0))
    return None, final_lse


def _write(o, final_lse, q0, q1, out, lse, v_scale, batch, length) -> None:
    if length <= 0:
        _undocumented("a batch of no KV entries: AITER's output for it is not public (left as it was)", [batch])
        return
    o[q0:q1] = (out * v_scale).to(o.dtype)
    if final_lse is not None:
        final_lse[q0:q1] = lse


def _plan_items(work_indptr, work_info_set, reduce_indptr, reduce_final_map, reduce_partial_map, kv_indptr,
                num_indices: int, total_s: int):
    """The plan's work items the kernel runs, each (batch, partial slot or -1, q_start, q_end, kv_start, kv_end),
    bounds-checked against kv_indices, the output and the partial buffer."""
    plan = _PLANS.get(work_info_set.data_ptr())
    if plan is not None and not torch.equal(plan[2].to(kv_indptr.device), kv_indptr[: plan[2].numel()]):
        _undocumented("a plan (get_mla_metadata_v1) made for another kv_indptr than the call's: the kernel follows the "
                      "plan", [])
    ends = work_indptr.long().cpu()
    count = int(ends[-1])
    if count > work_info_set.shape[0]:
        _violation(KERNEL, "work_info_set", count * 8 - 1, work_info_set.numel(), 4)
        count = work_info_set.shape[0]
    items = []
    for b, partial, q0, q1, k0, k1, _offset, _pad in work_info_set[:count].long().cpu().tolist():
        if not (0 <= q0 <= q1 <= total_s):
            _violation(KERNEL, "o", q1, total_s, 1, "store")
            continue
        if partial >= reduce_partial_map.shape[0]:
            _violation(KERNEL, "reduce_partial_map", partial, reduce_partial_map.shape[0], 4)
            continue
        if k0 < 0 or k1 > num_indices:
            _violation(KERNEL, "kv_indices", max(k1 - 1, k0), num_indices, 4)
            k0, k1 = max(k0, 0), min(k1, num_indices)
        items.append((b, partial, q0, q1, k0, max(k0, k1)))
    return items


def _reduce_groups(reduce_indptr, reduce_final_map, reduce_partial_map, items):
    """mla_reduce_v1: per tile, the partial slots reduce_partial_map[reduce_indptr[t]:reduce_indptr[t+1]] merged
    into the rows reduce_final_map[t] names."""
    by_slot = {partial: (b, partial) for b, partial, *_ in items if partial >= 0}
    ptr = reduce_indptr.long().cpu().tolist()
    finals = reduce_final_map.long().cpu().tolist()
    slots = reduce_partial_map.long().cpu().tolist()
    groups = []
    for t in range(min(len(ptr) - 1, len(finals))):
        if ptr[t + 1] <= ptr[t]:
            continue
        group = [by_slot[s] for s in slots[ptr[t]:ptr[t + 1]] if s in by_slot]
        if group:
            groups.append((finals[t][0], finals[t][1], group))
    return groups


def _attend_range(q: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor, scale: float, v_dim: int):
    """q [n, H, D] (fp32) over cache rows `idx` (bounds-checked: an index outside the cache is a violation and
    left out). Returns (out [n, H, v_dim] fp32, natural LSE [n, H]; -inf, out 0 for no entry)."""
    n, heads, _ = q.shape
    bad = (idx < 0) | (idx >= rows.shape[0])
    for i in idx[bad][:4].tolist():
        _violation(KERNEL, "kv_buffer", i * rows.shape[1], rows.numel(), rows.element_size())
    idx = idx[~bad]
    if idx.numel() == 0:
        return (torch.zeros(n, heads, v_dim, device=q.device),
                torch.full((n, heads), -math.inf, device=q.device))
    keys = rows[idx].float()
    s = torch.einsum("nhd,ed->nhe", q, keys) * scale
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("nhe,ed->nhd", torch.softmax(s, -1), keys[:, :v_dim])
    return out, lse


@contextlib.contextmanager
def importable():
    """`aiter` (get_mla_metadata_info_v1, get_mla_metadata_v1, dtypes), `aiter.mla` (mla_decode_fwd) and
    `aiter.dtypes` importable inside the block, and only there."""
    top, mla, dtypes = (stand_in_module("aiter", True, __name__), stand_in_module("aiter.mla", False, __name__),
                        _dtypes_module())
    top.get_mla_metadata_info_v1, top.get_mla_metadata_v1 = get_mla_metadata_info_v1, get_mla_metadata_v1
    top.dtypes, top.mla, top.__version__ = dtypes, mla, __version__
    mla.mla_decode_fwd = mla_decode_fwd
    with importable_as({"aiter": top, "aiter.mla": mla, "aiter.dtypes": dtypes}):
        yield top
