"""Stand-in for FlashInfer's `trtllm_batch_decode_with_kv_cache_mla` in its sparse forms (`sparse_mla_top_k > 0`), as
vLLM's FLASHINFER_MLA_SPARSE (SM100) and FLASHINFER_MLA_SPARSE_SM120 backends call it, on an emulated SM100 or SM120
device. flashinfer-python 0.7.2.post1 (the release vLLM 0.33.0 pins; no attnfuzz host installs it, and the kernels run
only on those devices) is what it follows.

What each part was read from:
- The Python API, its dispatch and every check it makes before a kernel runs: `flashinfer/mla/_core.py`,
  `trtllm_batch_decode_with_kv_cache_mla` -> `_trtllm_batch_decode_with_kv_cache_mla_impl` (its docstring, the
  `backend="auto"` choice: trtllm-gen on SM10x, "sparse" on SM12x), `_check_trtllm_gen_mla_shape`, and for SM120
  `_trtllm_batch_decode_sparse_mla_v32_sm120`, `_check_sm120_sparse_v32_kv_cache`,
  `_normalize_sm120_sparse_v32_topk_length`, `_trtllm_batch_decode_sparse_mla_sm120`,
  `_normalize_sparse_mla_indices_and_lens`, and `_sparse_mla_sm120/_execution.py` `normalize_kv_scale_format`.
- SM100 (trtllm-gen): the kernel is a closed cubin; its public parts are the launcher headers
  `include/flashinfer/trtllm/fmha/kernelParams.h` (sparse MLA reads K and V through a TMA descriptor of shape
  (head_dim_qk, INT_MAX) over the cache's base pointer with a row stride of head_dim_qk: a page-table entry is a flat
  row of the cache, whatever its page size, and nothing bounds it; `SparseMlaTopK must be a multiple of 4`) and
  `fmhaKernels.cuh` (sparse MLA uses one token per page; the attended window is min(max_seq_len, sparse_mla_top_k)),
  and the docstring: `seq_lens` are per-request lengths, the LSE is base 2 unless `return_lse_base="basee"`. That
  `seq_lens` bounds each row's active entries (the first seq_lens[b] of its page-table row) is vLLM's own statement
  of the contract at its call site (flashinfer_mla_sparse.py, `_forward_mqa_kernel`). NOT public, and said so in the
  result (`UNDOCUMENTED`) rather than guessed: a row of length 0 (its output and LSE are left NaN here), a -1 entry
  inside a row's length (read here as a zero row, what the TMA descriptor's out-of-bounds fill would load), a length
  past max_seq_len or past sparse_mla_top_k (clamped here to the page-table width), and which (query, kv) dtype
  pairs the launcher has kernels for (here: equal dtypes only, as vLLM's impl says; fp8 e4m3 for both).
- SM120 ("sparse" backend, DeepSeek-V3.2 and GLM-NSA formats): the kernel source ships with FlashInfer,
  `include/flashinfer/attention/sparse_mla_sm120/kernels/dsv32_fp8/decode.cuh` (decode; the prefill forms in
  `kernels/fp8_prefill/` mask the same way), `execution/merge.cuh`, `model/kv_cache_traits.cuh`,
  `model/scale_convert.cuh`, `compute/scale_mma.cuh`. Per token: `topk_len` = its length (all of `topk` when no
  lengths are passed) clamped to [0, topk]; a candidate counts if its position is below topk_len and its index is
  >= 0 (else a zero row, masked); row r of the 656-byte cache is at r x row stride + (r / page_size) x the page gap;
  nothing bounds r from above. Scores are q.k x sm_scale; the output is bf16, 0 for a token with no candidate, whose
  LSE is -inf (base 2 unless "basee"). Scales (`kv_scale_format`): "pow2_fp32" (and "auto", DeepSeek-V3.2) feeds
  the QK product's block-scaled MMA the exponent byte of each stored fp32 tile scale (mantissa dropped) while the PV
  product multiplies by the fp32 scale as stored; "arbitrary_fp32" (GLM) uses the stored scale in both. The kernel
  quantizes q and P to e4m3 for its MMAs; this stand-in computes in fp32 (the semantics, not those roundings).
  Which shapes the C++ dispatcher launches (decode up to 64 tokens; prefill heads and 64-wide index tiles) is not in
  this release's Python: forms past the decode envelope run with the same semantics and are noted as such.

Call forms neither backend makes are refused (`StandInRefused`, reported as could-not-test, never as vLLM's
answer): DCP (`enable_dcp`), variable-length q (`cum_seq_lens_q`), sinks, `backend` other than "auto", tensor bmm
scales, `sparse_mla_top_k_lens` (the native no-RoPE form), more than one query token per request, a cache whose rows
are not contiguous, the GLM-5.3 NoPE format, and dense MLA (`sparse_mla_top_k == 0`).

Memory the kernel would reach outside its tensors (a page-table entry past the cache; with LSE, trtllm-gen's
softmax-stats slab past the workspace) is recorded as a memory violation (`fuzzer.support.interp.sanitizer`) and the
entry skipped. `importable(major)` puts the entry point up as `flashinfer.decode` (and an empty `flashinfer`) for the
span of a `with` block only.
"""

