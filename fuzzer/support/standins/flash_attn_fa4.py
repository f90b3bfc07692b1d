"""Stand-in for FlashAttention 4's CuTe-DSL forward (`_flash_attn_fwd`) in the one form vLLM 0.33.0 calls it: the
sparse-MLA top-k gather with a fused latent (`qv`), as FLASH_ATTN_MLA_SPARSE_FA4 (`FlashAttnMLASparseFA4Impl.
_forward_mqa_kernel`, vllm/v1/attention/backends/mla/flashattn_mla_sparse.py) reaches it through vLLM's own
`flash_attn_varlen_func(..., fa_version=4)` (vllm/vllm_flash_attn/flash_attn_interface.py, which imports it from
`vllm.vllm_flash_attn.cute.interface` at each call). The kernels run on SM100/SM110 only; no attnfuzz host has one.

Source of truth: the copy of FA4 vLLM 0.33.0 vendors (`vllm/vllm_flash_attn/cute/`, vllm-project/flash-attention),
which is newer than Dao-AILab/flash-attention's `flash_attn/cute/interface.py` at 0251105 (2026-08-15): that one has
`gather_kv_indices` but neither `gather_kv_valid_length` nor the SM100 sparse decode kernel. Read from the vendored
copy:
- `interface.py` `_flash_attn_fwd`: every check this form meets, in its order (shapes of k, v, cu_seqlens_q/k,
  seqused_k; equal dtypes of q, k, v, qv; int32 and contiguous length tensors; head dims (64, 512) for SM100; the qv
  block: qv.shape[:-1] == q.shape[:-1], head_dim_v 512, head_dim 64, tile_n 128, the gather's rows == qv's tokens, its
  width a multiple of 128, gather_kv_valid_length of the gather's rows, int32); the softmax scale's default
  1/sqrt(64 + 512); the LSE of the qv path [total_q, heads], natural log; `seqlen_k == 0 or total_q == 0`: out 0, LSE
  -inf, no launch; which kernel runs: `use_sparse_decode` (FlashAttentionMLADecodeSm100, 8/16/32/64 query heads per
  KV head) or FlashAttentionMLAForwardSm100 (128), and no split KV for the latter (head_dim_v 512 keeps
  `_get_fwd_config`'s heuristic at one split; an explicit one fails its assert).
- `flash_fwd_mla_decode_sm100.py` (`kernel`, `_softmax_block`, `corr_epilogue_loop`) and `flash_fwd_mla_sm100.py`
  (`topk_n_block_max`, the gather path): token m is batch b = `get_batch_from_cu_tensor(m, cu_seqlens_q)` (utils.py:
  the count of cu_seqlens_q[1:] <= m), its keys are rows cu_seqlens_k[b] + idx of k and v (`seqlen_info.py`
  `offset_batch_K`), the kernel walks max(1, min(ceil(valid / 128), width / 128)) blocks of 128 entries of its gather
  row (valid = gather_kv_valid_length[m]; every block without it), and an entry counts iff 0 <= idx < seqused_k[b]
  (`key_valid`; `topk_gather_kv.py` `compute_bitmask` / `compute_X_ptr`: a masked row is never loaded, cp.async with
  src_size 0). Entries past `valid` inside the last walked block are NOT masked by the length: only their value
  masks them (vLLM's conversion writes -1 there). Score (q.k + qv.v) x scale, softmax, P.v. A token with no counted
  entry: out 0, LSE -inf (rs == 0: `bad`; `flash_fwd_combine.py` keeps an all -inf row at -inf with scale 0).
- Numerics: the kernels round P to bf16 before the PV product and multiply by an approximate reciprocal of the row
  sum; this stand-in computes in fp32 (the semantics, not those roundings; the oracle's bf16 tolerance covers them).

Call forms vLLM's FA4 backend never makes are refused (`StandInRefused`: could not test, never vLLM's answer): no qv
or no gather (dense, paged), batched (no cu_seqlens), a page table, seqused_q, causal or windowed masks, softcap,
sinks, score/mask mods, block sparsity, aux tensors, descales, fp8 inputs, fused fp8 output, compile-only, gradients,
a pre-allocated LSE, query heads per KV head other than 8, 16, 32, 64, 128, a gather that is not int32. Memory the
kernel would reach outside its tensors is recorded as a violation (`fuzzer.support.interp.sanitizer`) and skipped: a
counted entry whose row cu_seqlens_k[b] + idx lies outside k / v (seqused_k past k's rows), and seqused_k read one
past its end for a token at or past cu_seqlens_q[-1] (the decode kernel's grid covers every row of q). Not checked
here: that the tensors are on a CUDA device (this stand-in runs on any). `importable()` puts this module up as
`vllm.vllm_flash_attn.cute.interface` for the span of a `with` block only.
"""

