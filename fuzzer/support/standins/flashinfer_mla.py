"""Stand-in for FlashInfer's `flashinfer.mla.BatchMLAPagedAttentionWrapper`: the part vLLM's FLASHINFER_MLA_SPARSE_SM90
backend uses, as flashinfer-python 0.7.2.post1 (the release vLLM 0.33.0 pins; the SM90 fp8 path is there from
0.6.18) has it with `backend="fa3"` on an SM90 device.

FlashInfer is a JIT library (62 MB of Python and CUDA sources, compiled with nvcc at first use) that no attnfuzz host
installs. This module follows its source, not its documentation alone: the wrapper (`flashinfer/mla/_batch_mla/
_wrapper.py`), the fa3 backend's planning and checks (`_backends/fa3_backend.py`, `_backends/_fa_common.py`,
`_planning.py`, `_contracts.py`), the host planner `MLAPlan` (`include/flashinfer/attention/scheduler.cuh`, called by
`csrc/batch_mla_sm90_plan.cu`) and the Hopper kernel (`include/flashinfer/attention/mla_hopper.cuh`, launched by
`csrc/batch_mla_sm90_run.cu`; its merge stage `DevicePersistentMergeStates` in `mla.cuh`, `state_t` in `state.cuh`).

What vLLM touches: the constructor (a 128 MiB float workspace, `use_cuda_graph=True` with reserved `qo_indptr`,
`kv_indptr`, `kv_indices`, `kv_len_arr` buffers), `plan()` in its legacy flat-CSR positional form, the plan's
`_plan_info` (18 ints, `MLAPlanInfo`) and `_planned_backend._int_workspace_buffer`, in which vLLM reads the planner's
per-work arrays and rewrites `kv_end` in place, and `run(q_nope, q_pe, ckv_cache, kpe_cache, ckv_scale=, kpe_scale=)`
(`ckv_scale_arr` keyword-only, which vLLM's `has_flashinfer_sm90_nope_mla` inspects for). That is the form modelled;
any other (another backend, no graph mode, `plan(metadata=)`, an LSE mode, run()'s `out`, `lse`, `return_lse`,
`ckv_scale_arr`, the `query=`/`kv_cache=` form, sinks, BMM scales, ...) is refused (`StandInRefused`: could not test).

The planner (`MLAPlan`) as FlashInfer lays it out: every batch row's packed query rows (query tokens x heads) in tiles
of 64 x cluster size (2 CTAs a cluster when the batch's average packed query length passes 64, else 1), a KV split
limit from the batch's total KV length over the clusters, each (tile, KV chunk) a work item given to the cheapest
cluster of a min-heap (libstdc++'s heap, as the C++ builds it); split tiles write partial outputs that a merge stage
combines. The per-work arrays (`q_indptr`, `kv_indptr`, `partial_indptr`, `q_len`, `kv_len`, `q_start`, `kv_start`,
`kv_end`, each 16,384 int32 wide, and `work_indptr` per cluster) and the merge arrays (one entry per SM) are staged in
a fresh host buffer (left unwritten past what the plan writes: here 0xFF bytes, -1) and copied to the int workspace at
FlashInfer's 16-byte aligned offsets. The emulated device is an SM90 of 132 SMs on a CPU (an H100/H200 SXM); on a
GPU, the device's own SM count.

The kernel, per work item and CTA of its cluster: query rows `q_start + 64 x blockIdx.x + j` of its tile (row
`packed // heads`, head `packed % heads`; rows at or past `q_len` neither read nor written), keys of KV positions
`kv_start` up to `kv_end` in 64-wide tiles. A tile position below `kv_len` (the planned length of the work's batch row)
reads its page from `kv_indices[kv_indptr + pos]` (page size 1 in vLLM's use: the page is the cache row); past it, the
highest tile loads zeros and lower tiles page 0. Positions at or past `kv_end` are masked (their rows are still read:
`kv_indices` entries and cache rows up to `kv_len`). An fp8 (e4m3) cache is dequantized in the kernel as
bf16(bf16(x) * bf16(scale)): `ckv_scale` for the latent, `kpe_scale` for the RoPE part.
Scores (q_nope.ckv + q_pe.kpe) x sm_scale, softmax, P.ckv, in fp32 here; a work with no key gives output 0 and LSE -inf.
Unsplit works write `out` (bf16) directly; split ones write partial outputs (bf16) and LSEs (fp32) into the float
workspace at the plan's offsets, which the merge stage combines by LSE (base 2) into `out` (an all-empty merge: 0).
Rows of `out` no work writes are left as they were: a fresh `out` here is NaN (FlashInfer's `torch.empty_like`:
undefined).

Checks, as FlashInfer makes them: the plan's CSR metadata (int32, rank 1, indptrs from 0 and nondecreasing, one
kv_len per batch row, page counts matching kv_len, enough kv_indices), the graph-mode reserved buffers (same shapes,
no overlap), dtypes and head widths (fp8 KV only with bf16 q, ckv 512 and kpe 0 or 64, on SM90), the work-item
capacity (16,384); at run, the planned dtypes and widths, and the fp8 scale arguments (a finite positive `ckv_scale`
and `kpe_scale`; none for a bf16 cache). A run before any plan raises. Memory the
kernel would reach outside its tensors (a `kv_indices` entry past the buffer, a page outside the cache, a query or
output row past `q_nope`/`out`, a partial row past the workspace's partial buffer) is recorded as a memory violation
(`fuzzer.support.interp.sanitizer`) and skipped.

Under an emulated CUDA graph (`fuzzer.support.cudagraphs`, a CPU's replay calls the forward again) the launch's host
parameters are what the capture saw: the plan info (grid: `num_blks_x` x `num_blks_y`, array offsets) and the tensors
it pointed at, as a captured kernel launch keeps them; the arrays' contents are read at replay.

`importable()` puts this module up as `flashinfer.mla` (and an empty `flashinfer`) for the span of a `with` block:
vLLM's builder imports the wrapper in its constructor, and nothing else of vLLM should see a FlashInfer it does not
have (`vllm.utils.flashinfer.has_flashinfer` caches what it finds).
"""

