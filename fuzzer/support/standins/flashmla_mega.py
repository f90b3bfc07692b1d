"""Torch stand-ins for FlashMLA's mega-attention kernels (`torch.ops._flashmla_C.fused_norm_rope_attn_rope_cast_decode`
and `..._fwd`), as vLLM 0.33.0's DeepSeek-V4.1 mega layer calls them (`vllm/models/deepseek_v41/nvidia/
flash_mla_mega_attn.py`, FLASHMLA_MEGA_ATTN_DSV41, SM100).

The kernels are not in FlashMLA's public repository (deepseek-ai/FlashMLA at 9241ae3 has neither them nor an NVFP4
record), so their semantics are read from vLLM's call sites and docstrings only:
- q [s_q, h_q, 512] bf16 in the kernel's fused layout (`fused_layout.q_fused_permutation`: element d of head h at
  (d // 16) * (h_q * 16) + h * 16 + d % 16 of the token's h_q * 512 values), neither normed (enable_q_norm False) nor
  roped: the kernel applies GPT-J (interleaved, non-neox) RoPE to the last 64 dims at each token's position from
  `cos_sin_cache` [positions, 64] (cos in the first 32 columns, sin in the last 32), as vLLM's caches are written;
- sparse attention as FlashMLA's sparse decode (`flash_mla_with_kvcache`: the paged SWA cache of 528-byte records read
  through `indices` [s_q, topk] limited to `topk_length`, -1 skipped, plus the extra compressed cache's list, 528- or
  288-byte records) or sparse prefill (`flash_mla_sparse_fwd`: a bf16 [s_kv, 1, 512] workspace, entries outside
  [0, s_kv) skipped, "`indices` entries outside [0, s_kv) skip"), softmax scale `scale`, the sink as
  out x sigmoid(lse - sink), a row with no key 0;
- the output's inverse RoPE on the last 64 dims, then an MXFP8 cast: per 32 values one UE8M0 exponent (here
  ceil(log2(amax / 448)), DeepGEMM's convention; vLLM: "packed ue8m0 -- i.e. what DeepGEMM's fp8_einsum consumes"),
  the data [s_q, n_wv_group, 8 * 512] in the `o_fused_permutation` layout (group g's value for head h, dim c * 32 + j
  at (c * 8 + h) * 32 + j), the scales [s_q, n_wv_group, 32] int32, each holding the exponents of 4 consecutive
  32-value chunks of that layout, the first in the lowest byte.
What the public sources leave open, and the stand-in assumes: the UE8M0 rounding of the scale (any exponent that
holds the chunk is a correct cast; the oracle judges values, not exponents), the q layout when h_q exceeds the live
heads (refused: only h_q == the heads the fused layout was built for, TP1's 64, is modelled), what a row with no key
writes (0 here, as FlashMLA's sparse kernels). Refused: q norm, NeoX RoPE, rope dims other than 64, scale formats
other than vLLM's (32, TMA-aligned, round-to-nearest, packed), head_dim_v other than 512.
"""

from __future__ import annotations

import torch

from fuzzer.support.errors import StandInRefused
from fuzzer.support.standins import flashmla_ops

HEAD_DIM, ROPE_DIM, Q_CHUNK, O_CHUNK, GROUP, FP8_MAX = 512, 64, 16, 32, 8, 448.0
SF_ARGS = (32, True, True, True)  # vLLM's _SF_ARGS: per-32 scales, TMA-aligned col-major, round-to-nearest, packed

NOT_PUBLIC = ("FlashMLA's mega-attention kernels (fused_norm_rope_attn_rope_cast_decode / _fwd) are not in its public "
              "repository: their semantics are read from vLLM 0.33.0's call sites and docstrings (flash_mla_mega_attn.py, "
              "fused_layout.py); the output scales' UE8M0 rounding and what a row with no key writes are the stand-in's "
              "(ceil(log2(amax / 448)), 0)")