from __future__ import annotations

import math

import torch

from fuzzer.support.errors import StandInRefused
from fuzzer.support.standins.flash_attn_ops import KEY_CHUNK_BYTES, _violation, attend_rows
from fuzzer.support.standins.importable import importable_as, stand_in_module

OP = "_flash_attn_fwd"
KERNEL = f"{OP} (attnfuzz stand-in: FA4 CuTe-DSL sparse MLA, SM100)"
INTERFACE = "vllm.vllm_flash_attn.cute.interface"
TILE_N = 128
DECODE_HEADS = (8, 16, 32, 64)  # FlashAttentionMLADecodeSm100.SUPPORTED_HEADS reached through mla_decode_splits
FORWARD_HEADS = (128,)  # FlashAttentionMLAForwardSm100: what vLLM's backend hands it (128 heads, no DCP)


def _refuse(what: str) -> StandInRefused:
    return StandInRefused(f"attnfuzz's stand-in of FA4's {OP} does not model {what} (vLLM's FLASH_ATTN_MLA_SPARSE_FA4 "
                          "never passes it)")


def _validate_tensor(t, name, expected_shape, expected_dtype, expected_device):
    """interface.py `_validate_tensor` (its is_cuda assert left out: the stand-in runs on any device)."""
    assert t.shape == expected_shape, f"{name} shape {t.shape} != expected {expected_shape}"
    assert t.dtype == expected_dtype, f"{name} dtype {t.dtype} != expected {expected_dtype}"
    assert t.device == expected_device, f"{name} device {t.device} != expected {expected_device}"


