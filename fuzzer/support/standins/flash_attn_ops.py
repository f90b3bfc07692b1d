"""Stand-in for vLLM's compiled FlashAttention varlen kernel (`vllm.vllm_flash_attn.flash_attn_varlen_func`).

Releases before vLLM's CPU_SDPA_MLA prefill backend (0.23, 0.26) choose the FLASH_ATTN MLA prefill backend on a
host that reports no device capability (any CPU); that backend's Python is vLLM's, only the kernel it calls is
this stand-in. Semantics follow vllm_flash_attn's `flash_attn_varlen_func` docstring: q [total_q, H, D],
k [total_k, H_k, D], v [total_k, H_k, D_v]; request b's queries are q[cu_seqlens_q[b]:cu_seqlens_q[b+1]], its keys
k[cu_seqlens_k[b]:cu_seqlens_k[b+1]]; the LSE comes back with `return_softmax_lse` (vllm_flash_attn, CUDA/XPU)
or, as upstream flash_attn's `return_attn_probs` gives it (what vLLM's backend asks for on other platforms), as
(out, lse, None); `causal` aligns the mask to the bottom right (query i of sq sees key j <=
i + sk - sq); natural-log LSE [H, total_q] in fp32. A query row with no key to attend to (an empty context chunk)
is left as the kernel leaves it, undefined: NaN output, LSE -inf (vLLM's `mask_empty_context` neutralizes both).
Rows past cu_seqlens_q[-1] are not written. An offset past q or k is a memory violation, recorded and skipped.

The paged form FA3 takes from vLLM's FLASH_ATTN_MLA_SPARSE backend (`block_table=` with `seqused_k=`, and
`q_v=`) is `_paged_qv`: k and v are [num_pages, page_size, H_k, D] pages, batch b's key j is in page
block_table[b, j // page_size] at offset j % page_size, for j < seqused_k[b]; with q_v the score is
q.k + q_v.v (FA3's QV path). A batch with no key gets what FA3's epilogue stores for it (`store_zero`): output 0,
LSE -inf. A page id outside k's pages, or a table entry read past block_table's end, is a memory violation,
recorded; that key is skipped. Arguments FA3's mha_fwd refuses before it launches (hopper/flash_api.cpp: seqused_k
not int32 or not one count a batch, a page table not int32) are refused the same way, with its message: on the
H200 the real kernel refused a seqused_k of the whole batch's length handed to it with a token subset.
"""

from __future__ import annotations

import torch

from fuzzer.support.errors import StandInRefused
from fuzzer.support.interp.sanitizer import VIOLATIONS, MemoryViolation

OP = "flash_attn_varlen_func"