from __future__ import annotations

import collections
import contextlib
import math
import struct
import warnings
from dataclasses import dataclass

import torch

from fuzzer.support import cudagraphs
from fuzzer.support.errors import StandInRefused, _BackendPlanUnsupportedError
from fuzzer.support.interp.sanitizer import VIOLATIONS, MemoryViolation
from fuzzer.support.standins.importable import importable_as, stand_in_module

__version__ = "0.7.2.post1"  # what this stand-in follows
OP = "BatchMLAPagedAttentionWrapper (attnfuzz stand-in)"
EMULATED_SMS = 132  # an H100/H200 SXM: the SM90 device a CPU run emulates
CTA_TILE_Q = CTA_TILE_KV = 64
MAX_WORKS = 16384  # scheduler.cuh: max_total_num_works
INT_WORKSPACE_BYTES = 8 * 1024 * 1024
PLAN_INFO_FIELDS = ("num_blks_x", "num_blks_y", "q_indptr", "kv_indptr", "partial_indptr", "merge_packed_offset_start",
                    "merge_packed_offset_end", "merge_partial_packed_offset_start", "merge_partial_packed_offset_end",
                    "merge_partial_stride", "q_len", "kv_len", "q_start", "kv_start", "kv_end", "work_indptr",
                    "partial_o", "partial_lse")
_FIELD = {name: i for i, name in enumerate(PLAN_INFO_FIELDS)}
WORK_FIELDS = PLAN_INFO_FIELDS[2:5] + PLAN_INFO_FIELDS[10:15]  # the per-work arrays, in a work item's order
MERGE_FIELDS = PLAN_INFO_FIELDS[5:10]  # the merge arrays (one entry per SM)
CSR = ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr")  # plan()'s metadata, and the graph-mode reserved buffers
_KV_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)
LOG2E = 1.0 / math.log(2.0)
# Bytes of fp32 keys and scores emulated at once (works x positions x (width + the CTA rows' scores)): a CPU
# campaign's workers share a small host's memory; on a GPU each chunk costs launches, so a 512-token step takes few.
CHUNK_BYTES = {"cpu": 64 << 20, "cuda": 1 << 30}


def _violation(argument: str, index: int, limit: int, elem_bytes: int, access: str = "load", inside: bool = False):
    VIOLATIONS.violations.append(MemoryViolation(
        kernel=OP, op=access, argument=argument, byte_offset=index * elem_bytes, argument_bytes=limit * elem_bytes,
        element_bytes=elem_bytes, program_id=(0, 0, 0), lanes=1, inside_allocation=inside))


def _report(pending: list[tuple]) -> None:
    """The launch's out-of-range accesses, (argument, bad, index, limit, element bytes, access) each, found on the
    device as it runs: reported at its end, in the order the kernel reaches them, one host sync for all of them."""
    hits = torch.stack([bad.any() for _, bad, *_ in pending]).tolist() if pending else []
    for hit, (argument, bad, index, limit, elem_bytes, access) in zip(hits, pending):
        for i in index[bad].flatten().tolist()[:4] if hit else ():  # the first few name the bug
            _violation(argument, int(i), limit, elem_bytes, access)


def _check(error: type, *checks: tuple[object, str]) -> None:
    """FlashInfer's checks in their order: raises `error` with the message of the first (failed, message) that failed
    (every condition and message is evaluated first: each must be safe to evaluate whatever an earlier one found)."""
    for failed, message in checks:
        if failed:
            raise error(message)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _f32(x: float) -> float:
    """The value as a C++ float holds it (the planner's costs are floats)."""
    return struct.unpack("f", struct.pack("f", x))[0]


# -- the planner: scheduler.cuh MLAPlan ---------------------------------------------------------------------------
# flashinfer/attention/heap.h's MinHeap of (cluster, cost) over std::push_heap / std::pop_heap with `a.cost > b.cost`,
# done as libstdc++ does (`__push_heap`, `__adjust_heap`), so that ties go to the cluster the C++ picks.