def _flash_attn_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                    max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None, softmax_scale=None,
                    causal=False, dynamic_causal=None, softcap=None, window_size_left=None, window_size_right=None,
                    learnable_sink=None, tile_mn=None, mma_pv_is_rs=None, intra_wg_overlap=None, num_threads=384,
                    num_splits=1, pack_gqa=None, _arch=None, score_mod=None, mask_mod=None, block_sparse_tensors=None,
                    return_lse=False, out=None, lse=None, aux_tensors=None, aux_tensor_leading_dims=None,
                    aux_scalars=None, q_descale=None, k_descale=None, v_descale=None, gather_kv_indices=None,
                    gather_kv_valid_length=None, output_scale=None, compile_only=False, fp8_kv_dequant=False,
                    scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False):
    """FA4's forward on an emulated SM100, the sparse-MLA gather form only (see the module docstring).
    Returns (out, lse or None, None, None) as FA4 does."""
    if q is None or qv is None or gather_kv_indices is None:
        raise _refuse("a call without q, qv or gather_kv_indices (dense or paged attention)")
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise _refuse("the batched form (no cu_seqlens_q / cu_seqlens_k)")
    unmodelled = {"page_table": page_table, "seqused_q": seqused_q, "dynamic_causal": dynamic_causal,
                  "learnable_sink": learnable_sink, "score_mod": score_mod, "mask_mod": mask_mod,
                  "block_sparse_tensors": block_sparse_tensors, "aux_tensors": aux_tensors, "aux_scalars": aux_scalars,
                  "q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale, "output_scale": output_scale,
                  "lse": lse, "tile_mn": tile_mn, "scheduler_metadata": scheduler_metadata,
                  "window_size_left": window_size_left, "window_size_right": window_size_right}
    given = [name for name, value in unmodelled.items() if value is not None]
    if given or causal or softcap or compile_only or fp8_kv_dequant or min_seqlen_k is not None:
        raise _refuse(", ".join(given + [n for n, f in (("causal", causal), ("softcap", softcap),
                                                         ("compile_only", compile_only),
                                                         ("fp8_kv_dequant", fp8_kv_dequant),
                                                         ("min_seqlen_k", min_seqlen_k is not None)) if f]))
    if any(t.requires_grad for t in (q, k, v, qv)):
        raise _refuse("gradients (the backward)")
    if _arch not in (None, 100, 110):
        raise _refuse(f"arch {_arch} (it emulates SM100)")
    if v.dtype not in (torch.float16, torch.bfloat16):
        raise _refuse(f"{v.dtype} inputs (the qv path takes no descales: bf16/fp16 only)")
    if gather_kv_indices.dtype != torch.int32:
        raise _refuse(f"a {gather_kv_indices.dtype} gather_kv_indices (vLLM's is int32)")

    # _flash_attn_fwd's checks, in its order, for this form
    num_head, head_dim = q.shape[-2:]
    batch_size, total_q = cu_seqlens_q.shape[0] - 1, q.shape[0]
    seqlen_k, num_head_kv, head_dim_v = v.shape[-3], v.shape[-2], v.shape[-1]
    assert k is None or k.shape == (seqlen_k, num_head_kv, head_dim)
    assert v.shape == (seqlen_k, num_head_kv, head_dim_v)
    assert cu_seqlens_k.shape == (batch_size + 1,), "cu_seqlens_k must have shape (batch_size + 1,)"
    assert cu_seqlens_q.shape == (batch_size + 1,), "cu_seqlens_q must have shape (batch_size + 1,)"
    assert seqused_k is None or seqused_k.shape == (batch_size,), "seqused_k must have shape (batch_size,)"
    present = {name: t for name, t in {"q": q, "k": k, "v": v, "qv": qv}.items() if t is not None}
    names = list(present)
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            a, b = names[i], names[j]
            assert present[a].dtype == present[b].dtype, f"{a}.dtype {present[a].dtype} != {b}.dtype {present[b].dtype}"
    for t in (cu_seqlens_q, cu_seqlens_k, seqused_k):
        if t is not None:
            assert t.dtype == torch.int32, "cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k must be int32"
            assert t.stride(0) == 1, "cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k must be contiguous"
    assert num_head % num_head_kv == 0, "num_head must be divisible by num_head_kv"
    alignment = 16 // v.element_size()
    shape_ok = (8 <= head_dim <= 128 and 8 <= head_dim_v <= 128) or (head_dim, head_dim_v) in ((192, 128), (256, 256)) \
        or ((head_dim == 64 or head_dim == head_dim_v) and head_dim_v == 512)
    assert shape_ok and head_dim % alignment == 0 and head_dim_v % alignment == 0, (
        f"(head_dim, head_dim_v)=({head_dim}, {head_dim_v}) is not supported on SM100/SM110. "
        f"head_dim and head_dim_v must be between 8 and 128 and divisible by {alignment}, or (192, 128) for DeepSeek, "
        "or (256, 256) for hd256.")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim + head_dim_v)
    qhead_per_kvhead = num_head // num_head_kv
    if out is None:
        out = torch.empty(total_q, num_head, head_dim_v, dtype=q.dtype, device=v.device)
    else:
        _validate_tensor(out, "out", (total_q, num_head, head_dim_v), q.dtype, v.device)
    lse = torch.empty(total_q, num_head, dtype=torch.float32, device=v.device) if return_lse else None
    if seqlen_k == 0 or total_q == 0:
        out.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
        return out, lse, None, None
    sparse_decode = qhead_per_kvhead in DECODE_HEADS  # and every other condition of use_sparse_decode holds here
    if not sparse_decode and qhead_per_kvhead not in FORWARD_HEADS:
        raise _refuse(f"{qhead_per_kvhead} query heads per KV head (vLLM's backend takes 8, 16, 32, 64, 128)")
    # the qv block
    assert qv.shape[:-1] == q.shape[:-1]
    assert qv.shape[-1] == head_dim_v
    assert head_dim_v == 512
    assert head_dim == 64
    split = (num_splits or 1) > 1  # num_splits 0: the heuristic, one split at head_dim_v 512
    assert not split or sparse_decode, "split kv with qv is only supported on the varlen top-k gather path"
    assert gather_kv_indices.shape[:-1] == qv.shape[:-2]
    width = gather_kv_indices.shape[-1]
    assert width % TILE_N == 0
    if gather_kv_valid_length is not None:
        _validate_tensor(gather_kv_valid_length, "gather_kv_valid_length", gather_kv_indices.shape[:-1], torch.int32,
                         v.device)
        assert gather_kv_valid_length.stride(-1) == 1
    _gather_attend(q, k, v, qv, cu_seqlens_q, cu_seqlens_k, seqused_k, gather_kv_indices, gather_kv_valid_length,
                   softmax_scale, sparse_decode, out, lse)
    return out, lse, None, None