def from_fused_q(q: torch.Tensor) -> torch.Tensor:
    """[s_q, h, 512] in the kernel's fused q layout -> the standard layout (head h's 512 dims contiguous)."""
    s, h, d = q.shape
    return q.reshape(s, d // Q_CHUNK, h, Q_CHUNK).transpose(1, 2).reshape(s, h, d)


def gptj_rope(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """GPT-J RoPE of the last 64 dims of x [s, h, 512] (fp32) at `positions`: pair i = dims (448 + 2i, 449 + 2i)."""
    cs = cos_sin[positions.long()].float()
    c, s = cs[:, None, : ROPE_DIM // 2], cs[:, None, ROPE_DIM // 2:]
    s = -s if inverse else s
    out = x.clone()
    even, odd = x[..., HEAD_DIM - ROPE_DIM::2], x[..., HEAD_DIM - ROPE_DIM + 1::2]
    out[..., HEAD_DIM - ROPE_DIM::2] = even * c - odd * s
    out[..., HEAD_DIM - ROPE_DIM + 1::2] = odd * c + even * s
    return out


def _check_call(op: str, q, head_dim_v, enable_q_norm, is_neox, rope_dim, n_wv_group, sf_args, positions, cos_sin):
    if enable_q_norm or is_neox or rope_dim != ROPE_DIM or tuple(sf_args) != SF_ARGS or head_dim_v != HEAD_DIM:
        raise StandInRefused(f"{op}: only vLLM's call form is modelled (no q norm, GPT-J RoPE of 64 dims, scale args "
                             f"{SF_ARGS}, head_dim_v 512), got q_norm={enable_q_norm} neox={is_neox} rope_dim={rope_dim} "
                             f"sf={tuple(sf_args)} head_dim_v={head_dim_v}")
    if q.shape[1] != n_wv_group * GROUP:
        raise StandInRefused(f"{op}: {q.shape[1]} q heads for {n_wv_group} wo_a groups of {GROUP}: only q heads == "
                             "the groups' heads (no padding past the live heads) is modelled")
    bad = (positions < 0) | (positions >= cos_sin.shape[0])
    flashmla_ops._report(op, "cos_sin_cache", bad, positions.long(), cos_sin.shape[0], cos_sin.stride(0) * 4)
    return positions.long().clamp(0, cos_sin.shape[0] - 1)


def write_mxfp8(out: torch.Tensor, n_wv_group: int, out_data: torch.Tensor, out_scale: torch.Tensor) -> None:
    """out fp32 [s, n_wv_group * 8, 512] (standard layout) -> out_data / out_scale as the kernel lays them out."""
    s = out.shape[0]
    chunks = out.reshape(s, n_wv_group, GROUP, HEAD_DIM // O_CHUNK, O_CHUNK).transpose(2, 3)  # [s, g, c, h, j]
    chunks = chunks.reshape(s, n_wv_group, GROUP * HEAD_DIM // O_CHUNK, O_CHUNK)
    amax = chunks.abs().amax(dim=-1)
    exponent = torch.ceil(torch.log2(amax / FP8_MAX)).clamp(-127, 127).nan_to_num(-127.0)
    data = (chunks / torch.exp2(exponent)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out_data.copy_(data.reshape(out_data.shape).view(out_data.dtype))
    b = (exponent + 127).to(torch.int64).reshape(s, n_wv_group, -1, 4)
    packed = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    out_scale.copy_(((packed + 2**31) % 2**32 - 2**31).to(torch.int32))


def _finish(op, q_std, keys, invalid, scale, attn_sink, cos_sin, pos, n_wv_group, out_data, out_scale):
    s_q = q_std.shape[0]
    if out_data.shape[0] < s_q or out_scale.shape[0] < s_q:
        flashmla_ops._violation(op, "out_data", "store", s_q, out_data.shape[0], out_data[0].numel())
        return
    o, _, lse = flashmla_ops._sparse_attention(q_std, keys, invalid, scale, HEAD_DIM)
    if attn_sink is not None:
        o = o * torch.sigmoid(lse - attn_sink.float()[None]).nan_to_num(0.0)[..., None]
    o = gptj_rope(o, cos_sin, pos, inverse=True)
    write_mxfp8(o, n_wv_group, out_data[:s_q], out_scale[:s_q])


def fused_norm_rope_attn_rope_cast_decode(q, kv_cache, indices, scale, head_dim_v, attn_sink, topk_length,
                                          extra_kv_cache, extra_indices, extra_topk_length, enable_q_norm,
                                          rms_norm_eps, positions, is_neox, rope_dim, cos_sin_cache, n_wv_group,
                                          quant_group, tma_aligned, round_nearest, packed_ue8m0, out_data, out_scale):
    """Decode over the paged caches: kv_cache [pages, page, 1, 528] (the SWA cache), indices [s_q, topk] slot ids,
    topk_length [s_q]; extra_* the compressed cache's (528 or 288-byte records) or None."""
    op = "fused_norm_rope_attn_rope_cast_decode"
    pos = _check_call(op, q, head_dim_v, enable_q_norm, is_neox, rope_dim, n_wv_group,
                      (quant_group, tma_aligned, round_nearest, packed_ue8m0), positions, cos_sin_cache)
    if kv_cache.shape[-1] != flashmla_ops.V41_ENTRY_BYTES:
        raise StandInRefused(f"{op}: the SWA cache of {kv_cache.shape[-1]}-byte records (only V4.1's 528 is modelled)")
    if (extra_kv_cache is None) != (extra_indices is None):
        raise StandInRefused(f"{op}: extra_kv_cache comes with its indices")
    s_q = q.shape[0]
    q_std = gptj_rope(from_fused_q(q).float(), cos_sin_cache, pos)
    keys, invalid = flashmla_ops._decode_keys(op, kv_cache, indices, topk_length, s_q, 1, "kv_cache")
    if extra_kv_cache is not None:
        if extra_kv_cache.shape[-1] not in (flashmla_ops.V41_ENTRY_BYTES, flashmla_ops.V41_NVFP4_ENTRY_BYTES):
            raise StandInRefused(f"{op}: an extra cache of {extra_kv_cache.shape[-1]}-byte records")
        extra, extra_invalid = flashmla_ops._decode_keys(op, extra_kv_cache, extra_indices, extra_topk_length, s_q, 1,
                                                         "extra_kv_cache")
        keys, invalid = torch.cat([keys, extra], dim=1), torch.cat([invalid, extra_invalid], dim=1)
    _finish(op, q_std, keys, invalid, scale, attn_sink, cos_sin_cache, pos, n_wv_group, out_data, out_scale)


def fused_norm_rope_attn_rope_cast_fwd(q, kv, indices, scale, head_dim_v, attn_sink, topk_length, enable_q_norm,
                                       rms_norm_eps, positions, is_neox, rope_dim, cos_sin_cache, n_wv_group,
                                       quant_group, tma_aligned, round_nearest, packed_ue8m0, out_data, out_scale):
    """Prefill over a gathered bf16 workspace kv [s_kv, 1, 512] (RoPE applied), indices [s_q, 1, topk],
    topk_length [s_q]: entries outside [0, s_kv) or past a row's length skip."""
    op = "fused_norm_rope_attn_rope_cast_fwd"
    pos = _check_call(op, q, head_dim_v, enable_q_norm, is_neox, rope_dim, n_wv_group,
                      (quant_group, tma_aligned, round_nearest, packed_ue8m0), positions, cos_sin_cache)
    if kv.dim() != 3 or kv.shape[1] != 1 or indices.dim() != 3 or indices.shape[1] != 1:
        raise StandInRefused(f"{op}: kv [s_kv, 1, d] and indices [s_q, 1, topk] only, got {tuple(kv.shape)}, "
                             f"{tuple(indices.shape)}")
    q_std = gptj_rope(from_fused_q(q).float(), cos_sin_cache, pos)
    idx = indices[:, 0, :].long()
    invalid = ((idx < 0) | (idx >= kv.shape[0])
               | flashmla_ops._topk_length_mask(op, topk_length, idx.shape, idx.device))
    keys = kv[:, 0][idx.masked_fill(invalid, 0)].float()
    _finish(op, q_std, keys, invalid, scale, attn_sink, cos_sin_cache, pos, n_wv_group, out_data, out_scale)


class MegaOps:
    """`torch.ops._flashmla_C` as the mega layer reads it: these two ops (a missing one raises AttributeError)."""

    fused_norm_rope_attn_rope_cast_decode = staticmethod(fused_norm_rope_attn_rope_cast_decode)
    fused_norm_rope_attn_rope_cast_fwd = staticmethod(fused_norm_rope_attn_rope_cast_fwd)


class TorchWithMegaOps:
    """The mega layer module's `torch`: torch itself, but `torch.ops._flashmla_C` resolves to MegaOps."""

    class _Ops:
        def __getattr__(self, name):
            return MegaOps if name == "_flashmla_C" else getattr(torch.ops, name)

    ops = _Ops()

    def __getattr__(self, name):
        return getattr(torch, name)