def _violation(argument: str, index: int, limit: int, elem_bytes: int, kernel: str = f"{OP} (attnfuzz stand-in)") -> None:
    VIOLATIONS.violations.append(MemoryViolation(
        kernel=kernel, op="load", argument=argument, byte_offset=index * elem_bytes,
        argument_bytes=limit * elem_bytes, element_bytes=elem_bytes, program_id=(0, 0, 0), lanes=1,
        inside_allocation=False))


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_seqlen_q: int,
                           cu_seqlens_q: torch.Tensor, max_seqlen_k: int, cu_seqlens_k: torch.Tensor | None = None,
                           softmax_scale: float | None = None, causal: bool = False,
                           return_softmax_lse: bool = False, return_attn_probs: bool = False,
                           out: torch.Tensor | None = None,
                           output_scale: torch.Tensor | None = None, fa_version: int | None = None, **unused):
    if fa_version == 4:  # vLLM's wrapper hands FA4 to its CuTe-DSL interface (stand-in: flash_attn_fa4)
        raise StandInRefused(f"attnfuzz's {OP} stand-in is FA2/FA3's; FA4 (fa_version=4) is flash_attn_fa4's")
    if output_scale is not None:
        raise NotImplementedError(f"attnfuzz's {OP} stand-in writes no quantized output (output_scale)")
    if unused.get("block_table") is not None:
        return _paged_qv(q, k, v, cu_seqlens_q, unused["seqused_k"], unused["block_table"], unused.get("q_v"),
                         q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale, causal, out,
                         return_softmax_lse or return_attn_probs)
    if unused.get("seqused_k") is not None or unused.get("q_v") is not None:
        raise NotImplementedError(f"attnfuzz's {OP} stand-in takes seqused_k and q_v only with a block_table")
    assert cu_seqlens_k is not None, "varlen keys need cu_seqlens_k"
    heads, d_v = q.shape[1], v.shape[-1]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    if out is None:
        out = torch.empty(q.shape[0], heads, d_v, dtype=q.dtype, device=q.device)
    lse = torch.full((heads, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.long().tolist(), cu_seqlens_k.long().tolist()
    group = heads // k.shape[1]
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 > q.shape[0] or k1 > k.shape[0]:  # the kernel would read past q or k
            if q1 > q.shape[0]:
                _violation("q", q1 * heads * q.shape[-1] - 1, q.numel(), q.element_size())
            if k1 > k.shape[0]:
                _violation("k", k1 * k.shape[1] * k.shape[-1] - 1, k.numel(), k.element_size())
            continue
        sq, sk = q1 - q0, k1 - k0
        if sq <= 0:
            continue
        if sk <= 0:
            out[q0:q1] = float("nan")  # nothing attended: the kernel's rows are undefined
            continue
        qb = q[q0:q1].float().transpose(0, 1)  # [H, sq, D]
        kb = k[k0:k1].float().transpose(0, 1).repeat_interleave(group, dim=0)
        vb = v[k0:k1].float().transpose(0, 1).repeat_interleave(group, dim=0)
        s = torch.matmul(qb, kb.transpose(-2, -1)) * scale
        if causal:
            i = torch.arange(sq, device=q.device)[:, None]
            j = torch.arange(sk, device=q.device)[None, :]
            s = s.masked_fill(j > i + (sk - sq), float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)  # [H, sq]
        p = torch.exp(s - row_lse[..., None])
        o = torch.matmul(p, vb).transpose(0, 1)  # [sq, H, D_v]
        empty = torch.isinf(row_lse).transpose(0, 1)  # causal rows that see no key (sq > sk)
        out[q0:q1] = o.masked_fill(empty[..., None], float("nan")).to(out.dtype)
        lse[:, q0:q1] = row_lse
    if return_attn_probs:  # upstream flash_attn's form (vLLM uses it off CUDA/XPU): (out, softmax_lse, S_dmask)
        return out, lse, None
    return (out, lse) if return_softmax_lse else out


KEY_CHUNK_BYTES = 64 << 20  # fp32 keys gathered at once (tokens x keys x width): bounds the stand-in's memory


def _paged_qv(q, k, v, cu_seqlens_q, seqused_k, block_table, q_v, scale, causal, out, with_lse):
    """FA3 over a page table (see the module docstring), every query token at once, in fp32."""
    total_q, heads, d_v = q.shape[0], q.shape[1], v.shape[-1]
    num_pages, page_size, kv_heads = k.shape[0], k.shape[1], k.shape[2]
    # mha_fwd's argument checks (CHECK_SHAPE / TORCH_CHECK), in its words
    if seqused_k.dtype != torch.int32:
        raise RuntimeError("seqused_k must have dtype int32")
    if tuple(seqused_k.shape) != (cu_seqlens_q.numel() - 1,):
        raise RuntimeError("seqused_k must have shape (batch_size)")
    if block_table.dtype != torch.int32:
        raise RuntimeError("page_table must have dtype torch.int32")
    if out is None:
        out = torch.empty(total_q, heads, d_v, dtype=q.dtype, device=q.device)
    lse = torch.full((heads, total_q), float("-inf"), dtype=torch.float32, device=q.device)
    cq = cu_seqlens_q.long()
    batches = cq.numel() - 1
    dev = q.device
    n_q = int(cq[-1])
    if n_q > total_q:
        _violation("q", n_q * heads * q.shape[-1] - 1, q.numel(), q.element_size())
        n_q = total_q
    if n_q == 0:
        return (out, lse) if with_lse else out
    tokens = torch.arange(n_q, device=dev)
    batch = torch.searchsorted(cq[1:], tokens, right=True)  # the batch of each query token
    sq = (cq[1:] - cq[:-1])[batch]
    sk = seqused_k.long()[batch]
    # Causal: query i of sq sees keys j <= i + sk - sq (bottom-right aligned).
    visible = (sk - (sq - 1 - (tokens - cq[batch]))).clamp(min=0) if causal else sk
    k_flat, v_flat = k.reshape(num_pages * page_size, kv_heads, -1), v.reshape(num_pages * page_size, kv_heads, -1)
    table = block_table.reshape(-1).long()
    width = block_table.shape[1] if block_table.dim() == 2 else block_table.numel() // max(batches, 1)
    max_keys = int(visible.max())
    chunk = max(1, KEY_CHUNK_BYTES // max(1, max_keys * (k.shape[-1] + d_v) * 4))
    for t0 in range(0, n_q, chunk):
        t1 = min(n_q, t0 + chunk)
        j = torch.arange(max_keys, device=dev)[None, :]
        live = j < visible[t0:t1, None]
        entry = batch[t0:t1, None] * width + j // page_size  # the table entry FA3 reads for key j
        past_table = live & (entry >= table.numel())
        if past_table.any():
            _violation("block_table", int(entry[past_table].max()), table.numel(), block_table.element_size())
        page = table[entry.clamp(max=table.numel() - 1)]
        outside = live & ~past_table & ((page < 0) | (page >= num_pages))
        if outside.any():
            bad = int(page[outside][0])
            _violation("k", (bad * page_size + page_size) * kv_heads * k.shape[-1] - 1, k.numel(), k.element_size())
        live &= ~past_table & ~outside
        row = (page.clamp(0, num_pages - 1) * page_size + j % page_size)  # [t, keys]
        o, row_lse = attend_rows(q[t0:t1], None if q_v is None else q_v[t0:t1], k_flat, v_flat, row, live, scale)
        out[t0:t1] = o.to(out.dtype)
        lse[:, t0:t1] = row_lse.transpose(0, 1)
    return (out, lse) if with_lse else out


def attend_rows(q, q_v, k_rows, v_rows, row, live, scale):
    """Each token t's heads over the key rows `row[t]` of k_rows / v_rows ([rows, H_k, D]) where `live[t]`, in fp32:
    score scale x (q.k + q_v.v) (q_v None: q.k), softmax, times v. Query heads in groups of H / H_k. Returns
    (out [t, H, D_v] fp32, natural-log LSE [t, H]); a token with no live key gets out 0 and LSE -inf (FA3's
    store_zero, FA4's empty row). `row` is in bounds wherever `live` (the caller checked it)."""
    tokens, heads = q.shape[0], q.shape[1]
    kv_heads = k_rows.shape[1]
    group = heads // kv_heads
    # [t, keys, H_k, D]. Keys not read are zero here, not the (poisoned) row a clamped index points at: 0 x NaN
    # would leak into the output.
    kt = k_rows[row].float().masked_fill(~live[..., None, None], 0.0)
    vt = v_rows[row].float().masked_fill(~live[..., None, None], 0.0)
    qg = q.float().view(tokens, kv_heads, group, -1)
    s = torch.einsum("tgzd,tkgd->tgzk", qg, kt)
    if q_v is not None:
        s = s + torch.einsum("tgzd,tkgd->tgzk", q_v.float().view(tokens, kv_heads, group, -1), vt)
    s = (s.reshape(tokens, heads, -1) * scale).masked_fill(~live[:, None, :], float("-inf"))
    row_lse = torch.logsumexp(s, dim=-1)  # [t, H]
    p = torch.exp(s - row_lse[..., None]).nan_to_num(0.0)  # a row with no key: 0
    o = torch.einsum("tgzk,tkgd->tgzd", p.view(tokens, kv_heads, group, -1), vt)
    return o.reshape(tokens, heads, -1), row_lse
