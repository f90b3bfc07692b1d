"""Stand-ins for the DeepGEMM attention functions vLLM's sparse-attention indexer calls (`fp8_fp4_mqa_logits`,
`get_paged_mqa_logits_metadata`, `fp8_fp4_paged_mqa_logits`), as vLLM 0.33.0 vendors DeepGEMM 2.8.1
(`vllm/third_party/deep_gemm`) and as they behave on an SM90 device (H100/H200), the one the indexer's CPU route
pretends to be (fuzzer/support/indexer_runtime.py). Plain torch, CPU or GPU tensors. One thing follows the installed
release: whether the paged kernel skips requests without KV and prefetches request q + 1 after one (`q_prefetch`,
read from the vendored headers: the hazard of vLLM 0.30.0 on).

Faithful to the SM90 kernels, uncleaned output and scheduling included: what the real kernel leaves unwritten holds
`POISON`, what it reads or writes outside an argument is a `MemoryViolation` in `VIOLATIONS.violations` (one per
argument and kind, `lanes` counting the elements) instead of a fault, and the host assertions it fails are raised as
the RuntimeError DeepGEMM raises ("Assertion error (csrc/apis/attention.hpp): <condition>")."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import torch

from fuzzer.support.errors import StandInRefused
from fuzzer.support.interp.sanitizer import VIOLATIONS, MemoryViolation

DEEP_GEMM_SOURCE = (
    "DeepGEMM 2.8.1 as vendored in vLLM 0.33.0 and 0.34.0 (vllm/third_party/deep_gemm: 0.34's wrappers add "
    "logits_dtype, its SM90 kernels are 0.33's): op schemas in _C_extension.abi3.so and _C.py's wrappers; SM90 kernels include/deep_gemm/impls/sm90_fp8_mqa_logits.cuh (schedule 126-143, store "
    "306-310), impls/sm90_fp8_paged_mqa_logits.cuh (Q prefetch 164-203, block-table read 205-221, store 283, "
    "354-355) and scheduler/sm90_paged_mqa_logits.cuh (metadata kernel 9-127, SM90PagedMQALogitsScheduler "
    "138-278); host checks of csrc/apis/attention.hpp and csrc/jit_kernels/impls/sm90_fp8_mqa_logits.hpp (not in "
    "the wheel: read from DeepGEMM sources whose assertion strings match those compiled into the extension)")

# What the real kernel leaves in logits it does not write: whatever the caching allocator's block held. A large finite
# value (NaN and inf take special paths in the top-k kernels), so a consumer that reads past a row's end (a top-k over
# uncleaned columns) picks it, as it would pick stale logits on the GPU.
POISON = 3.0e38
NUM_SMS = 132  # runtime->get_num_sms() of an H100/H200 SXM; DeepGEMM's set_num_sms changes it
SM90_SPLIT_KV = 256  # the paged kernel's split and the metadata's SPLIT_KV (4 math warpgroups x 64)
SM90_COMPUTE_BLOCK_KV = 64  # kComputeBlockKV: the scheduler's KV unit, whatever the page size
SM90_MQA_BLOCK_KV = 256  # sm90_fp8_mqa_logits' BLOCK_KV
_U32 = 0xFFFFFFFF
_FP4 = torch.int8  # DeepGEMM's kPackedFP4 (vLLM views MXFP4 values as int8 for it)
_E4M3 = torch.float8_e4m3fn


def set_num_sms(num_sms: int) -> None:
    global NUM_SMS
    NUM_SMS = int(num_sms)


def get_num_sms() -> int:
    return NUM_SMS


def _dg_assert(cond: bool, condition: str, note: str = "") -> None:
    if not cond:
        raise RuntimeError(f"Assertion error (csrc/apis/attention.hpp): {condition}"
                           + (f" (attnfuzz stand-in of DeepGEMM on SM90: {note})" if note else ""))


def _tma_zero_extent(what: str) -> RuntimeError:
    # cuTensorMapEncodeTiled requires every global dimension to be non-zero; DG_CUDA_DRIVER_CHECK raises this.
    return RuntimeError(f"CUDA driver error (csrc/jit/kernel_runtime.hpp): 1 (CUDA_ERROR_INVALID_VALUE, invalid "
                        f"argument) (attnfuzz stand-in: the TMA descriptor of {what} has a zero extent)")


class _Faults:
    """Out-of-bounds accesses of one call, one MemoryViolation per (argument, access, inside allocation)."""

    def __init__(self, kernel: str):
        self.kernel, self.seen = kernel, {}

    def add(self, argument: str, index: int, limit: int, elem_bytes: int, access: str, count: int = 1,
            inside: bool = False, program: int = 0) -> None:
        if count <= 0:
            return
        key = (argument, access, inside)
        if key in self.seen:
            self.seen[key][1] += count
        else:
            self.seen[key] = [(index, limit, elem_bytes, program), count]

    def record(self) -> None:
        for (argument, access, inside), ((index, limit, elem_bytes, program), count) in self.seen.items():
            VIOLATIONS.violations.append(MemoryViolation(
                kernel=f"{self.kernel} (attnfuzz stand-in)", op=access, argument=argument,
                byte_offset=index * elem_bytes, argument_bytes=limit * elem_bytes, element_bytes=elem_bytes,
                program_id=(program, 0, 0), lanes=count, inside_allocation=inside))


def _storage_flat(t: torch.Tensor) -> torch.Tensor:
    """All of t's storage from t's first element on, flat: what a kernel indexing t's pointer can reach."""
    n = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return t.as_strided((max(n, 0),), (1,))