from __future__ import annotations

import contextlib
import math

import torch

from fuzzer.support.errors import StandInRefused
from fuzzer.support.interp.sanitizer import VIOLATIONS, MemoryViolation
from fuzzer.support.standins.importable import importable_as, stand_in_module

__version__ = "0.7.2.post1"  # what this stand-in follows
OP = "trtllm_batch_decode_with_kv_cache_mla"
KERNEL = {10: f"{OP} (attnfuzz stand-in: trtllm-gen sparse MLA, SM100)",
          12: f"{OP} (attnfuzz stand-in: sparse MLA v32/GLM, SM120)"}
LOG2E = 1.0 / math.log(2.0)
FP8_MAX = 448.0
# _core.py: deepseek_mla_dimensions, smaller_mla_dimensions, nope_mla_dimensions (kv_lora_rank, qk_rope_head_dim)
MLA_DIMENSIONS = ((512, 64), (256, 64), (512, 0))
SM120_ENTRY_BYTES, SM120_NOPE, SM120_TILE = 656, 512, 128  # KVCacheTraits<DSV3_2>: 512 e4m3 + 4 fp32 + 64 bf16
SM120_DECODE_MAX_TOKENS = 64  # _sparse_mla_sm120/_policy.py: _DECODE_MAX_TOKENS
KV_SCALE_FORMATS = ("auto", "pow2_fp32", "arbitrary_fp32", "ue8m0_g32")
TRTLLM_SOFTMAX_STATS = (8, 256, 1 << 20)  # sizeof(float2), round_up(q_len=1, 256), the 1 MiB guard (vLLM's reading)

# What calls met that the kernel's public contract does not settle: (what, token rows concerned). The target reads
# and clears it after each call and puts it in the result.
UNDOCUMENTED: list[tuple[str, list[int]]] = []


def _undocumented(what: str, rows: torch.Tensor | list[int]) -> None:
    rows = rows.flatten().tolist() if isinstance(rows, torch.Tensor) else list(rows)
    UNDOCUMENTED.append((what, rows))


def _check(error: type, *checks: tuple[object, str]) -> None:
    """FlashInfer's checks in their order: raises `error` with the message of the first that failed."""
    for failed, message in checks:
        if failed:
            raise error(message)


def _refuse(what: str) -> StandInRefused:
    return StandInRefused(f"attnfuzz's stand-in of FlashInfer's {OP} does not model {what} (vLLM's sparse MLA "
                          "backends never pass it)")


def _check_shape_dtype_device(t: torch.Tensor, shape, dtype, device, name: str) -> None:
    """flashinfer.utils.check_shape_dtype_device."""
    _check(ValueError, (shape is not None and tuple(t.shape) != tuple(shape),
                        f"Invalid shape of {name}: expected {tuple(shape) if shape else None}, got {tuple(t.shape)}"),
           (dtype is not None and t.dtype != dtype, f"Invalid dtype of {name}: expected {dtype}, got {t.dtype}"),
           (t.device != device, f"Invalid device of {name}: expected {device}, got {t.device}"))


def _violation(kernel: str, argument: str, index: int, limit: int, elem_bytes: int, access: str = "load") -> None:
    VIOLATIONS.violations.append(MemoryViolation(
        kernel=kernel, op=access, argument=argument, byte_offset=index * elem_bytes, argument_bytes=limit * elem_bytes,
        element_bytes=elem_bytes, program_id=(0, 0, 0), lanes=1, inside_allocation=False))


