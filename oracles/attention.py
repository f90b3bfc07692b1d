"""Dense fp32/fp64 reference for sparse-MLA attention, the LSE merge, and tolerances.

vLLM has no standalone sparse-MLA reference (``reference_mla_sparse_prefill`` in the
ROCm backend returns a base-2 LSE and needs that backend importable), so the oracle
computes it directly: each query token attends to the kv rows its top-k row selects,
with the same semantics the kernels have (invalid entries skipped, duplicates counted,
an empty row giving out = 0 and lse = -inf, the identity of the LSE merge).
"""

import math

import torch

# Elements (float64) of gathered K or scores per token block: bounds memory for large T*H*K.
_BLOCK_ELEMS = 1 << 24


def sparse_mla_reference(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                         sm_scale: float, d_v: int = 512):
    """Sparse MLA: q [T, H, D], kv [S, D] (dequantized rows), indices [T, K] global row
    ids into kv (< 0 or >= S: not selected). Returns (out [T, H, d_v], lse [T, H]) in
    float32, lse in natural log. v is k[:, :d_v] (MLA shares K and V). Accumulates in
    float64, a block of tokens at a time."""
    T, H, D = q.shape
    S = kv.shape[0]
    assert kv.shape[-1] == D and indices.shape[0] == T and d_v <= D, (q.shape, kv.shape, indices.shape)
    K = indices.shape[1]
    device = kv.device
    out = torch.zeros(T, H, d_v, dtype=torch.float32, device=device)
    lse = torch.full((T, H), -math.inf, dtype=torch.float32, device=device)
    if S == 0 or K == 0 or T == 0:
        return out, lse
    block = max(1, _BLOCK_ELEMS // (K * max(D, H)))
    for t0 in range(0, T, block):
        idx = indices[t0:t0 + block].to(device=device, dtype=torch.long)
        valid = (idx >= 0) & (idx < S)  # [B, K]
        k = kv[torch.where(valid, idx, 0)].double()  # [B, K, D]
        qb = q[t0:t0 + block].to(device=device, dtype=torch.float64)  # [B, H, D]
        scores = torch.einsum("bhd,bkd->bhk", qb, k) * sm_scale
        mask = valid.unsqueeze(1)  # [B, 1, K]
        scores = scores.masked_fill(~mask, -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1)  # -inf for rows with no valid index
        p = torch.where(mask, torch.exp(scores - row_lse.unsqueeze(-1)), 0.0)
        out[t0:t0 + block] = torch.einsum("bhk,bkd->bhd", p, k[..., :d_v]).float()
        lse[t0:t0 + block] = row_lse.float()
    return out, lse


def counted_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts: torch.Tensor, sm_scale: float):
    """Attention of q [T, H, Dk] over per-head keys k [S, H, Dk] and values v [S, H, Dv], where query t takes
    key s `counts[t, s]` times (0: not selected; a top-k row that names a key twice counts it twice, as the
    sparse kernels do). float64; a row with no key gives 0. The form of a dense-MHA route's attention, whose
    keys and values are per head (the latent projected through W_UK and W_UV), over a sparse selection."""
    scores = torch.einsum("thd,shd->ths", q.double(), k.double()) * sm_scale
    counts = counts.double().unsqueeze(1)  # [T, 1, S]
    scores = scores.masked_fill(counts == 0, -math.inf)
    m = scores.amax(dim=-1, keepdim=True)
    w = counts * torch.exp(scores - torch.where(torch.isfinite(m), m, 0.0))
    total = w.sum(dim=-1, keepdim=True)
    return torch.einsum("ths,shv->thv", w / torch.where(total > 0, total, 1.0), v.double())


def lse_merge(outs: torch.Tensor, lses: torch.Tensor, base_e: bool = True):
    """LSE-weighted combine of N partial results (DCP ranks, context chunks):
    outs [N, T, H, D], lses [N, T, H] -> (out [T, H, D], lse [T, H]) in float32.
    base_e=False means the input LSEs are base 2 (FlashInfer); the merged LSE is
    returned in the same base as the inputs. Shards with lse = -inf carry no weight
    (their output is ignored even if NaN); if all are -inf the result is 0 / -inf."""
    to_e = 1.0 if base_e else math.log(2.0)
    lse_e = lses.double() * to_e
    m = lse_e.amax(dim=0)  # [T, H]
    m_safe = torch.where(torch.isfinite(m), m, 0.0)
    w = torch.where(torch.isneginf(lse_e), 0.0, torch.exp(lse_e - m_safe))  # [N, T, H]
    total = w.sum(dim=0)
    shard_out = torch.where(w.unsqueeze(-1) > 0, outs.double(), 0.0)
    out = (w.unsqueeze(-1) * shard_out).sum(dim=0) / torch.where(total > 0, total, 1.0).unsqueeze(-1)
    lse = torch.where(total > 0, m_safe + torch.log(total), -math.inf) / to_e
    return out.float(), lse.float()


def tolerance(dtype, kv_cache_dtype: str = "auto"):
    """(atol, rtol) for comparing a backend's output with the fp32 oracle.

    Taken from vLLM's upstream sparse-MLA backend tests: a quantized cache
    (fp8_ds_mla, or plain per-tensor fp8) gets atol 0.05, rtol 0.065, because the
    kernels also quantize/round q and P and the oracle sees only the cache's
    quantization; a 16-bit cache with bf16/fp16 output gets atol = rtol = 1e-2
    (bf16 has an 8-bit mantissa, ~4e-3 relative step, plus accumulation order).
    """
    dtype = str(dtype).removeprefix("torch.")
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(f"no tolerance for output dtype {dtype!r}")
    if kv_cache_dtype in ("fp8_ds_mla", "fp8", "fp8_e4m3"):
        return 0.05, 0.065
    if kv_cache_dtype in ("auto", "bfloat16", "float16"):
        return 1e-2, 1e-2
    raise ValueError(f"no tolerance for kv_cache_dtype {kv_cache_dtype!r}")


def error_margin(actual: torch.Tensor, expected: torch.Tensor, atol: float | torch.Tensor, rtol: float) -> float:
    """max |a - e| / (atol + rtol |e|) over elements (atol may be a tensor of e's shape: an elementwise tolerance);
    <= 1 means within tolerance.

    Where expected is non-finite (e.g. lse = -inf for an empty row) only an identical
    actual counts (exact, 0); a NaN/Inf actual where expected is finite gives +inf.
    """
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if actual.numel() == 0:
        return 0.0
    a = actual.detach().double()
    e = expected.detach().to(device=a.device, dtype=torch.float64)
    finite = torch.isfinite(e)
    diff = (a - e).abs()
    ratio = torch.where(diff == 0, 0.0, diff / (atol + rtol * e.abs()))  # atol = rtol = 0: exact
    ratio = torch.where(finite & ~torch.isfinite(a), math.inf, ratio)
    ratio = torch.where(finite, ratio, torch.where(a == e, 0.0, math.inf))
    return float(ratio.max())