def _check_q_and_weights(q_fp, q_sf, weights, num_q_tokens: int, num_heads: int, head_dim: int) -> None:
    """attention.hpp's check_mqa_logits_q_and_weights with arch_major == 9."""
    is_fp4, is_mx_sf = q_fp.dtype == _FP4, q_sf is not None
    fp4 = "FP4 Q is not modelled (and SM90's DeepGEMM refuses it)"
    _dg_assert(not is_fp4 or is_mx_sf, "not is_fp4 or is_mx_sf", fp4)
    _dg_assert((not is_fp4 and head_dim == 32) or head_dim in (64, 128),
               "(not is_fp4 and head_dim == 32) or head_dim == 64 or head_dim == 128", f"head_dim {head_dim}")
    _dg_assert(q_fp.is_contiguous(), "q_fp.is_contiguous()")
    _dg_assert(q_fp.dtype == (_FP4 if is_fp4 else _E4M3),
               "q_fp.scalar_type() == (is_fp4 ? kPackedFP4 : torch::headeronly::ScalarType::Float8_e4m3fn)",
               f"q is {q_fp.dtype}")
    _dg_assert(not is_mx_sf, "is_mx_sf == (arch_major == 10 or (arch_major == 12 and is_fp4))",
               "SM90 takes q = (values, None); MX scales / FP4 are not modelled")
    _dg_assert(weights.dim() == 2, "weights.dim() == 2")
    _dg_assert(tuple(weights.shape) == (num_q_tokens, num_heads),
               "num_q_tokens == _num_q_tokens and num_heads == _num_heads",
               f"weights {tuple(weights.shape)}, expected {(num_q_tokens, num_heads)}")
    _dg_assert(weights.stride(1) == 1 and (weights.stride(0) * weights.element_size()) % 16 == 0,
               "weights.stride(1) == 1 and (weights.stride(0) * weights.element_size()) % 16 == 0")
    _dg_assert(weights.dtype == torch.float32,
               "weights.scalar_type() == (arch_major == 10 ? BFloat16 : Float)", f"weights are {weights.dtype}")


def _check_int32_vector(t: torch.Tensor, name: str, n: int) -> None:
    _dg_assert(t.size(0) == n, f"{name}.size(0) == seq_len")
    _dg_assert(t.is_contiguous(), f"{name}.is_contiguous()")
    _dg_assert(t.dtype == torch.int32, f"{name}.scalar_type() == torch::headeronly::ScalarType::Int")