def _entry_point(major: int):
    def trtllm_batch_decode_with_kv_cache_mla(
            query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim, block_tables,
            seq_lens, max_seq_len, sparse_mla_top_k=0, out=None, bmm1_scale=1.0, bmm2_scale=1.0, sinks=None,
            skip_softmax_threshold_scale_factor=None, enable_pdl=None, backend="auto", is_var_seq=True,
            uses_shared_paged_kv_idx=True, lse=None, return_lse=False, cute_dsl_impl="auto", kv_scale_format="auto",
            cum_seq_lens_q=None, max_q_len=None, multi_ctas_kv_counter_buffer=None, sparse_mla_top_k_lens=None,
            enable_dcp=False, cp_world=1, cp_rank=0, causal_seqlens_kv_global=None, use_fp16_softmax=None,
            return_lse_base=None):
        return _dispatch(major, **{k: v for k, v in locals().items() if k != "major"})  # its own arguments

    trtllm_batch_decode_with_kv_cache_mla.__doc__ = f"FlashInfer's {OP} on an emulated SM{major}0 ({__name__})."
    return trtllm_batch_decode_with_kv_cache_mla


def _dispatch(major: int, *, query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim,
              block_tables, seq_lens, max_seq_len, sparse_mla_top_k, out, bmm1_scale, bmm2_scale, sinks,
              skip_softmax_threshold_scale_factor, enable_pdl, backend, is_var_seq, uses_shared_paged_kv_idx, lse,
              return_lse, cute_dsl_impl, kv_scale_format, cum_seq_lens_q, max_q_len, multi_ctas_kv_counter_buffer,
              sparse_mla_top_k_lens, enable_dcp, cp_world, cp_rank, causal_seqlens_kv_global, use_fp16_softmax,
              return_lse_base):
    """_trtllm_batch_decode_with_kv_cache_mla_impl's checks and dispatch, in its order."""
    _check(ValueError, (return_lse_base is not None and return_lse_base not in ("basee", "base2"),
                        f"return_lse_base must be 'basee', 'base2', or None; got {return_lse_base!r}"))
    for name, scale in (("bmm1_scale", bmm1_scale), ("bmm2_scale", bmm2_scale)):
        _check(TypeError, (isinstance(scale, torch.Tensor) and scale.dtype != torch.float32,
                           f"{name} tensor must have dtype torch.float32"))
    _check(ValueError, (max_q_len is not None and cum_seq_lens_q is None,
                        "max_q_len is only supported when cum_seq_lens_q is provided"))
    if sparse_mla_top_k_lens is not None:
        _check(ValueError, ((kv_lora_rank, qk_rope_head_dim) != (512, 0),
                            "sparse_mla_top_k_lens is currently only supported by the native qk_rope_head_dim=0 "
                            "TRTLLM-GEN MLA path"))
        raise _refuse("sparse_mla_top_k_lens (the native no-RoPE trtllm-gen kernel)")
    _check(NotImplementedError, (kv_cache.dtype == torch.uint8 and sparse_mla_top_k <= 0,
                                 "Dense MLA decode does not support packed uint8 KV caches yet: no backend has an "
                                 "NVFP4 MLA decode kernel."))
    if sparse_mla_top_k <= 0:
        raise _refuse("dense MLA (sparse_mla_top_k == 0)")
    if enable_dcp or cum_seq_lens_q is not None or causal_seqlens_kv_global is not None:
        raise _refuse("DCP or variable-length queries (enable_dcp, cum_seq_lens_q)")
    if backend != "auto":
        raise _refuse(f"backend={backend!r} (vLLM passes the default, 'auto')")
    if sinks is not None or use_fp16_softmax:
        raise _refuse("sinks or use_fp16_softmax")
    if isinstance(bmm1_scale, torch.Tensor) or isinstance(bmm2_scale, torch.Tensor):
        raise _refuse("on-device (tensor) bmm scales")
    # backend "auto": SM10x keeps the trtllm-gen / cute-dsl choice, SM12x takes "sparse" for sparse MLA.
    if major == 12:
        return _sm120(query=query, kv_cache=kv_cache, workspace_buffer=workspace_buffer, kv_lora_rank=kv_lora_rank,
                      qk_rope_head_dim=qk_rope_head_dim, block_tables=block_tables, seq_lens=seq_lens,
                      sparse_mla_top_k=sparse_mla_top_k, out=out, bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale,
                      skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
                      uses_shared_paged_kv_idx=uses_shared_paged_kv_idx, lse=lse, return_lse=return_lse,
                      lse_base_e=return_lse_base == "basee", kv_scale_format=kv_scale_format,
                      multi_ctas_kv_counter_buffer=multi_ctas_kv_counter_buffer)
    if major != 10:
        raise _refuse(f"an SM{major}x device")
    return _sm100(query=query, kv_cache=kv_cache, workspace_buffer=workspace_buffer, kv_lora_rank=kv_lora_rank,
                  qk_rope_head_dim=qk_rope_head_dim, block_tables=block_tables, seq_lens=seq_lens,
                  max_seq_len=max_seq_len, sparse_mla_top_k=sparse_mla_top_k, out=out, bmm1_scale=bmm1_scale,
                  bmm2_scale=bmm2_scale, skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
                  uses_shared_paged_kv_idx=uses_shared_paged_kv_idx, lse=lse, return_lse=return_lse,
                  lse_base_e=return_lse_base == "basee")