def _heap_sift_up(h: list, hole: int, value: tuple) -> None:  # __push_heap, from `hole` up to the top
    while hole > 0 and h[parent := (hole - 1) // 2][1] > value[1]:
        h[hole], hole = h[parent], parent
    h[hole] = value


def _heap_pop(h: list) -> tuple:  # std::pop_heap (__adjust_heap over [0, length)), then pop_back
    if len(h) > 1:
        value, h[-1] = h[-1], h[0]
        length, hole, child = len(h) - 1, 0, 0
        while child < (length - 1) // 2:
            child = 2 * (child + 1)
            child -= h[child][1] > h[child - 1][1]
            h[hole], hole = h[child], child
        if length % 2 == 0 and child == (length - 2) // 2:
            child = 2 * (child + 1)
            h[hole], hole = h[child - 1], child - 1
        _heap_sift_up(h, hole, value)
    return h.pop()


def _schedule(q_lens: list[int], kv_lens: list[int], num_heads: int, num_sm: int, causal: bool):
    """What MLAPlan (and the wrapper's preflight, alike) derives first: the cluster size (2 CTAs where the batch's
    average packed query length passes 64), the clusters, a cluster tile's rows, each batch row's KV length per query
    tile (causal: packed_causal_kv_end, but the last tile's) and the KV split limit from their total over the
    clusters."""
    cluster = 2 if sum(q * num_heads for q in q_lens) // len(q_lens) > 64 else 1
    tile_q = cluster * CTA_TILE_Q
    tiles = [[kv if not causal or t + 1 == n else max(min(kv - q + _ceil_div((t + 1) * tile_q, num_heads), kv), 0)
              for t in range(n)] for q, kv in zip(q_lens, kv_lens) for n in [_ceil_div(q * num_heads, tile_q)]]
    clusters = num_sm // cluster
    x = max(_ceil_div(sum(map(sum, tiles)), clusters), 1)
    limit = 32 if x <= 8 else 64 if x <= 16 else 128 if x <= 32 else 192 if x <= 64 else _ceil_div(x, 256) * 256
    return cluster, clusters, tile_q, tiles, limit


def _aligned(sizes: dict[str, int], space: int) -> tuple[dict[str, int], int]:
    """flashinfer/allocator.h's AlignedAllocator, 16-byte aligned, offsets only: ({name: offset}, bytes used)."""
    offsets, used = {}, 0
    for name, size in sizes.items():
        offsets[name] = start = _ceil_div(used, 16) * 16
        if start + size > space:
            raise RuntimeError(f"Buffer overflow when allocating memory for mla_{name} with size {size} and alignment "
                               f"16, but only {space - used} bytes available in AlignedAllocator. Increase the "
                               "workspace buffer size.")
        used = start + size
    return offsets, used


# What MLAPlan returns and stages: the plan info, the host copy of the int workspace's first bytes (uint8), the work
# items, and the CTAs that merge tiles split over KV chunks (0: no split).
Plan = collections.namedtuple("Plan", "info staged works merge_ctas")


def mla_plan(qo_indptr: list[int], kv_indptr: list[int], kv_len: list[int], num_heads: int, head_dim_o: int,
             causal: bool, num_sm: int, int_workspace_bytes: int, float_workspace_bytes: int) -> Plan:
    """MLAPlan (its checks that no qo length is negative and that the works fit: the wrapper's, first)."""
    q_lens = [qo_indptr[i + 1] - qo_indptr[i] for i in range(len(kv_len))]
    cluster_size, num_clusters, cluster_tile_q, row_tiles, limit = _schedule(q_lens, kv_len, num_heads, num_sm, causal)
    heap, clusters = [(i, 0.0) for i in range(num_clusters)], [[] for _ in range(num_clusters)]
    merges, partial_nnz = [], 0  # merges: a merge CTA's MERGE_FIELDS
    for i, (qo_len, kv, remainings) in enumerate(zip(q_lens, kv_len, row_tiles)):
        for tile in range(len(remainings) - 1, -1, -1):
            remaining = remainings[tile]
            split, row_tile = remaining > limit, min(cluster_tile_q, qo_len * num_heads - tile * cluster_tile_q)
            if split:
                row_chunk = _ceil_div(row_tile, max(remaining * cluster_size // limit, 1))
                base = qo_indptr[i] * num_heads + tile * cluster_tile_q
                for offset in range(0, row_tile, row_chunk):
                    if len(merges) >= num_sm:  # the C++ writes past its vectors here, then its check fails
                        raise RuntimeError("Internal Error: merge_cta_counter should be less than or equal to num_sm, "
                                           "please report this bug to the developers")
                    merges.append((base + offset, base + min(offset + row_chunk, row_tile), partial_nnz + offset,
                                   partial_nnz + _ceil_div(remaining, limit) * row_tile, row_tile))
            for kv_start in range(0, max(remaining, 1), limit):  # KV chunks of the tile (an empty tile: one work)
                cluster, cost = _heap_pop(heap)
                actual = min(remaining - kv_start, limit)
                heap.append(value := (cluster, _f32(cost + _f32(2.0 * cluster_tile_q + actual))))
                _heap_sift_up(heap, len(heap) - 1, value)
                clusters[cluster].append((qo_indptr[i], kv_indptr[i], partial_nnz if split else -1, qo_len, kv,
                                          tile * cluster_tile_q, kv_start, kv_start + actual))
                partial_nnz += row_tile if split else 0
    works = [w for c in clusters for w in c]
    offsets, used = _aligned({name: 4 * (num_sm if name in MERGE_FIELDS else MAX_WORKS)
                              for name in PLAN_INFO_FIELDS[2:16]}, int_workspace_bytes)  # MLAPlanInfo's order
    # The host staging buffer is a fresh allocation each plan (FlashInfer's pinned buffer of a new backend object):
    # what the plan leaves unwritten is undefined there, and copied to the device with the rest.
    staged = torch.full((used // 4,), -1, dtype=torch.int32)
    merge_ctas, merges = len(merges), merges + [(0,) * len(MERGE_FIELDS)] * (num_sm - len(merges))
    arrays = {**dict(zip(WORK_FIELDS, zip(*works))), **dict(zip(MERGE_FIELDS, zip(*merges))),
              "work_indptr": [sum(len(c) for c in clusters[:k]) for k in range(num_clusters + 1)]}
    for name, values in arrays.items():
        staged[offsets[name] // 4: offsets[name] // 4 + len(values)] = torch.tensor(values, dtype=torch.int32)
    partial_rows = 2 * num_clusters * cluster_tile_q
    floats, _ = _aligned({"partial_o": partial_rows * 2 * head_dim_o, "partial_lse": partial_rows * 4},
                         float_workspace_bytes)
    info = [cluster_size, num_clusters] + [{**offsets, **floats}[name] for name in PLAN_INFO_FIELDS[2:]]
    return Plan(info, staged.view(torch.uint8), len(works), merge_ctas)


# -- the wrapper's checks (_planning.py, _fa_common.py) -----------------------------------------------------------

def _validate_csr(csr: tuple, page_size: int, device: torch.device):
    """_planning.py's flat CSR checks (each tensor, then the indptrs, then their agreement); returns the host lists."""
    for name, t in zip(CSR, csr):
        _check(ValueError, (not isinstance(t, torch.Tensor), f"{name} metadata must be a torch.Tensor."))
        _check(ValueError, (t.ndim != 1, f"{name} metadata must be rank-1, got shape {tuple(t.shape)}."),
               (t.dtype != torch.int32, f"{name} metadata must have dtype torch.int32, got {t.dtype}."),
               (t.device.type != "cpu" and t.device != device,
                f"{name} metadata must be on CPU or wrapper device {device}, got {t.device}."),
               (not t.is_contiguous(), f"{name} metadata must be contiguous."))
    for name, t in zip(CSR, csr[:2]):
        _check(ValueError, (t.numel() == 0, f"{name} metadata must contain at least one element."))
        values = t.cpu().long()
        _check(ValueError, (int(values[0]) != 0, f"{name} metadata must start at zero."),
               (bool((values[1:] < values[:-1]).any()), f"{name} metadata must be nondecreasing."))
    qo, kv, lens, n_indices = csr[0].tolist(), csr[1].tolist(), csr[3].tolist(), csr[2].numel()
    _check(ValueError, (len(kv) != len(qo) or len(lens) != len(qo) - 1,
                        (f"CSR metadata batch dimensions must agree: qo_indptr describes {len(qo) - 1}, kv_indptr "
                         f"describes {len(kv) - 1}, and kv_len_arr has {len(lens)} entries.")),
           (kv[-1] > n_indices, f"kv_indices metadata has {n_indices} entries but kv_indptr[-1] is {kv[-1]}."),
           (any(n < 0 for n in lens), "kv_len_arr metadata must be nonnegative."),
           ([_ceil_div(n, page_size) for n in lens] != [kv[i + 1] - kv[i] for i in range(len(kv) - 1)],
            "CSR metadata page counts in kv_indptr must equal ceil(kv_len_arr / page_size)."))
    return qo, kv, lens


def _storage_span(t: torch.Tensor) -> tuple[int, int, int]:
    start = t.storage_offset() * t.element_size()
    return t.untyped_storage().data_ptr(), start, start + t.numel() * t.element_size()


def _overlap(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
    return a[0] == b[0] and max(a[1], b[1]) < min(a[2], b[2])


def _validate_graph_buffers(device, named) -> None:
    """_fa_common.py `_validate_graph_metadata_buffers` over (name, reserved, source, may be larger): reserved buffers
    of the sources' shapes, int32, contiguous, on the device, none overlapping another, no source overlapping
    another's target."""
    for name, reserved, source, larger in ((n, r, s, a) for n, r, s, a in named if r is not None):
        _check(ValueError, *((failed, f"CUDA graph reserved {name} buffer {what}.") for failed, what in (
            (reserved.dtype != torch.int32, "must have dtype torch.int32"),
            (reserved.device != device, f"must be on {device}"),
            (not reserved.is_contiguous(), "must be contiguous"),
            (name == "kv_indices" and reserved.ndim != 1, "must have rank 1"),
            (reserved.shape[:1] < source.shape[:1] if larger else reserved.shape != source.shape,
             "has insufficient or incompatible capacity"))))
    spans = [(name, _storage_span(r)) for name, r, _, _ in named if r is not None]
    for k, (a, span_a) in enumerate(spans):
        for b, span_b in spans[k + 1:]:
            _check(ValueError, (_overlap(span_a, span_b),
                                f"CUDA graph reserved metadata buffers must not overlap: {a} overlaps {b}."))
    targets = {name: _storage_span(r[: s.shape[0]] if larger else r) for name, r, s, larger in named if r is not None}
    for (source_name, _, source, _), (target_name, target) in ((n, t) for n in named for t in targets.items()):
        span = _storage_span(source)
        _check(ValueError, (_overlap(span, target) and not (source_name == target_name and span == target),
                            (f"CUDA graph {source_name} source overlaps reserved {target_name} target; only exact "
                             "same-source/same-target reuse is allowed.")))
    _check(ValueError, (any(r is None for _, r, _, _ in named),
                        "CUDA graph mode requires reserved qo_indptr, kv_indptr, kv_indices, and kv_len_arr buffers."))


def _validate_fa3_plan(device, head_dim_ckv, head_dim_kpe, q_data_type, kv_data_type) -> str:
    """_fa_common.py `_validate_generated_fa_plan` for fa3 on an SM90 device; returns the plan's scale mode."""
    fp8, unsupported = kv_data_type == torch.float8_e4m3fn, _BackendPlanUnsupportedError
    _check(unsupported, (q_data_type not in (torch.float16, torch.bfloat16),
                         f"MLA q_data_type {q_data_type} is not supported by the fa3 backend."),
           (kv_data_type not in _KV_DTYPES, (f"MLA kv_data_type {kv_data_type} is not supported by the fa3 backend. "
                                             f"Supported dtypes: {list(_KV_DTYPES)}.")))
    _check(ValueError, (head_dim_kpe < 0, f"head_dim_kpe must be >= 0, got {head_dim_kpe}."))
    _check(unsupported, (fp8 and q_data_type != torch.bfloat16, ("FP8 kv_data_type for MLA currently only supports "
                                                                f"q_data_type=torch.bfloat16, got {q_data_type}.")),
           (fp8 and (head_dim_ckv != 512 or head_dim_kpe not in (0, 64)),
            ("FP8 kv_data_type for MLA currently only supports head_dim_ckv=512 and head_dim_kpe in (0, 64), got "
             f"head_dim_ckv={head_dim_ckv}, head_dim_kpe={head_dim_kpe}.")),
           (not fp8 and kv_data_type != q_data_type,
            f"fa3 non-FP8 KV dtype must match query dtype, got {kv_data_type} and {q_data_type}."),
           (head_dim_ckv % 128 or head_dim_kpe % 64, ("fa3 requires head_dim_ckv to be a multiple of 128 and "
                                                     "head_dim_kpe to be a multiple of 64 (including zero).")),
           (head_dim_ckv not in (128, 256, 512), "fa3 MLA requires head_dim_ckv in (128, 256, 512)."),
           (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] != 9,
            "fa3 MLA requires SM90 and CUDA >= 12.3."))
    return "kv-per-tensor" if fp8 else "default"


def _fa_plan_work_count(q_lens: list[int], kv_lens: list[int], num_heads: int, num_sm: int, causal: bool) -> int:
    """_fa_common.py's preflight (MLAPlan's work count, splits included), raising before the native planner would
    overrun its arrays."""
    _check(_BackendPlanUnsupportedError, (not q_lens, "FA MLA native planning requires a nonempty batch."))
    _check(ValueError, (num_heads <= 0, f"num_heads must be a positive integer, got {num_heads!r}."))
    _, _, _, tiles, limit = _schedule(q_lens, kv_lens, num_heads, num_sm, causal)
    tile_count, count = sum(map(len, tiles)), sum(max(1, _ceil_div(kv, limit)) for row in tiles for kv in row)
    _check(_BackendPlanUnsupportedError, (tile_count > MAX_WORKS, (f"FA MLA needs at least {tile_count} work items; "
                                                                  f"native capacity is {MAX_WORKS}.")),
           (count > MAX_WORKS, f"FA MLA needs {count} work items including KV splits; native capacity is {MAX_WORKS}."))
    return count


# -- the planned fa3 backend and its kernel -------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class _Launch:
    """A kernel launch's host parameters (what a captured CUDA graph keeps): the plan info, the tensors it points at."""

    plan_info: tuple[int, ...]
    int_workspace: torch.Tensor
    float_workspace: torch.Tensor
    kv_indices: torch.Tensor
    page_size: int
    sm_scale: float
    ckv_scale: float
    kpe_scale: float


class _PlannedFa3Backend:
    """`_BatchMLAPagedAttentionFa3Backend` after a plan (the wrapper's plan() sets its attributes): its workspaces
    (vLLM reads `_int_workspace_buffer`), the reserved metadata buffers, `_plan_info` and what run() checks."""

    _backend = "fa3"


def _refuse(what: str) -> StandInRefused:
    return StandInRefused(f"attnfuzz's {OP} models the call vLLM's FLASHINFER_MLA_SPARSE_SM90 makes, not {what}")


class BatchMLAPagedAttentionWrapper:
    """FlashInfer's wrapper, `backend="fa3"` (or "auto", which picks fa3 on SM90), in the graph-mode flat-CSR form vLLM
    calls; other forms are refused (`_refuse`)."""

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None, kv_indices=None,
                 kv_len_arr=None, backend="auto") -> None:
        if backend not in ("auto", "fa3") or not use_cuda_graph:
            raise _refuse(f"backend={backend!r}" if backend not in ("auto", "fa3") else "use_cuda_graph=False")
        self._float_workspace_buffer, self.device = float_workspace_buffer, float_workspace_buffer.device
        self._use_cuda_graph, self._backend = use_cuda_graph, backend
        self._qo_indptr_buf, self._kv_indptr_buf = qo_indptr, kv_indptr
        self._kv_indices_buf, self._kv_len_arr_buf = kv_indices, kv_len_arr
        self._planned_backend = self._plan_info = None  # a _PlannedFa3Backend and its plan info, once planned
        self._warned_positional = False

    def _warn_positional(self) -> None:
        if not self._warned_positional:  # FlashInfer 0.7 warns once per wrapper
            warnings.warn("Positional MLA arguments are deprecated; pass plan() and run() arguments by keyword "
                          "instead. Positional calling will be removed in a future release.", DeprecationWarning,
                          stacklevel=3)
            self._warned_positional = True

    def plan(self, qo_indptr=None, kv_indptr=None, kv_indices=None, kv_len_arr=None, num_heads=None, head_dim_ckv=None,
             head_dim_kpe=None, page_size=None, causal=None, sm_scale=None, q_data_type=None, kv_data_type=None,
             use_profiler: bool = False, *, metadata=None, lse_mode: str = "none", **unsupported) -> None:
        if metadata is not None or unsupported or use_profiler or lse_mode != "none":
            raise _refuse("plan()'s metadata=, use_profiler, lse_mode or " + ", ".join(unsupported))
        if qo_indptr is not None and num_heads is not None:
            self._warn_positional()
        required = dict(num_heads=num_heads, head_dim_ckv=head_dim_ckv, head_dim_kpe=head_dim_kpe, page_size=page_size,
                        causal=causal, sm_scale=sm_scale, q_data_type=q_data_type, kv_data_type=kv_data_type)
        missing = [name for name, value in required.items() if value is None]
        csr = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        _check(TypeError, (missing, "plan() missing required arguments: " + ", ".join(missing)))
        _check(ValueError, (any(t is None for t in csr), "CSR metadata form is partial."),
               (not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0,
                f"page_size must be a positive int, got {page_size!r}."))
        qo, kv, lens = _validate_csr(csr, page_size, self.device)
        scale_mode = _validate_fa3_plan(self.device, head_dim_ckv, head_dim_kpe, q_data_type, kv_data_type)
        reserved = (self._qo_indptr_buf, self._kv_indptr_buf, self._kv_indices_buf, self._kv_len_arr_buf)
        _validate_graph_buffers(self.device, tuple(zip(CSR, reserved, csr, (False, False, True, False))))
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" \
            else EMULATED_SMS
        _fa_plan_work_count([qo[i + 1] - qo[i] for i in range(len(lens))], lens, num_heads, sms, causal)
        # A graph plan reuses the int workspace of the plan before (FlashInfer: its captured pointer must stay).
        int_ws = self._planned_backend._int_workspace_buffer if self._planned_backend is not None else \
            torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        plan = mla_plan(qo, kv, lens, num_heads, head_dim_ckv, causal, sms, int_ws.numel(),
                        self._float_workspace_buffer.numel() * self._float_workspace_buffer.element_size())
        for target, source in zip(reserved[:2] + (reserved[2][: len(kv_indices)], reserved[3]), csr):
            target.copy_(source)  # the reserved buffers take the metadata in place
        int_ws[: plan.staged.numel()].copy_(plan.staged)
        backend = _PlannedFa3Backend()
        vars(backend).update(_float_workspace_buffer=self._float_workspace_buffer, device=self.device,
                             _int_workspace_buffer=int_ws, _use_cuda_graph=self._use_cuda_graph,
                             **{f"_{name}_buf": buf for name, buf in zip(CSR, reserved)}, _plan_info=plan.info,
                             _page_size=page_size, _sm_scale=float(sm_scale), _causal=bool(causal),
                             _head_dims=(head_dim_ckv, head_dim_kpe), _q_data_type=q_data_type,
                             _kv_data_type=kv_data_type, _scale_mode=scale_mode, _num_heads=num_heads,
                             _works=plan.works)
        vars(self).update(_planned_backend=backend, _backend="fa3", _int_workspace_buffer=int_ws,
                          _plan_info=plan.info, _sm_scale=float(sm_scale), _causal=bool(causal), _page_size=page_size,
                          _q_data_type=q_data_type, _kv_data_type=kv_data_type, _head_dim_ckv=head_dim_ckv)

    def run(self, q_nope=None, q_pe=None, ckv_cache=None, kpe_cache=None, *options, ckv_scale=None, ckv_scale_arr=None,
            kpe_scale=None, **keywords):
        """vLLM's form: the split query and cache, positional; ckv_scale and kpe_scale for an fp8 cache. The rest of
        FlashInfer's run() (out=, lse and its base, profiler_buffer, kv_len, page_table, o_scale, the query=/kv_cache=
        form, sinks, BMM scales, per-token ckv_scale_arr, kept keyword-only: vLLM's gate looks for it) is refused."""
        if q_nope is not None and q_pe is not None:
            self._warn_positional()
        given = [k for k, v in keywords.items() if v is not None] + ["ckv_scale_arr"] * (ckv_scale_arr is not None)
        if given or any(v is not None and v is not False for v in options):
            raise _refuse("run()'s " + (", ".join(given) or f"{len(options)} more positional arguments"))
        _check(ValueError, ((q_nope is None) != (q_pe is None), "q_nope and q_pe must both be provided."),
               ((ckv_cache is None) != (kpe_cache is None), "ckv_cache and kpe_cache must both be provided."))
        _check(TypeError, (q_nope is None or ckv_cache is None, "run() requires query= or q_nope and q_pe."))
        b = self._planned_backend
        _check(RuntimeError, (b is None, "BatchMLAPagedAttentionWrapper.run() called before plan()."))
        for name, (left, right), names, planned in (("query", (q_nope, q_pe), ("q_nope", "q_pe"), "q_data_type"), (
                "KV cache", (ckv_cache, kpe_cache), ("ckv_cache", "kpe_cache"), "kv_data_type")):
            dtype = getattr(b, "_" + planned)
            _check(ValueError, (left.ndim != 3 or right.ndim != 3, f"split {name} tensors must have rank 3."),
                   (left.shape[:-1] != right.shape[:-1],
                    f"split {name} tensor shapes must match before the last axis."),
                   *((t.dtype != dtype, f"{t_name}.dtype={t.dtype} does not match the planned {planned}={dtype}.")
                     for t, t_name in zip((left, right), names)),
                   (left.shape[-1:] + right.shape[-1:] != b._head_dims,
                    f"split {name} last dimensions do not match planned widths."))
        fp8 = b._kv_data_type == torch.float8_e4m3fn
        if fp8:
            _check(ValueError, (ckv_scale is None,
                                "Exactly one of ckv_scale or ckv_scale_arr is required when kv_data_type is FP8."),
                   (kpe_scale is None, "kpe_scale is required when kv_data_type is FP8."))
            ckv_f, kpe_f = float(ckv_scale), float(kpe_scale)
            _check(ValueError, *((not math.isfinite(f) or f <= 0.0, f"{name} must be a finite positive value, got {v}")
                                 for name, v, f in (("ckv_scale", ckv_scale, ckv_f), ("kpe_scale", kpe_scale, kpe_f))))
        else:
            _check(ValueError, (ckv_scale is not None or kpe_scale is not None,
                                "ckv_scale / ckv_scale_arr / kpe_scale are only valid when kv_data_type is FP8."))
            ckv_f = kpe_f = 1.0
        # FlashInfer: torch.empty_like(q_nope), undefined until written; NaN here
        out = torch.full(q_nope.shape, float("nan"), dtype=q_nope.dtype, device=q_nope.device)
        launch = cudagraphs.launch_parameters(("flashinfer.mla", id(self)), _Launch(
            tuple(b._plan_info), b._int_workspace_buffer, b._float_workspace_buffer, b._kv_indices_buf, b._page_size,
            b._sm_scale, ckv_f, kpe_f))
        _mla_kernel(launch, q_nope, q_pe, ckv_cache, kpe_cache, out, fp8)
        return out


def _ranges(starts: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner, value) of every element of the ranges [start, start + count), laid end to end (host int64)."""
    owner = torch.repeat_interleave(torch.arange(len(counts)), counts)
    offset = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return owner, starts[owner] + offset


def _mla_kernel(launch: _Launch, q_nope, q_pe, ckv, kpe, out, fp8: bool) -> None:
    """BatchMLAPageAttentionHopperKernel (see the module docstring), then its merge stage: every work item's CTAs at
    once (in chunks of works), on the tensors' device, the plan read on the host in one copy."""
    info, dev = launch.plan_info, q_nope.device
    bx, by = info[0], info[1]
    ws = launch.int_workspace.view(torch.int32)
    n_ws = ws.numel()
    # The plan's arrays as the kernel reads them (vLLM's clamp rewrote kv_end on the device): the span they occupy.
    spans = [(info[_FIELD["work_indptr"]] // 4, by + 1)] + [(info[_FIELD[n]] // 4, MAX_WORKS) for n in WORK_FIELDS] \
        + [(info[_FIELD[n]] // 4, bx * by) for n in MERGE_FIELDS]
    host = (ws[: max(0, min(n_ws, max(at + count for at, count in spans)))] if min(at for at, _ in spans) >= 0
            else ws).cpu()

    def array(name: str, count: int) -> torch.Tensor:
        at = info[_FIELD[name]] // 4
        if at + count > n_ws:
            _violation("int_workspace_buffer", at + count - 1, n_ws, 4)
            return torch.zeros(count, dtype=torch.int64)
        return host[at: at + count].long()

    work_indptr = array("work_indptr", by + 1)
    _, ids = _ranges(work_indptr[:-1], (work_indptr[1:] - work_indptr[:-1]).clamp(min=0))
    past = (ids < 0) | (ids >= MAX_WORKS)
    if bool(past.any()):  # a work id outside the planner's arrays: the kernel reads other arrays' (or no) memory
        _violation("int_workspace_buffer (work arrays)", int(ids[past][0]), MAX_WORKS, 4, inside=True)
    ids = ids[~past]
    work = torch.stack([array(name, MAX_WORKS)[ids] for name in WORK_FIELDS])  # [8, works], host
    fw = launch.float_workspace.view(-1).view(torch.uint8)
    partial_rows, d_ckv = 2 * bx * by * CTA_TILE_Q, ckv.shape[-1]  # partial buffers: 2 x clusters x cluster tile rows
    partial_o = fw[info[16]: info[16] + partial_rows * d_ckv * 2].view(torch.bfloat16).view(partial_rows, d_ckv)
    partial_lse = fw[info[17]: info[17] + partial_rows * 4].view(torch.float32)
    checks: list[tuple] = []
    if n_work := work.shape[1]:
        kv_start, kv_end = work[-2], work[-1]  # WORK_FIELDS ends with them
        tiles = ((kv_end + CTA_TILE_KV - 1) // CTA_TILE_KV - kv_start // CTA_TILE_KV).clamp(min=0)
        per_work = int(tiles.max()) * CTA_TILE_KV * 4 * (d_ckv + q_pe.shape[2] + 3 * bx * CTA_TILE_Q)
        per = max(1, CHUNK_BYTES.get(dev.type, CHUNK_BYTES["cpu"]) // max(1, per_work))
        work_dev = torch.cat([work, tiles[None]]).to(dev)  # one copy to the device
        # repack_fp8_kv_to_bf16's scales, as bf16 (__hmul2: a bf16 product): ckv's, kpe's; None for a 16-bit cache
        scales = tuple(float(torch.tensor(s, dtype=torch.float32).to(torch.bfloat16))
                       for s in (launch.ckv_scale, launch.kpe_scale)) if fp8 else (None, None)
        for c0 in range(0, n_work, per):
            _work_chunk(launch, work_dev[:, c0: c0 + per], int(tiles[c0: c0 + per].max()) * CTA_TILE_KV, q_nope, q_pe,
                        ckv, kpe, scales, out, partial_o, partial_lse, checks)
    _merge(info, host, bx * by, partial_o, partial_lse, out, checks)
    _report(checks)


def _work_chunk(launch: _Launch, work, span: int, q_nope, q_pe, ckv, kpe, scales, out, partial_o, partial_lse,
                checks: list) -> None:
    """Works [W] of the launch, each with its cluster's bx CTAs of 64 query rows ([W, bx x 64] rows) over its KV
    positions kv_start + [0, span), every tensor on the device."""
    dev, heads, page_size, flat_idx = q_nope.device, q_nope.shape[1], launch.page_size, launch.kv_indices.reshape(-1)
    q_indptr, kv_indptr, partial, q_len, kv_len, q_start, kv_start, kv_end, tiles = work
    num_pages, partial_rows, rows_per_work = ckv.shape[0], partial_o.shape[0], launch.plan_info[0] * CTA_TILE_Q
    ckv_rows = ckv.reshape(num_pages * ckv.shape[1], ckv.shape[2])
    kpe_rows = kpe.reshape(num_pages * kpe.shape[1], kpe.shape[2])
    rel = torch.arange(span, device=dev)[None, :]
    pos = kv_start[:, None] + rel  # [W, span]
    in_tiles = rel < tiles[:, None] * CTA_TILE_KV
    highest = rel // CTA_TILE_KV == (tiles - 1)[:, None]
    read = in_tiles & (pos < kv_len[:, None])  # rows whose page comes from kv_indices
    at = kv_indptr[:, None] * page_size + pos  # the packed block iterator
    entry = at // page_size
    bad_entry = read & ((entry < 0) | (entry >= flat_idx.numel()))
    checks.append(("kv_indices", bad_entry, entry, flat_idx.numel(), 4, "load"))
    # Lower tiles past kv_len read page 0 (prefetch_offset's index 0); the highest loads zeros.
    page = torch.where(read & ~bad_entry, flat_idx[entry.clamp(0, max(flat_idx.numel() - 1, 0))].long(), 0)
    row = page * page_size + at % page_size
    loaded = (read & ~bad_entry) | (in_tiles & ~read & ~highest)
    bad_page = loaded & ((page < 0) | (page >= num_pages))
    checks.append(("ckv_cache", bad_page, page, num_pages, ckv_rows.shape[-1] * ckv_rows.element_size() * page_size,
                   "load"))
    loaded &= ~bad_page
    # Scores past kv_end: -inf; zero-filled rows of the highest tile score 0, not -inf.
    mask = in_tiles & (pos < kv_end[:, None]) & (loaded | (in_tiles & ~read & highest))
    rows = row.clamp(0, max(ckv_rows.shape[0] - 1, 0))
    if scales[0] is not None:  # fp8: bf16(bf16(x) * bf16(scale))
        k_ckv = (ckv_rows[rows].float() * scales[0]).to(torch.bfloat16).float()
        k_kpe = (kpe_rows[rows].float() * scales[1]).to(torch.bfloat16).float()
    else:
        k_ckv = ckv_rows[rows].float() if ckv_rows.shape[0] else torch.zeros(*row.shape, ckv_rows.shape[-1], device=dev)
        k_kpe = kpe_rows[rows].float() if kpe_rows.shape[0] else torch.zeros(*row.shape, kpe_rows.shape[-1], device=dev)
    k_ckv.masked_fill_(~loaded[..., None], 0.0), k_kpe.masked_fill_(~loaded[..., None], 0.0)  # skipped or zero-filled
    # The query rows of each work's CTAs: row x * 64 + j is CTA x's row j, packed row q_start + x * 64 + j.
    packed = q_start[:, None] + torch.arange(rows_per_work, device=dev)[None, :]  # [W, R]
    q_local, head = packed // heads, packed % heads
    live = q_local < q_len[:, None]
    tok = q_indptr[:, None] + q_local
    bad_q = live & (tok >= q_nope.shape[0])
    checks.append(("q_nope", bad_q, tok * heads + head, q_nope.shape[0] * heads,
                   q_nope.shape[-1] * q_nope.element_size(), "load"))
    unread = ~(live & ~bad_q)[..., None]  # a row past q: its read skipped (zeros), its write still attempted
    t_idx = tok.clamp(0, max(q_nope.shape[0] - 1, 0))
    qn, qp = q_nope[t_idx, head].float().masked_fill_(unread, 0.0), q_pe[t_idx, head].float().masked_fill_(unread, 0.0)
    s = torch.einsum("wrd,wkd->wrk", qn, k_ckv).add_(torch.einsum("wrd,wkd->wrk", qp, k_kpe))
    s.mul_(launch.sm_scale).masked_fill_(~mask[:, None, :], float("-inf"))
    row_lse = torch.logsumexp(s, dim=-1)  # [W, R], natural log
    empty = torch.isinf(row_lse) & (row_lse < 0)
    p = s.sub_(torch.where(empty, 0.0, row_lse)[..., None]).exp_().masked_fill_(empty[..., None], 0.0)
    o = torch.einsum("wrk,wkd->wrd", p, k_ckv)  # a work with no key: 0 (normalize_d_: 1/d -> 0)
    # Unsplit works write out, split ones their partial rows (and base-2 LSEs, -inf for an empty row).
    final, split = (partial < 0)[:, None] & live, (partial >= 0)[:, None] & live
    prow = partial[:, None] + torch.arange(rows_per_work, device=dev)[None, :]
    bad_o, bad_p = final & (tok >= out.shape[0]), split & (prow >= partial_rows)
    checks.append(("o", bad_o, tok * heads + head, out.shape[0] * heads, out.shape[-1] * out.element_size(), "store"))
    checks.append(("float_workspace_buffer (partial_o)", bad_p, prow, partial_rows, partial_o.shape[-1] * 2, "store"))
    at = (final & ~bad_o).nonzero(as_tuple=True)
    out[tok[at], head[at]] = o[at].to(out.dtype)
    at = (split & ~bad_p).nonzero(as_tuple=True)
    partial_o[prow[at]] = o[at].to(torch.bfloat16)
    partial_lse[prow[at]] = (row_lse * LOG2E)[at]


def _merge(info, host, ctas, partial_o, partial_lse, out, checks: list) -> None:
    """DevicePersistentMergeStates: CTA c merges rows [start, end) of its packed range from partial rows
    pstart + local, + stride, ... < pend (state_t: m = -inf, d = 1, merged in fp32; an all-empty state gives 0).
    Every CTA's rows at once: the rows of one count of partials together, each sum over its own k terms (padding
    would regroup the reductions)."""
    starts, ends, pstarts, pends, strides = (host[info[_FIELD[n]] // 4: info[_FIELD[n]] // 4 + ctas].long()
                                             for n in MERGE_FIELDS)
    k = torch.where(strides > 0, (-(-(pends - pstarts) // strides.clamp(min=1))).clamp(min=0), 0).clamp(min=1)
    cta, final = _ranges(starts, (ends - starts).clamp(min=0))  # one entry per merged row, CTA by CTA
    order = torch.sort(k[cta], stable=True).indices  # by k, CTA order within
    cta, final = cta[order], final[order]
    kr = k[cta]
    # per row: first partial row, its end, stride, packed row; one copy to the device
    rows_dev = torch.stack([pstarts[cta] + final - starts[cta], pends[cta], strides[cta], final]).to(out.device)
    dev, width, heads, partial_rows, begin = out.device, partial_o.shape[-1], out.shape[1], partial_o.shape[0], 0
    for end in torch.searchsorted(kr, torch.unique(kr), right=True).tolist():
        cols = int(kr[begin])  # the partials each of these rows merges
        per = max(1, CHUNK_BYTES.get(dev.type, CHUNK_BYTES["cpu"]) // (cols * (width + 4) * 4))
        for n0 in range(begin, end, per):
            first, pend, stride, f = rows_dev[:, n0: min(end, n0 + per)]
            rows = first[:, None] + stride[:, None] * torch.arange(cols, device=dev)[None, :]
            use = rows < pend[:, None]
            bad = use & ((rows >= partial_rows) | (rows < 0))
            checks.append(("float_workspace_buffer (partial_o)", bad, rows, partial_rows, width * 2, "load"))
            use &= ~bad
            rr = rows.clamp(0, partial_rows - 1)
            po, pl = partial_o[rr].float(), torch.where(use, partial_lse[rr], float("-inf"))
            m = pl.max(dim=1).values
            weight = torch.exp2(pl - torch.where(torch.isinf(m) & (m < 0), 0.0, m)[:, None])
            weight = torch.where(use, weight, 0.0).nan_to_num(0.0)
            d = weight.sum(dim=1)
            merged = (po * weight[..., None]).masked_fill(~use[..., None], 0.0).sum(dim=1)
            merged = merged * torch.where(d > 0, 1.0 / d, 0.0)[:, None]
            q, r = f // heads, f % heads
            bad_o = q >= out.shape[0]
            checks.append(("o", bad_o, q * heads + r, out.shape[0] * heads, out.shape[-1] * out.element_size(),
                           "store"))
            out[q[~bad_o], r[~bad_o]] = merged[~bad_o].to(out.dtype)
        begin = end


# -- import as `flashinfer.mla` ------------------------------------------------------------------------------------

@contextlib.contextmanager
def importable():
    """`flashinfer` and `flashinfer.mla` (this stand-in's wrapper) importable inside the block, and only there."""
    top, mla = stand_in_module("flashinfer", True, __name__), stand_in_module("flashinfer.mla", False, __name__)
    mla.BatchMLAPagedAttentionWrapper = BatchMLAPagedAttentionWrapper
    top.mla, top.__version__ = mla, __version__
    with importable_as({"flashinfer": top, "flashinfer.mla": mla}):
        yield mla