def _head_logits(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The kernels' score: scales[j] * sum_h w[r, h] * relu(q[r, h] . keys[j]) (fp8 products, fp32 sums).
    q [R, H, D], w [R, H], keys [P, D], scales [P] -> [R, P]."""
    r, h, d = q.shape
    s = (q.float().reshape(r * h, d) @ keys.float().T).clamp_min_(0).view(r, h, -1)
    return torch.bmm(w.float()[:, None, :], s)[:, 0] * scales.float()[None, :]


def _fp32_logits(logits_dtype) -> None:
    """SM90's logits kernels store fp32 (their headers have no other output type); vLLM 0.34 asks for bf16 logits only
    where the MQA kernels take MX scales (SM100: `mqa_logits_use_mx_scales`), so another dtype is not modelled."""
    if logits_dtype != torch.float32:
        raise StandInRefused(f"attnfuzz's DeepGEMM stand-in models SM90's fp32 logits, not logits_dtype={logits_dtype}")


def fp8_fp4_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, max_seqlen_k, logits_dtype=torch.float32,
                       schedule_meta=None):
    """`deep_gemm.fp8_fp4_mqa_logits` on SM90 (impls/sm90_fp8_mqa_logits.cuh): compressed logits.

    Returns a [M, max_seqlen_k] fp32 view of an [align(M, 128 / H), align(max_seqlen_k, 256)] allocation. Row i holds
    K positions j in [ks[i], ke[i]) at column j - ks[i]:
        logits[i, j - ks[i]] = kv_scale[j] * sum_h weights[i, h] * relu(q[i, h] . kv[j])
    (the K scale multiplies after the head sum, as the kernel's `(sum[0] + sum[1]) * scale_kv_0`). Every other
    column is not cleaned (`POISON`). The kernel walks Q blocks of 128 / H rows over KV blocks of 256 from the
    block's smallest min(ks, N) rounded down to 4 to its largest min(ke, N), so a row with ke > N also gets zeros
    at positions [N, ke) that its block reaches (TMA zero-fills reads past kv; recorded as an out-of-bounds load of
    `kv`); a row whose ke - ks exceeds the row stride writes on into the next rows (recorded as a store past the row,
    and past the allocation for the last rows). ks/ke are read as uint32, as the kernel does.
    """
    q_fp, q_sf = q
    kv_fp, kv_sf = kv
    _dg_assert(q_fp.dim() == 3, "q.dim() == 3", f"q has shape {tuple(q_fp.shape)}")
    seq_len, num_heads, head_dim = q_fp.shape
    if q_fp.dtype == _FP4:
        head_dim *= 2
    _check_q_and_weights(q_fp, q_sf, weights, seq_len, num_heads, head_dim)
    _dg_assert(kv_fp.dim() == 2, "kv.dim() == 2")
    seq_len_kv, kv_head_dim = kv_fp.shape
    _dg_assert(head_dim == kv_head_dim, "head_dim == _head_dim")
    _dg_assert(kv_fp.is_contiguous(), "kv_fp.is_contiguous()")
    _dg_assert(kv_fp.dtype == _E4M3, "kv_fp.scalar_type() == (is_fp4 ? kPackedFP4 : Float8_e4m3fn)",
               f"kv is {kv_fp.dtype}")
    _dg_assert(kv_sf.dim() == 1 and kv_sf.size(0) == seq_len_kv, "seq_len_kv == _seq_len_kv")
    _dg_assert(kv_sf.is_contiguous(), "kv_sf.is_contiguous()")
    _dg_assert(kv_sf.dtype == torch.float32, "kv_sf.scalar_type() == (is_mx_sf ? Int : Float)",
               f"kv scales are {kv_sf.dtype}")
    _check_int32_vector(cu_seq_len_k_start, "cu_seq_len_k_start", seq_len)
    _check_int32_vector(cu_seq_len_k_end, "cu_seq_len_k_end", seq_len)
    max_seqlen_k = int(max_seqlen_k)
    _dg_assert(max_seqlen_k > 0, "max_seqlen_k > 0")
    _dg_assert(0 < num_heads <= 128 and num_heads % 4 == 0, "num_heads > 0 and num_heads <= 128 and num_heads % 4 == 0")
    block_q = 128 // num_heads
    _dg_assert(schedule_meta is None, "not schedule_meta.has_value()")
    _fp32_logits(logits_dtype)
    _dg_assert(num_heads in (32, 64), "num_heads == 32 or num_heads == 64")
    if seq_len == 0 or seq_len_kv == 0:
        raise _tma_zero_extent("q" if seq_len == 0 else "kv")

    block_kv = SM90_MQA_BLOCK_KV
    aligned_seq_len = -(-seq_len // block_q) * block_q
    stride = -(-max_seqlen_k // block_kv) * block_kv  # then aligned to 1024 bytes: 256 fp32, already so
    device = q_fp.device
    buf = torch.full((aligned_seq_len, stride), POISON, dtype=torch.float32, device=device)
    flat, total = buf.view(-1), aligned_seq_len * stride
    faults = _Faults("sm90_fp8_mqa_logits")
    ks = [v & _U32 for v in cu_seq_len_k_start.tolist()]
    ke = [v & _U32 for v in cu_seq_len_k_end.tolist()]
    n = seq_len_kv
    for b in range(aligned_seq_len // block_q):
        rows = range(b * block_q, (b + 1) * block_q)
        src = [min(r, seq_len - 1) for r in rows]  # the kernel reads the last row's bounds for padded rows
        start = min(min(ks[i], n) for i in src) // 4 * 4
        end = max(min(ke[i], n) for i in src)
        stop = start + -(-max(end - start, 0) // block_kv) * block_kv
        # Padded rows (r >= seq_len) load Q past q: TMA zero-fills them, so their logits are 0.
        q_rows = q_fp[b * block_q: min((b + 1) * block_q, seq_len)]
        vals = None
        if start < min(stop, n):
            vals = _head_logits(q_rows, weights[b * block_q: b * block_q + len(q_rows)],
                                kv_fp[start:min(stop, n)], kv_sf[start:min(stop, n)])
        for k, r in enumerate(rows):
            lo, hi = max(ks[src[k]], start), min(ke[src[k]], stop)
            if lo >= hi:
                continue
            if hi > n:
                faults.add("kv", max(lo, n), n, head_dim, "load", count=hi - max(lo, n), program=b)
            base = r * stride - ks[src[k]]  # flat index of position j is base + j
            past_row = max(0, hi - max(lo, ks[src[k]] + stride))
            if past_row:
                faults.add("logits", r * stride + stride, stride * seq_len, 4, "store", count=past_row,
                           inside=True, program=b)
            cut = min(hi, total - base)  # past the allocation: dropped, recorded
            if hi > cut:
                faults.add("logits", total, total, 4, "store", count=hi - max(lo, cut), program=b)
            real_hi = min(cut, n)
            if r < seq_len and vals is not None and lo < real_hi:
                flat[base + lo: base + real_hi] = vals[k, lo - start: real_hi - start]
            elif lo < real_hi:
                flat[base + lo: base + real_hi] = 0.0
            if max(lo, n) < cut:
                flat[base + max(lo, n): base + cut] = 0.0
    faults.record()
    return buf[:seq_len, :max_seqlen_k]


def _ceil_div_u32(a: int, b: int) -> int:
    return ((a + b - 1) & _U32) // b  # math::ceil_div in uint32: wraps for a near 2^32


def get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms, indices=None):
    """`deep_gemm.get_paged_mqa_logits_metadata` on SM90 (scheduler/sm90_paged_mqa_logits.cuh's
    sm90_paged_mqa_logits_metadata<aligned B, SPLIT_KV=256, num_sms, false>, num_next_n_atoms 1).

    Request b costs ceil(context_lens[b, next_n - 1] / 256) segments (only the last column counts). With total
    segments T = q * num_sms + r, the first num_sms - r slots get q segments and the last r get q + 1: slot s starts
    at segment s * q + max(s - (num_sms - r), 0); its row is (request holding that segment, split within it), the
    request found by a binary search of the inclusive prefix sums (the first b with prefix[b] > start, clamped to
    B - 1). The last row is (B, 0); T == 0 gives (B, 0) in every row. uint32 arithmetic throughout, as the kernel's.
    block_kv is only checked: SM90 always schedules 64-token compute tiles (attention.hpp passes 64).
    """
    _dg_assert(context_lens.dim() == 2, "context_lens.dim() == 2",
               "DeepGEMM takes context_lens [B, next_n] only (vLLM unsqueezes 1-D lens)")
    batch_size, next_n = context_lens.shape
    num_sms = int(num_sms)
    _dg_assert(num_sms > 0, "num_sms > 0")
    _dg_assert(context_lens.dtype == torch.int32, "context_lens.scalar_type() == torch::headeronly::ScalarType::Int")
    _dg_assert(context_lens.is_contiguous(), "context_lens.is_contiguous()")
    _dg_assert(indices is None, "not is_varlen", "SM90 has no varlen (indices) path")
    _dg_assert(int(block_kv) in (32, 64), "block_kv == 32 or block_kv == 64", f"block_kv {block_kv}")
    faults = _Faults("sm90_paged_mqa_logits_metadata")
    if next_n == 0 and batch_size:  # lens_idx = q * 0 + 0 - 1: one element before context_lens
        faults.add("context_lens", -1, 0, 4, "load", count=batch_size)
        lens = [0] * batch_size
    else:
        lens = [v & _U32 for v in context_lens[:, -1].tolist()] if batch_size else []
    prefix, acc = [], 0
    for length in lens:
        acc = (acc + _ceil_div_u32(length, SM90_SPLIT_KV)) & _U32
        prefix.append(acc)
    total = acc
    meta = [[batch_size, 0] for _ in range(num_sms + 1)]
    if total:
        q, r = divmod(total, num_sms)
        pivot = num_sms - r
        for sm in range(num_sms):
            seg_start = (sm * q + (sm - pivot if sm > pivot else 0)) & _U32
            lo, hi = 0, batch_size
            while lo < hi:
                mid = (lo + hi) // 2
                if prefix[mid] <= seg_start:
                    lo = mid + 1
                else:
                    hi = mid
            q_idx = min(lo, batch_size - 1)
            offset = (seg_start - (prefix[q_idx - 1] if q_idx else 0)) & _U32
            segs = (prefix[q_idx] - (prefix[q_idx - 1] if q_idx else 0)) & _U32
            meta[sm] = [q_idx + (offset // segs if segs else 0), offset % segs if segs else 0]
    faults.record()
    out = torch.tensor(meta, dtype=torch.int64)
    return ((out + 2**31) % 2**32 - 2**31).to(torch.int32).to(context_lens.device)


def q_prefetch_of(include: Path | None) -> str:
    """How an SM90 paged kernel pairs its scheduler's skip of requests without KV with the TMA warp's Q prefetch, read
    from the DeepGEMM headers under `include` (.../include/deep_gemm): "q+1" (the scheduler skips them, the prefetch
    loads request q + 1: the request after a skipped one is scored with its Q; vLLM 0.30.0 on), "next task" (it skips
    them, the prefetch loads the task the scheduler hands out next: 0.28.0, 0.29.0), "no skip" (a request without KV
    is a task of its own: up to 0.27). Without the headers, "q+1", as the DeepGEMM 2.8.1 this stand-in models."""
    kernel = include / "impls" / "sm90_fp8_paged_mqa_logits.cuh" if include else None
    if kernel is None or not kernel.is_file():
        return "q+1"
    scheduler = include / "scheduler" / "sm90_paged_mqa_logits.cuh"
    if not (scheduler.is_file() and "while (current_num_kv == 0" in scheduler.read_text()):
        return "no skip"
    return "q+1" if "issue_tma_q(q_stage_idx, q_idx + 1)" in kernel.read_text() else "next task"


@functools.cache
def q_prefetch() -> str:
    """`q_prefetch_of` the DeepGEMM the installed vLLM vendors (the headers its JIT compiles; a Python-only copy of
    vLLM has none)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return q_prefetch_of(None)
    return q_prefetch_of(Path(next(iter(spec.submodule_search_locations))) / "third_party/deep_gemm/include/deep_gemm")


def _hang(cluster: int, why: str) -> RuntimeError:
    return RuntimeError(f"attnfuzz stand-in of sm90_fp8_paged_mqa_logits: cluster {cluster} {why}: the real kernel "
                        "hangs there (or faults first reading past context_lens, block_table and logits)")


def _walk(cluster: int, start, end, batch_size: int, num_kv_of, faults: _Faults,
          skip: bool = True) -> list[tuple[int, int, int]]:
    """SM90PagedMQALogitsScheduler's tasks for one cluster, as runs (q, first kv, number of tasks): each task is 4
    compute blocks of 64 tokens from kv. num_kv_of(q) is ceil(context_lens[q, -1] / 64), None past the batch.
    `skip`: requests without KV are skipped (else each is one task, its compute blocks read block 0)."""
    per_split = SM90_SPLIT_KV // SM90_COMPUTE_BLOCK_KV
    q, kv = start[0] & _U32, (start[1] * per_split) & _U32
    eq, ekv = end[0] & _U32, (end[1] * per_split) & _U32

    def exist(i):
        return i < eq or (i == eq and ekv > 0)

    def refresh(i):
        got = num_kv_of(i)
        if got is None:  # context_lens read past its end: the kernel goes on with garbage
            faults.add("context_lens", i, batch_size, 4, "load", program=cluster)
            raise _hang(cluster, f"(schedule_meta rows {cluster}, {cluster + 1}) runs past the batch to request {i} of "
                        f"{batch_size}")
        return got

    num_kv = refresh(q) if exist(q) else 0
    runs = []
    while True:
        while skip and num_kv == 0 and not (q == eq and kv == ekv):  # requests without KV are skipped
            kv, q = 0, q + 1
            if q > eq:  # past its end: no refresh, num_kv stays 0, the loop runs until q wraps around
                raise _hang(cluster, f"never meets the end ({eq}, {end[1]}) of its schedule_meta range")
            if exist(q):
                num_kv = refresh(q)
        if q == eq and kv == ekv:
            return runs
        if q == eq and ekv >= kv and (ekv - kv) % per_split == 0 and ekv < max(num_kv, kv + 1):
            runs.append((q, kv, (ekv - kv) // per_split))
            return runs
        count = -(-(num_kv - kv) // per_split) if kv < num_kv else 1
        runs.append((q, kv, count))
        kv, q = 0, q + 1
        if q == eq and ekv == 0:
            return runs
        if not exist(q):  # the TMA warp did not prefetch q's Q (not in range): the math warps wait for it forever
            raise _hang(cluster, f"passes the end ({eq}, {end[1]}) of its schedule_meta range without meeting it")
        num_kv = refresh(q)


def fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                             logits_dtype=torch.float32, indices=None):
    """`deep_gemm.fp8_fp4_paged_mqa_logits` on SM90 (impls/sm90_fp8_paged_mqa_logits.cuh).

    kv_cache [num_blocks, block_kv, 1, D + 4] uint8 is read block-major, as attention.hpp's from_blob views make it:
    block p's first block_kv * D bytes are its tokens' e4m3 values (token r at r * D), the next block_kv * 4 bytes
    their fp32 scales; blocks kv_cache.stride(0) bytes apart.

    Returns [B * next_n, max_context_len] fp32, a view of rows align(max_context_len, 256) long. Each cluster (an SM;
    two for next_n 4) walks its schedule_meta range in tasks of 256 tokens (4 compute blocks of 64) of request b, up
    to ceil(L / 64) compute blocks, L = context_lens[b, next_n - 1]; a task writes all next_n rows of b at positions
    [64 c, 64 c + 64) of each compute block c it holds, with no masking:
        logits[b * next_n + n, j] = scale[p, r] * sum_h weights[b * next_n + n, h] * relu(q[b, n, h] . kv[p, r])
    where page j // block_kv is looked up in block_table[b] only when its compute block is < ceil(L / 64) and the page
    < ceil(L / block_kv); otherwise p is block 0 (the kernel's `: 0`). So a row holds real scores up to L (past its
    own context_lens[b, n] too), then the last page's stale tokens and block-0 tokens up to the next multiple of 256;
    the rest is not cleaned (`POISON`), and a request with L == 0 gets nothing.

    Q and weights are loaded one request ahead (the TMA warp prefetches request q + 1 when it starts request q):
    when a cluster skips a request without KV between two it processes, the later one is scored with the skipped
    request's Q and weights, as the kernel does, where the installed vLLM's DeepGEMM pairs that skip with that
    prefetch (`q_prefetch`).

    Out of bounds, each recorded: pages past block_table's width (read from whatever follows the row), table entries
    that are negative or >= num_blocks (TMA zero-fills them: scores 0), writes past a logits row (L beyond the row
    stride) or the allocation. A schedule_meta that walks a cluster past the batch or past its end raises a
    RuntimeError saying so (the kernel would hang or fault).
    """
    q_fp, q_sf = q
    _dg_assert(q_fp.dim() == 4, "q.dim() == 4", f"q has shape {tuple(q_fp.shape)}")
    batch_size, next_n, num_heads, head_dim = q_fp.shape
    if q_fp.dtype == _FP4:
        head_dim *= 2
    _dg_assert(next_n >= 1, "next_n >= 1")
    _check_q_and_weights(q_fp, q_sf, weights, batch_size * next_n, num_heads, head_dim)
    _dg_assert(kv_cache.dim() == 4, "kv_cache.dim() == 4")
    num_kv_blocks, block_kv, num_heads_kv, head_dim_with_sf = kv_cache.shape
    _dg_assert(block_kv in (32, 64), "(arch_major == 9 and (block_kv == 32 or block_kv == 64))", f"block_kv {block_kv}")
    _dg_assert(num_heads_kv == 1 and head_dim_with_sf == head_dim + 4,
               "num_heads_kv == 1 and head_dim_with_sf == kv_head_dim + sf_bytes")
    _dg_assert(kv_cache.stride(1) == head_dim_with_sf and kv_cache.stride(3) == 1,
               "fused_kv_cache.stride(1) == head_dim_with_sf and fused_kv_cache.stride(3) == 1")
    _dg_assert(kv_cache.dtype == torch.uint8, "fused_kv_cache.scalar_type() == torch::headeronly::ScalarType::Byte")
    stride0 = kv_cache.stride(0)
    _dg_assert(stride0 % 4 == 0, "kv_cache_stride_bytes % sf_bytes == 0")
    _dg_assert(block_table.dim() == 2 and block_table.size(0) == batch_size, "_batch_size == batch_size")
    _dg_assert(block_table.stride(1) == 1, "block_table.stride(1) == 1")
    _dg_assert(block_table.dtype == torch.int32, "block_table.scalar_type() == torch::headeronly::ScalarType::Int")
    _dg_assert(indices is None, "arch_major == 12 or is_varlen == (arch_major == 10)",
               "SM90 has no varlen (indices) path")
    _fp32_logits(logits_dtype)
    multicast = 2 if next_n == 4 else 1
    num_clusters = NUM_SMS // multicast
    _dg_assert(schedule_meta.dim() == 2 and tuple(schedule_meta.shape) == (num_clusters + 1, 2),
               "_schedule_meta_size == num_sms / num_kv_multicast + 1 and _meta_info_size == 2",
               f"schedule_meta {tuple(schedule_meta.shape)} on a device of {NUM_SMS} SMs")
    _dg_assert(schedule_meta.is_contiguous(), "schedule_meta.is_contiguous()")
    _dg_assert(schedule_meta.dtype == torch.int32, "schedule_meta.scalar_type() == torch::headeronly::ScalarType::Int")
    _dg_assert(context_lens.dim() == 2, "context_lens.dim() == 2",
               "DeepGEMM takes context_lens [B, next_n] only (vLLM unsqueezes 1-D lens)")
    _dg_assert(tuple(context_lens.shape) == (batch_size, next_n), "batch_size == __batch_size and next_n == _next_n")
    _dg_assert(context_lens.is_contiguous(), "context_lens.is_contiguous()")
    _dg_assert(context_lens.dtype == torch.int32, "context_lens.scalar_type() == torch::headeronly::ScalarType::Int")
    _dg_assert(q_fp.dtype == _E4M3, "qk_dtype == torch::headeronly::ScalarType::Float8_e4m3fn")
    _dg_assert(num_heads in (32, 64), "num_heads == 32 or num_heads == 64")
    _dg_assert(next_n in (1, 2, 4), "next_n == 1 or next_n == 2 or next_n == 4")
    max_context_len = int(max_context_len)
    stride = -(-max_context_len // SM90_SPLIT_KV) * SM90_SPLIT_KV if max_context_len > 0 else max_context_len
    device = q_fp.device
    buf = torch.full((batch_size * next_n, stride), POISON, dtype=torch.float32, device=device)
    if batch_size == 0 or num_kv_blocks == 0:
        raise _tma_zero_extent("q" if batch_size == 0 else "kv_cache")

    faults = _Faults("sm90_fp8_paged_mqa_logits")
    lens = [v & _U32 for v in context_lens[:, -1].tolist()]

    def num_kv_of(i):
        return _ceil_div_u32(lens[i], SM90_COMPUTE_BLOCK_KV) if i < batch_size else None

    meta = schedule_meta.tolist()
    runs = []  # [cluster, q, Q source, first kv, tasks]
    prefetch = q_prefetch()
    for c in range(num_clusters):
        prev = None
        for b, kv0, count in _walk(c, meta[c], meta[c + 1], batch_size, num_kv_of, faults, prefetch != "no skip"):
            ahead = prefetch == "q+1" and prev is not None and prev != b
            src = prev + 1 if ahead else b  # the Q the TMA warp prefetched
            if runs and runs[-1][1:3] == [b, src] and runs[-1][3] + 4 * runs[-1][4] == kv0:  # one range, one matmul
                runs[-1][4] += count
            else:
                runs.append([c, b, src, kv0, count])
            prev = b

    raw = _storage_flat(kv_cache)
    table = _storage_flat(block_table)
    table_view_end = (batch_size - 1) * block_table.stride(0) + block_table.size(1)
    flat, total = buf.view(-1), buf.numel()
    pages_per_block = SM90_COMPUTE_BLOCK_KV // block_kv
    q_f = q_fp.view(batch_size, next_n, num_heads, head_dim)
    for c, b, src, kv0, count in runs:
        blocks = torch.arange(kv0, kv0 + count * 4, dtype=torch.int64)  # compute blocks of this run
        num_kv, num_pages = num_kv_of(b), _ceil_div_u32(lens[b], block_kv)
        page = (blocks[:, None] * pages_per_block + torch.arange(pages_per_block)).reshape(-1)
        use_table = (page // pages_per_block < num_kv) & (page < num_pages)
        at = b * block_table.stride(0) + page
        past_width = use_table & (page >= block_table.size(1))
        inside = past_width & (at < table.numel())
        faults.add("block_table", int(at[past_width][0]) if past_width.any() else 0, table_view_end, 4, "load",
                   count=int(inside.sum()), inside=True, program=c)
        outside = use_table & (at >= table.numel())
        faults.add("block_table", int(at[outside][0]) if outside.any() else 0, table_view_end, 4, "load",
                   count=int(outside.sum()), program=c)
        read = use_table & ~outside
        phys = torch.zeros_like(page)
        if read.any():
            phys[read] = table[at[read].to(table.device)].long().cpu() & _U32
        bad = phys >= num_kv_blocks  # a negative entry reads as a huge uint32: TMA zero-fills the box
        faults.add("kv_cache", int(phys[bad][0]) * stride0 if bad.any() else 0, num_kv_blocks * stride0, 1, "load",
                   count=int(bad.sum()), program=c)  # pages
        rows = torch.arange(block_kv)
        tok_block = phys[:, None].expand(-1, block_kv).reshape(-1)
        tok_row = rows.repeat(len(page))
        tok_bad = bad[:, None].expand(-1, block_kv).reshape(-1)
        base = torch.where(tok_bad, 0, tok_block * stride0)
        val_at = base[:, None] + tok_row[:, None] * head_dim + torch.arange(head_dim)
        sf_at = base[:, None] + block_kv * head_dim + tok_row[:, None] * 4 + torch.arange(4)
        keys = raw[val_at.to(raw.device)].view(_E4M3)
        scales = raw[sf_at.to(raw.device)].contiguous().view(torch.float32).reshape(-1)
        tok_bad_d = tok_bad.to(device)
        keys = torch.where(tok_bad_d[:, None], 0.0, keys.float())
        scales = torch.where(tok_bad_d, 0.0, scales)
        if src < batch_size:
            vals = _head_logits(q_f[src], weights[src * next_n:(src + 1) * next_n], keys, scales)
        else:  # Q and weights past q: zero-filled
            faults.add("q", src * next_n * num_heads, batch_size * next_n * num_heads, head_dim, "load", program=c)
            vals = torch.zeros(next_n, keys.shape[0], device=device)
        positions = blocks[0] * SM90_COMPUTE_BLOCK_KV + torch.arange(keys.shape[0])
        for n in range(next_n):
            row = b * next_n + n
            dest = row * stride + positions
            past_row = positions >= stride
            faults.add("logits", int(dest[past_row][0]) if past_row.any() else 0, total, 4, "store",
                       count=int((past_row & (dest < total)).sum()), inside=True, program=c)
            out = dest >= total
            faults.add("logits", int(dest[out][0]) if out.any() else 0, total, 4, "store", count=int(out.sum()),
                       program=c)
            keep = ~out
            flat[dest[keep].to(device)] = vals[n][keep.to(device)]
    faults.record()
    return buf[:, :max(max_context_len, 0)]


def standin_module() -> SimpleNamespace:
    """The three functions under DeepGEMM's names (vllm/utils/deep_gemm.py binds them as its `_..._impl`)."""
    return SimpleNamespace(fp8_fp4_mqa_logits=fp8_fp4_mqa_logits, fp8_fp4_paged_mqa_logits=fp8_fp4_paged_mqa_logits,
                           get_paged_mqa_logits_metadata=get_paged_mqa_logits_metadata, get_num_sms=get_num_sms,
                           set_num_sms=set_num_sms)