# -- SM100: trtllm-gen -----------------------------------------------------------------------------------------------

def _sm100(*, query, kv_cache, workspace_buffer, kv_lora_rank, qk_rope_head_dim, block_tables, seq_lens, max_seq_len,
           sparse_mla_top_k, out, bmm1_scale, bmm2_scale, skip_softmax_threshold_scale_factor,
           uses_shared_paged_kv_idx, lse, return_lse, lse_base_e):
    kernel = KERNEL[10]
    _check(ValueError, (seq_lens is None, "seq_lens is required for trtllm-gen and cute-dsl MLA backends"))
    block_size, num_heads = kv_cache.size(-2), query.size(-2)
    not_supported = (f"trtllm-gen MLA decode does not support 64 < num_heads_q < 128; got num_heads_q={num_heads}. "
                     "Use backend='cute-dsl' instead when the remaining configuration is CuTeDSL-compatible."
                     if 64 < num_heads < 128 else
                     f"trtllm-gen requires block_size in (32, 64), got {block_size}" if block_size not in (32, 64)
                     else None)
    _check(ValueError, (skip_softmax_threshold_scale_factor is not None, "skip_softmax is not supported for sparse MLA"))
    kv_cache = _check_trtllm_gen_mla_shape(query, kv_cache, kv_lora_rank, qk_rope_head_dim, sparse_mla_top_k,
                                           block_tables)
    expected_out_shape = tuple(query.shape[:-1]) + (kv_lora_rank,)
    if out is None:  # FlashInfer: torch.empty, undefined until written; NaN here
        out = torch.full(expected_out_shape, float("nan"), dtype=torch.bfloat16, device=query.device)
    else:
        _check_shape_dtype_device(out, expected_out_shape, torch.bfloat16, query.device, "out")
    user_lse = lse
    if return_lse:
        flat = (query.size(0) * query.size(1), query.size(2))
        nested = (query.size(0), query.size(1), query.size(2))
        if lse is None:
            lse = user_lse = torch.full(flat, float("nan"), dtype=torch.float32, device=query.device)
        elif tuple(lse.shape) in (flat, nested):
            _check_shape_dtype_device(lse, lse.shape, torch.float32, query.device, "lse")
            lse = lse.view(flat)
        else:
            raise ValueError(f"lse must have shape {flat} or {nested}; got {tuple(lse.shape)}")
    # Runner choice (backend "auto"): cute-dsl never takes sparse MLA; trtllm-gen unless it said why not.
    _check(ValueError, (not_supported is not None,
                        f"auto: no backend supports this configuration (trtllm-gen: {not_supported}; cute-dsl: cute-dsl "
                        "backend (MLA decode kernel) does not support sparse_mla_top_k)"))
    _check(RuntimeError, (sparse_mla_top_k % 4 != 0, "SparseMlaTopK must be a multiple of 4"))  # kernelParams.h
    if query.dtype != kv_cache.dtype or query.dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        raise RuntimeError(f"trtllm-gen has no sparse MLA decode kernel for query {query.dtype} with kv_cache "
                           f"{kv_cache.dtype} (attnfuzz's stand-in: the launcher's kernel table is not public; vLLM's "
                           "impl states the kernel needs matching query and kv_cache dtypes)")
    if query.size(1) != 1:
        raise _refuse("more than one query token per request (q_len_per_request > 1)")
    if not uses_shared_paged_kv_idx:
        raise _refuse("uses_shared_paged_kv_idx=False")
    if not kv_cache.is_contiguous():
        raise _refuse("a KV cache whose pages are not contiguous rows (the TMA descriptor assumes them)")
    if return_lse:  # trtllm-gen carves its softmax-stats slab from the workspace when LSE is asked for
        stat, slots, guard = TRTLLM_SOFTMAX_STATS
        need = stat * num_heads * query.size(0) * slots + guard
        have = workspace_buffer.numel() * workspace_buffer.element_size()
        if need > have:
            _violation(kernel, "workspace_buffer", need - 1, have, 1, "store")
    tokens = query.size(0)
    rows = kv_cache.view(-1, kv_cache.shape[-1])  # one row a token: the TMA view (head_dim_qk, INT_MAX) over the cache
    table = block_tables.view(tokens, sparse_mla_top_k).long()
    lens = seq_lens.view(-1).long()
    _check(RuntimeError, (lens.numel() != tokens, f"seq_lens holds {lens.numel()} lengths for a batch of {tokens}"))
    width = min(int(max_seq_len), sparse_mla_top_k)  # fmhaKernels.cuh: the attended window
    host = lens.cpu()
    if (host > width).any():
        _undocumented(f"seq_lens past min(max_seq_len={max_seq_len}, sparse_mla_top_k={sparse_mla_top_k}) (clamped)",
                      (host > width).nonzero())
    if (host <= 0).any():
        _undocumented("seq_lens 0: trtllm-gen's output and LSE for a row of no entries are not public (left NaN)",
                      (host <= 0).nonzero())
    active = torch.arange(sparse_mla_top_k, device=table.device)[None, :] < lens.clamp(0, width)[:, None]
    negative = active & (table < 0)
    if negative.any():
        _undocumented("a -1 entry inside seq_lens: read as a zero row (the TMA descriptor's out-of-bounds fill; "
                      "whether the kernel masks it is not public)", negative.any(-1).nonzero())
    past = active & (table >= rows.shape[0])
    for i in table[past][:4].tolist():
        _violation(kernel, "kv_cache", i * rows.shape[1], rows.numel(), rows.element_size())
    keep = active & ~past
    zero = negative  # a zero key and value: it takes part in the softmax with score 0
    q = query[:, 0].float()
    o, l2 = _attend(q, rows, table, keep & ~zero, zero, float(bmm1_scale), None)
    o = o * float(bmm2_scale)
    written = lens > 0
    out.view(tokens, num_heads, -1)[written] = o[written].to(out.dtype)
    if return_lse:
        lse[written] = (l2[written] / LOG2E if lse_base_e else l2[written]).to(lse.dtype)
        return out, user_lse
    return out