def _gather_attend(q, k, v, qv, cu_seqlens_q, cu_seqlens_k, seqused_k, gather, valid_length, scale, sparse_decode,
                   out, lse):
    """The kernels' per-token semantics (module docstring), every token at once, in fp32."""
    total_q, dev = q.shape[0], q.device
    batch_size, rows = cu_seqlens_q.shape[0] - 1, v.shape[0]
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    tokens = torch.arange(total_q, device=dev)
    batch = torch.searchsorted(cu_q[1:].contiguous(), tokens, right=True)  # get_batch_from_cu_tensor
    beyond = batch >= batch_size
    if beyond.any():
        if not sparse_decode:
            # FlashAttentionMLAForwardSm100 schedules tokens by cu_seqlens_q's batches: these rows are never written
            tokens, batch = tokens[~beyond], batch[~beyond]
        elif seqused_k is not None:  # the decode grid covers every row of q: its batch reads seqused_k[batch_size]
            _violation("seqused_k", batch_size, batch_size, 4, kernel=KERNEL)
            tokens, batch = tokens[~beyond], batch[~beyond]
    if tokens.numel() == 0:
        return
    limit = (seqused_k.long()[batch] if seqused_k is not None else cu_k[batch + 1] - cu_k[batch])
    full_blocks = gather.shape[-1] // TILE_N
    if valid_length is None:
        walked = torch.full_like(tokens, full_blocks)
    else:
        blocks = (valid_length.long()[tokens] + TILE_N - 1).div(TILE_N, rounding_mode="trunc")  # cute.ceil_div
        walked = blocks.clamp(max=full_blocks).clamp(min=1)
    window = walked * TILE_N
    chunk = max(1, KEY_CHUNK_BYTES // max(1, int(window.max()) * (q.shape[-1] + v.shape[-1]) * 4))
    for t0 in range(0, tokens.numel(), chunk):
        sl = slice(t0, t0 + chunk)
        tok = tokens[sl]
        idx = gather[tok, : int(window[sl].max())].long()
        j = torch.arange(idx.shape[1], device=dev)[None, :]
        live = (j < window[sl, None]) & (idx >= 0) & (idx < limit[sl, None])  # key_valid / the bitmask
        row = cu_k[batch[sl], None] + idx
        outside = live & ((row < 0) | (row >= rows))
        if outside.any():
            bad = int(row[outside][0])
            _violation("v", (bad + 1) * v.shape[1] * v.shape[-1] - 1, v.numel(), v.element_size(), kernel=KERNEL)
            _violation("k", (bad + 1) * k.shape[1] * k.shape[-1] - 1, k.numel(), k.element_size(), kernel=KERNEL)
        live &= ~outside
        o, row_lse = attend_rows(q[tok], qv[tok], k, v, row.clamp(0, max(rows - 1, 0)), live, scale)
        out[tok] = o.to(out.dtype)
        if lse is not None:
            lse[tok] = row_lse


def importable():
    """`vllm.vllm_flash_attn.cute.interface` (where vLLM's flash_attn_varlen_func imports `_flash_attn_fwd` from at
    fa_version=4) importable inside the block, and only there; its `_flash_attn_fwd` calls this module's, looked up at
    each call (a coverage probe's wrapper included)."""
    interface = stand_in_module(INTERFACE, False, __name__)
    interface.__doc__ = f"attnfuzz's stand-in for FA4's CuTe-DSL interface ({INTERFACE}), from {__name__}"

    def _flash_attn_fwd_standin(*args, **kwargs):
        return _flash_attn_fwd(*args, **kwargs)

    interface._flash_attn_fwd = _flash_attn_fwd_standin
    return importable_as({INTERFACE: interface})
