"""Stand-ins for the DeepGEMM functions vLLM 0.33.0's sparse-attention indexer calls (its vendored copy,
`vllm/third_party/deep_gemm`, whose `_C.py` forwards them to compiled SM90/SM100/SM120 kernels).

Semantics from the vendored package and vLLM's wrappers of it (`vllm/utils/deep_gemm.py`, whose docstrings state the
layouts): logits = sum over heads of relu(q_h . k) x w_h, k dequantized as its fp8 values times its fp32 scale; the
prefill logits compressed (row i holds keys [ks[i], ke[i]) from column 0), the paged decode logits one row per
(request, next_n) holding positions [0, context_len), and in both the part of a row past its keys "not cleaned":
the kernels leave whatever the allocation held, modelled here by POISON (a consumer that reads past a row's end picks
it, as it would pick stale logits on the GPU). The paged cache is block-major, as vLLM's `indexer_k_quant_and_cache`
writes it: a block holds block_size x head_dim fp8 values, then block_size fp32 scales.

Only the SM90 FP8 forms are modelled (FP4 Q or K, SM100's MX scales and bf16 logits are refused by name). The
scheduling metadata's split of the work over SMs is attnfuzz's even split (the real split is DeepGEMM's and the
stand-in kernel reads only its shape); the check of each stand-in against DeepGEMM's kernels on an H200 is
bench/deep_gemm_check.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from fuzzer.support.interp.sanitizer import SANITIZER, MemoryViolation

DEEP_GEMM_SOURCE = ("vLLM 0.33.0's vendored DeepGEMM: vllm/third_party/deep_gemm/_C.py (fp8_fp4_mqa_logits, "
                    "fp8_fp4_paged_mqa_logits, get_paged_mqa_logits_metadata), include/deep_gemm/impls/"
                    "sm90_fp8_mqa_logits.cuh, sm90_fp8_paged_mqa_logits.cuh; vllm/utils/deep_gemm.py's wrappers")
POISON = 3.0e38  # the uncleaned tail of a logits row (finite: NaN and inf take special paths in the top-k kernels)
SM90_NEXT_N = (1, 2, 4)


def _violation(op: str, argument: str, index: int, limit: int, elem_bytes: int, access: str = "load") -> None:
    SANITIZER.violations.append(MemoryViolation(
        kernel=f"deep_gemm.{op} (attnfuzz stand-in)", op=access, argument=argument, byte_offset=index * elem_bytes,
        argument_bytes=limit * elem_bytes, element_bytes=elem_bytes, program_id=(0, 0, 0), lanes=1,
        inside_allocation=False))


def _refuse(ok: bool, op: str, message: str) -> None:
    if not ok:
        raise RuntimeError(f"deep_gemm.{op} (attnfuzz stand-in): {message}")


def _sm90_fp8_q(op: str, q) -> torch.Tensor:
    q_fp, q_sf = q
    _refuse(q_sf is None, op, "a Q scale (FP4 or MX-scaled Q, SM100) is not modelled; SM90 folds it into weights")
    _refuse(q_fp.dtype == torch.float8_e4m3fn, op, f"q must be float8_e4m3fn on SM90, got {q_fp.dtype}")
    return q_fp


def fp8_fp4_mqa_logits(q, kv, weights: torch.Tensor, cu_seq_len_k_start: torch.Tensor,
                       cu_seq_len_k_end: torch.Tensor, max_seqlen_k: int, schedule_meta=None) -> torch.Tensor:
    """[M, max_seqlen_k] fp32: row i, column j the logit of key ks[i] + j for j < ke[i] - ks[i]; POISON after."""
    op = "fp8_fp4_mqa_logits"
    q_fp = _sm90_fp8_q(op, q)
    k_fp, k_sf = kv
    _refuse(k_fp.dtype == torch.float8_e4m3fn and k_sf is not None and k_sf.dtype == torch.float32, op,
            f"kv must be (float8_e4m3fn values, fp32 scales) on SM90, got ({k_fp.dtype}, "
            f"{getattr(k_sf, 'dtype', None)})")
    m, heads, dim = q_fp.shape
    _refuse(weights.dtype == torch.float32 and tuple(weights.shape) == (m, heads), op,
            f"weights must be fp32 [{m}, {heads}], got {weights.dtype} {tuple(weights.shape)}")
    _refuse(k_fp.shape[-1] == dim, op, f"q's head_dim {dim} and kv's {k_fp.shape[-1]} differ")
    _refuse(cu_seq_len_k_start.dtype == torch.int32 and cu_seq_len_k_end.dtype == torch.int32, op,
            "cu_seq_len_k_start/end must be int32")
    n = k_fp.shape[0]
    out = torch.full((m, max_seqlen_k), POISON, dtype=torch.float32, device=q_fp.device)
    ks, ke = cu_seq_len_k_start.long().cpu(), cu_seq_len_k_end.long().cpu()
    keys = k_fp.float() * k_sf.float().reshape(-1)[:, None]
    for i in range(m):
        start, end = int(ks[i]), int(ke[i])
        if end <= start:
            continue
        if start < 0 or end > n:  # the kernel reads keys [start, end) of kv, wherever they are
            _violation(op, "kv", end if end > n else start, n, dim)
            start, end = max(start, 0), min(end, n)
        length = end - start
        if length > max_seqlen_k:  # the kernel writes the row's logits past max_seqlen_k: into the next row
            _violation(op, "logits", i * max_seqlen_k + length, m * max_seqlen_k, 4, access="store")
            length = max_seqlen_k
        s = torch.einsum("hd,kd->hk", q_fp[i].float(), keys[start:start + length])
        out[i, :length] = (s.clamp(min=0) * weights[i].float()[:, None]).sum(dim=0)
    return out


def get_paged_mqa_logits_metadata(context_lens: torch.Tensor, block_size: int, num_sms: int,
                                  indices: torch.Tensor | None = None) -> torch.Tensor:
    """[num_sms + 1, 2] int32: SM s starts at (row, block) schedule[s] of the rows' blocks split evenly; the last
    entry is the end. (DeepGEMM's own split differs in detail; the stand-in kernel needs only its shape.)"""
    _refuse(indices is None, "get_paged_mqa_logits_metadata", "the varlen form (indices, SM100) is not modelled")
    _refuse(context_lens.dtype == torch.int32, "get_paged_mqa_logits_metadata", "context_lens must be int32")
    lens = context_lens.reshape(context_lens.shape[0], -1)[:, -1].long().cpu().clamp(min=0)
    blocks = (lens + block_size - 1) // block_size
    total = int(blocks.sum())
    starts = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), blocks]), 0)
    out = torch.zeros(num_sms + 1, 2, dtype=torch.int32)
    for s in range(num_sms + 1):
        at = min(total, -(-total * s // num_sms))
        row = int(torch.searchsorted(starts[1:], torch.tensor(at), right=True))
        out[s, 0], out[s, 1] = row, at - int(starts[min(row, len(blocks))])
    return out.to(context_lens.device)


def fp8_fp4_paged_mqa_logits(q, kv_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
                             block_table: torch.Tensor, schedule_meta: torch.Tensor, max_context_len: int,
                             indices: torch.Tensor | None = None) -> torch.Tensor:
    """[B * next_n, max_context_len] fp32: row (b, j) the logits of positions [0, context_lens[b, j]) read through
    block_table[b] (1-D context_lens: L_b - next_n + j + 1); POISON after."""
    op = "fp8_fp4_paged_mqa_logits"
    q_fp = _sm90_fp8_q(op, q)
    _refuse(indices is None, op, "the varlen form (indices, SM100) is not modelled")
    b_count, next_n, heads, dim = q_fp.shape
    _refuse(next_n in SM90_NEXT_N, op, f"SM90's kernel takes next_n in {SM90_NEXT_N}, got {next_n}")
    _refuse(weights.dtype == torch.float32 and tuple(weights.shape) == (b_count * next_n, heads), op,
            f"weights must be fp32 [{b_count * next_n}, {heads}], got {weights.dtype} {tuple(weights.shape)}")
    _refuse(kv_cache.dtype == torch.uint8 and kv_cache.shape[-1] == dim + 4, op,
            f"kv_cache must be uint8 [..., {dim + 4}], got {kv_cache.dtype} {tuple(kv_cache.shape)}")
    _refuse(block_table.dtype == torch.int32 and block_table.stride(-1) == 1, op,
            "block_table must be int32 with stride(-1) == 1")
    _refuse(context_lens.dtype == torch.int32, op, "context_lens must be int32")
    num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[1]
    _refuse(tuple(schedule_meta.shape)[1:] == (2,), op, f"schedule_meta must be [slots + 1, 2], got "
                                                       f"{tuple(schedule_meta.shape)}")
    flat = kv_cache.reshape(num_blocks, -1)
    values = flat[:, : block_size * dim].reshape(num_blocks * block_size, dim).view(torch.float8_e4m3fn).float()
    scales = flat[:, block_size * dim:].contiguous().view(torch.float32).reshape(-1)
    keys = values * scales[:, None]
    lens = context_lens.long().cpu()
    table = block_table.long().cpu()
    out = torch.full((b_count * next_n, max_context_len), POISON, dtype=torch.float32, device=q_fp.device)
    for b in range(b_count):
        for j in range(next_n):
            row = b * next_n + j
            length = int(lens[b, j]) if lens.dim() == 2 else int(lens[b]) - next_n + j + 1
            if length <= 0:
                continue
            if length > max_context_len:  # the kernel writes past the row: into the next one
                _violation(op, "logits", row * max_context_len + length, b_count * next_n * max_context_len, 4,
                           access="store")
                length = max_context_len
            pos = torch.arange(length)
            at = pos // block_size
            if int(at.max()) >= table.shape[1]:
                _violation(op, "block_table", b * table.shape[1] + int(at.max()), table.numel(), 4)
            ids = table[b, at.clamp(max=table.shape[1] - 1)]
            bad = (ids < 0) | (ids >= num_blocks) | (at >= table.shape[1])
            for i in bad.nonzero().flatten()[:1].tolist():
                _violation(op, "kv_cache", int(ids[i]) * block_size, num_blocks * block_size, dim + 4)
            slots = (ids.clamp(0, num_blocks - 1) * block_size + pos % block_size).to(keys.device)
            s = torch.einsum("hd,kd->hk", q_fp[b, j].float(), keys[slots])
            logits = (s.clamp(min=0) * weights[row].float()[:, None]).sum(dim=0)
            out[row, :length] = torch.where(bad.to(logits.device), POISON, logits)
    return out


def standin_module() -> SimpleNamespace:
    """The three functions under DeepGEMM's names, as vLLM's wrappers bind them (`_dg.<name>`)."""
    return SimpleNamespace(fp8_fp4_mqa_logits=fp8_fp4_mqa_logits, fp8_fp4_paged_mqa_logits=fp8_fp4_paged_mqa_logits,
                           get_paged_mqa_logits_metadata=get_paged_mqa_logits_metadata)