def _check_trtllm_gen_mla_shape(query, kv_cache, kv_lora_rank, qk_rope_head_dim, sparse_mla_top_k, page_table):
    """_core.py _check_trtllm_gen_mla_shape, sparse form; returns kv_cache as 4D."""
    if query.ndim == 3:
        raise ValueError("batch_size and max_q_len are required when query.ndim == 3")
    _check(ValueError, (query.ndim != 4, f"Expected query.ndim == 3 or 4, got {query.ndim}"))
    num_seqs, num_tokens, _, qk_head_dim = query.shape
    if kv_cache.ndim == 3:
        kv_cache = kv_cache.unsqueeze(1)
    _check(ValueError, (kv_cache.ndim != 4, f"Expected kv_cache.ndim == 3 or 4, got {kv_cache.ndim}"),
           ((kv_lora_rank, qk_rope_head_dim) not in MLA_DIMENSIONS,
            f"Unsupported MLA dimensions, got kv_lora_rank={kv_lora_rank} and qk_rope_head_dim={qk_rope_head_dim}"))
    expected = kv_lora_rank + qk_rope_head_dim
    _check(ValueError, (qk_head_dim != expected or kv_cache.shape[3] != expected,
                        f"Expected head dim {expected} for query and kv_cache, got {qk_head_dim} and "
                        f"{kv_cache.shape[3]}"),
           (tuple(page_table.shape) != (num_seqs, num_tokens, sparse_mla_top_k),
            f"Expected page_table.shape == {(num_seqs, num_tokens, sparse_mla_top_k)}, got {tuple(page_table.shape)}"))
    return kv_cache


# -- SM120: the "sparse" backend ---------------------------------------------------------------------------------

