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
"""

from __future__ import annotations

import torch

from fuzzer.support.interp.sanitizer import SANITIZER, MemoryViolation

OP = "flash_attn_varlen_func"


def _violation(argument: str, index: int, limit: int, elem_bytes: int) -> None:
    SANITIZER.violations.append(MemoryViolation(
        kernel=f"{OP} (attnfuzz stand-in)", op="load", argument=argument, byte_offset=index * elem_bytes,
        argument_bytes=limit * elem_bytes, element_bytes=elem_bytes, program_id=(0, 0, 0), lanes=1,
        inside_allocation=False))


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_seqlen_q: int,
                           cu_seqlens_q: torch.Tensor, max_seqlen_k: int, cu_seqlens_k: torch.Tensor | None = None,
                           softmax_scale: float | None = None, causal: bool = False,
                           return_softmax_lse: bool = False, return_attn_probs: bool = False,
                           out: torch.Tensor | None = None,
                           output_scale: torch.Tensor | None = None, fa_version: int | None = None, **unused):
    if output_scale is not None:
        raise NotImplementedError(f"attnfuzz's {OP} stand-in writes no quantized output (output_scale)")
    if unused.get("seqused_k") is not None or unused.get("block_table") is not None:
        raise NotImplementedError(f"attnfuzz's {OP} stand-in takes contiguous varlen keys only")
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