def _sm120(*, query, kv_cache, workspace_buffer, kv_lora_rank, qk_rope_head_dim, block_tables, seq_lens,
           sparse_mla_top_k, out, bmm1_scale, bmm2_scale, skip_softmax_threshold_scale_factor,
           uses_shared_paged_kv_idx, lse, return_lse, lse_base_e, kv_scale_format, multi_ctas_kv_counter_buffer):
    kernel = KERNEL[12]
    _check(ValueError, (multi_ctas_kv_counter_buffer is not None,
                        "multi_ctas_kv_counter_buffer is only supported by the trtllm-gen backend"))
    # _trtllm_batch_decode_sparse_mla_v32_sm120
    fmt = str(kv_scale_format).lower().replace("-", "_")
    _check(ValueError, (sparse_mla_top_k <= 0, "SM120 sparse MLA v32/GLM requires sparse_mla_top_k > 0"),
           (skip_softmax_threshold_scale_factor is not None, "skip_softmax is not supported for sparse MLA"),
           (not uses_shared_paged_kv_idx,
            "SM120 sparse MLA v32/GLM expects shared sparse page indices (uses_shared_paged_kv_idx=True)"),
           (float(bmm2_scale) != 1.0, "SM120 sparse MLA v32/GLM does not support bmm2_scale"),
           (query.ndim != 4, f"Expected query.ndim == 4, got {query.ndim}"),
           (query.dtype != torch.bfloat16, f"SM120 sparse MLA v32/GLM expects BF16 query, got {query.dtype}"))
    rope_v32 = kv_lora_rank == 512 and qk_rope_head_dim == 64 and query.size(-1) == 576
    glm53_nope = kv_lora_rank == 512 and qk_rope_head_dim == 0 and query.size(-1) == 512 and fmt == "arbitrary_fp32"
    _check(ValueError, (not (rope_v32 or glm53_nope),
                        "SM120 sparse MLA expects either the v32/GLM_NSA 512+64 layout or GLM-5.3 native NoPE 512+0 "
                        f"with arbitrary_fp32 scales; got kv_lora_rank={kv_lora_rank}, qk_rope_head_dim="
                        f"{qk_rope_head_dim}, query dim={query.size(-1)}, kv_scale_format={kv_scale_format!r}"),
           (workspace_buffer.device != query.device,
            f"workspace_buffer must be on query device {query.device}, got {workspace_buffer.device}"))
    if glm53_nope:
        raise _refuse("the GLM-5.3 NoPE format (528-byte rows)")
    batch_size, q_len, num_heads, head_dim = query.shape
    _check(ValueError, (block_tables.dtype != torch.int32,
                        f"block_tables must have dtype torch.int32, got {block_tables.dtype}"),
           (block_tables.device != query.device,
            f"block_tables must be on query device {query.device}, got {block_tables.device}"),
           (tuple(block_tables.shape) != (batch_size, q_len, sparse_mla_top_k),
            "SM120 sparse MLA v32/GLM expects sparse block_tables shape "
            f"{(batch_size, q_len, sparse_mla_top_k)}, got {tuple(block_tables.shape)}"))
    # _check_sm120_sparse_v32_kv_cache
    _check(ValueError, (kv_cache.dtype != torch.uint8,
                        f"SM120 sparse MLA v32/GLM backend expects packed uint8 kv_cache, got {kv_cache.dtype}"),
           (kv_cache.ndim not in (3, 4), f"Expected kv_cache.ndim == 3 or 4, got {kv_cache.ndim}"),
           (kv_cache.ndim == 3 and kv_cache.size(-1) < SM120_ENTRY_BYTES,
            f"SM120 sparse MLA v32/GLM expects packed kv_cache last dim 656, got {tuple(kv_cache.shape)}"),
           (kv_cache.ndim == 4 and (kv_cache.size(1) != 1 or kv_cache.size(-1) < SM120_ENTRY_BYTES),
            "SM120 sparse MLA v32/GLM expects public HND kv_cache shape [num_pages, 1, page_size, 656] or 3D "
            f"shorthand [num_pages, page_size, 656], got {tuple(kv_cache.shape)}"))
    tokens = batch_size * q_len
    lengths = _sm120_lengths(seq_lens, batch_size, q_len, query.device)
    # _trtllm_batch_decode_sparse_mla_sm120
    _check(ValueError, (head_dim not in (512, 576),
                        f"Sparse MLA supports DSv4 head_dim=512 or DSv3.2/GLM head_dim=576, got {head_dim}"),
           (num_heads > 128, f"Expected num_heads <= 128, got {num_heads}"),
           (sparse_mla_top_k <= 0, "block_tables requires top-k > 0"))
    expected_out_shape = (batch_size, q_len, num_heads, 512)
    if out is None:
        out = torch.full(expected_out_shape, float("nan"), dtype=torch.bfloat16, device=query.device)
    else:
        _check_shape_dtype_device(out, expected_out_shape, torch.bfloat16, query.device, "out")
    flat_lse = (tokens, num_heads)
    if return_lse and lse is not None:
        _check(ValueError, (tuple(lse.shape) not in (flat_lse, (batch_size, q_len, num_heads)),
                            f"lse must have shape {flat_lse} or {(batch_size, q_len, num_heads)}; got {tuple(lse.shape)}"))
        _check_shape_dtype_device(lse, lse.shape, torch.float32, query.device, "lse")
    _check(ValueError, (fmt not in KV_SCALE_FORMATS,
                        f"kv_scale_format must be one of {sorted(KV_SCALE_FORMATS)}, got {kv_scale_format!r}"))
    if fmt == "ue8m0_g32":
        raise _refuse("kv_scale_format='ue8m0_g32' (DeepSeek-V4.1's 528-byte format)")
    if tokens == 0:  # the runner rejects max_num_tokens == 0: FlashInfer returns the buffers untouched
        return (out, lse if lse is not None else torch.empty(flat_lse, dtype=torch.float32, device=query.device)) \
            if return_lse else out
    if tokens > SM120_DECODE_MAX_TOKENS:
        _undocumented(f"{tokens} tokens: past the decode kernels' {SM120_DECODE_MAX_TOKENS}, FlashInfer's C++ "
                      "dispatcher picks a prefill kernel by rules this release's Python does not ship (run here with "
                      "the same masking, kernels/fp8_prefill)", [])
    kv4 = kv_cache if kv_cache.ndim == 4 else kv_cache.unsqueeze(1)
    pages, page_size = kv4.shape[0], kv4.shape[2]
    rows = pages * page_size
    idx = block_tables.view(tokens, sparse_mla_top_k).long()
    top = torch.full((tokens,), sparse_mla_top_k, dtype=torch.long, device=query.device) if lengths is None \
        else lengths.long().clamp(0, sparse_mla_top_k)
    candidate = (torch.arange(sparse_mla_top_k, device=idx.device)[None, :] < top[:, None]) & (idx >= 0)
    past = candidate & (idx >= rows)
    for i in idx[past][:4].tolist():  # r x row stride + (r / page_size) x page gap, unbounded
        _violation(kernel, "kv_cache", i * SM120_ENTRY_BYTES, rows * SM120_ENTRY_BYTES, 1)
    keep = candidate & ~past
    entries = kv4[:, 0].reshape(rows, kv4.shape[-1])  # page p, row j: entry p x page_size + j
    pow2 = fmt in ("auto", "pow2_fp32")
    q = query.view(tokens, num_heads, head_dim).float()
    o, l2 = _attend(q, entries, idx, keep, None, float(bmm1_scale), _sm120_decode(pow2))
    any_keep = keep.any(-1)
    o[~any_keep] = 0.0  # merge.cuh: no split with a candidate -> 0, LSE -inf
    l2[~any_keep] = -math.inf
    out.view(tokens, num_heads, 512).copy_(o.to(torch.bfloat16))
    if return_lse:
        result = l2 / LOG2E if lse_base_e else l2
        if lse is None:
            return out, result
        lse.view(flat_lse).copy_(result)
        return out, lse
    return out


def _sm120_lengths(seq_lens, batch_size: int, q_len: int, device):
    """_normalize_sm120_sparse_v32_topk_length: per-token active lengths, or None (every column active)."""
    if seq_lens is None:
        return None
    _check(ValueError, (seq_lens.dtype != torch.int32, f"seq_lens must have dtype torch.int32, got {seq_lens.dtype}"),
           (seq_lens.device != device, f"seq_lens must be on device {device}, got {seq_lens.device}"))
    flat = batch_size * q_len
    if seq_lens.ndim == 2 and tuple(seq_lens.shape) == (batch_size, q_len) or seq_lens.ndim == 1 and seq_lens.numel() == flat:
        return seq_lens.reshape(flat)
    if seq_lens.ndim == 1 and seq_lens.numel() == batch_size:
        return None
    raise ValueError("seq_lens for SM120 sparse MLA v32/GLM must be shaped either "
                     f"({batch_size},), ({flat},), or ({batch_size}, {q_len}); got {tuple(seq_lens.shape)}")


def _sm120_decode(pow2: bool):
    """(keys, values) of 656-byte entries [n, 656] as the SM120 kernel uses them: the NoPE's e4m3 bytes times its tile
    scale (for the QK product only the scale's exponent byte under pow2_fp32), the RoPE's bf16 as stored."""
    def decode(entries: torch.Tensor):
        nope = entries[:, :SM120_NOPE].contiguous().view(torch.float8_e4m3fn).float().unflatten(-1, (4, SM120_TILE))
        scales = entries[:, SM120_NOPE:SM120_NOPE + 16].contiguous().view(torch.float32)
        rope = entries[:, SM120_NOPE + 16:SM120_ENTRY_BYTES].contiguous().view(torch.bfloat16).float()
        qk_scales = (scales.view(torch.int32) & 0x7F800000).view(torch.float32) if pow2 else scales
        values = (nope * scales[..., None]).flatten(-2)
        keys = torch.cat([(nope * qk_scales[..., None]).flatten(-2), rope], dim=-1)
        return keys, values
    return decode


# -- the attention both compute ---------------------------------------------------------------------------------

# Bytes of fp32 keys and values gathered at once (tokens x entries x width): a CPU campaign's workers share a small
# host's memory.
CHUNK_BYTES = 64 << 20


def _attend(q: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor, keep: torch.Tensor, zero: torch.Tensor | None,
            scale: float, decode) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token t and head h: softmax over the kept entries e of idx[t] (and the `zero` ones, zero keys and values)
    of scale x q[t, h] . key(e), times value(e) (its first 512 elements). `decode(rows[idx]) -> (keys, values)` for a
    packed cache, else the rows themselves. Returns (out [T, H, 512] fp32, LSE [T, H] base 2; -inf for none)."""
    tokens, heads, _ = q.shape
    width = max(1, idx.shape[1])
    out = torch.zeros(tokens, heads, 512, dtype=torch.float32, device=q.device)
    lse = torch.full((tokens, heads), -math.inf, dtype=torch.float32, device=q.device)
    step = max(1, CHUNK_BYTES // (width * rows.shape[-1] * 8))
    for start in range(0, tokens, step):
        sl = slice(start, start + step)
        ids = idx[sl].clamp(0, max(rows.shape[0] - 1, 0))
        gathered = rows[ids.flatten()] if rows.shape[0] else rows.new_zeros(ids.numel(), rows.shape[-1])
        if decode is None:
            keys = gathered.float()
            values = keys[:, :512]
        else:
            keys, values = decode(gathered)
        keys, values = keys.view(*ids.shape, -1), values.reshape(*ids.shape, 512)
        mask = keep[sl] if zero is None else keep[sl] | zero[sl]
        # Entries not read (and the zero ones) hold zeros: a masked weight of 0 times a poisoned row is no NaN.
        keys = keys.masked_fill(~keep[sl][..., None], 0.0)
        values = values.masked_fill(~keep[sl][..., None], 0.0)
        s = torch.einsum("thd,ted->the", q[sl], keys) * scale
        s = s.masked_fill(~mask[:, None, :], -math.inf)
        m = s.amax(-1, keepdim=True)
        has = torch.isfinite(m)
        p = torch.exp(s - torch.where(has, m, torch.zeros_like(m)))
        total = p.sum(-1, keepdim=True)
        o = torch.einsum("the,ted->thd", p, values) / total.clamp_min(torch.finfo(torch.float32).tiny)
        out[sl] = torch.where(has, o, torch.zeros_like(o))
        lse[sl] = torch.where(has[..., 0], (m[..., 0] + torch.log(total[..., 0])) * LOG2E, lse[sl])
    return out, lse


SM100 = _entry_point(10)
SM120 = _entry_point(12)


@contextlib.contextmanager
def importable(major: int = 10):
    """`flashinfer` and `flashinfer.decode` (this stand-in's entry point for an SM`major`x device) importable inside
    the block, and only there."""
    top, decode = stand_in_module("flashinfer", True, __name__), stand_in_module("flashinfer.decode", False, __name__)
    decode.trtllm_batch_decode_with_kv_cache_mla = SM120 if major == 12 else SM100
    top.decode, top.__version__ = decode, __version__
    with importable_as({"flashinfer": top, "flashinfer.decode": decode}):
        yield decode
