"""A Step5 DSA case (Case.step5) as tensors, and the writers of what the model leaves in the caches before a step.

Deterministic from the case's seed, on any device. Every request holds, for each position, its attention key and
value ([groups, 192] each, bf16), its indexer key and z ([256] each, bf16: the CSA rows a region summary is made of);
each step holds its queries ([tokens, groups x heads, 192]), the indexer's fp8 queries ([groups, tokens, 8, 256],
group-major as the model's `qkv_indexer_norm_rope` lays them out, heads past `index_heads` zero), their fp32 head
weights and the headwise gate ([tokens, groups x heads], bf16).

The writers (torch, no vLLM): the packed KV cache [blocks, groups, block_size, 384] (K then V, bf16, or e4m3 of
x / k_scale and x / v_scale as bytes), the region summaries [blocks, 1, block_size // 8, 256] (fp8 bytes: the
online softmax over a region's eight rows in position order, as vLLM's `_update_decode` computes it) and the
CSA tail ring's rows ([key | z] bf16 at `base + position % capacity`). They write what earlier steps and the model's
fused QKV preparation left; the step's own summary and ring rows are vLLM's to write.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strategies.case import Case
from strategies.tensors import fp8_kv_scale, to_e4m3

HEAD_SIZE = 192
KV_STD = 1.0  # K and V are N(0, 1); a calibrated fp8 scale is fitted to it
PROXY_DIM = 256
PADDED_INDEX_HEADS = 8  # the model pads the indexer's heads of a group to 8 (the logits kernel's minimum)
REGION = 8  # tokens a region (a CSA summary) covers


@dataclass(frozen=True)
class Step5Inputs:
    k: list[torch.Tensor]  # per request: bf16 [seq_len, groups, 192]
    v: list[torch.Tensor]
    index_key: list[torch.Tensor]  # per request: bf16 [seq_len, 256]
    index_z: list[torch.Tensor]
    q: list[torch.Tensor]  # per step: bf16 [tokens, groups * heads, 192] (tokens: the requests', then padding rows)
    proxy_q: list[torch.Tensor]  # per step: fp8 e4m3 [groups, tokens, 8, 256] (the model's storage order)
    proxy_w: list[torch.Tensor]  # per step: fp32 [groups, tokens, 8]
    gate: list[torch.Tensor]  # per step: bf16 [tokens, groups * heads]
    k_scale: float
    v_scale: float


def positions(case: Case, step: int) -> list[int]:
    """Each request's token position at step `step` (0-based of Step5.steps; the last is the case's own)."""
    back = case.step5.steps - 1 - step
    return [r.context_len - back for r in case.requests]


def kv_scales(case: Case) -> tuple[float, float]:
    """The layer's k_scale and v_scale: 1.0 for bf16 and for an fp8 cache without calibrated scales; a calibrated
    checkpoint's otherwise (not powers of two, not equal)."""
    if case.kv_cache_dtype != "fp8" or case.fp8_scale == "pow2":
        return 1.0, 1.0
    k = fp8_kv_scale(case, std=KV_STD)
    return k, k * 1.375


def materialize_step5(case: Case, device: str = "cpu") -> Step5Inputs:
    x = case.step5
    g = torch.Generator().manual_seed(case.seed)
    groups, heads, n = x.groups, case.heads, len(case.requests)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    k, v, ik, iz = [], [], [], []
    for r in case.requests:
        k.append(randn(r.seq_len, groups, HEAD_SIZE, scale=KV_STD).bfloat16())
        v.append(randn(r.seq_len, groups, HEAD_SIZE, scale=KV_STD).bfloat16())
        key, z = randn(r.seq_len, PROXY_DIM), randn(r.seq_len, PROXY_DIM)
        if x.regions == "ties":  # every third closed region repeats region 0's rows: equal summaries, equal scores
            for start in range(3 * REGION, r.seq_len - REGION, 3 * REGION):
                key[start:start + REGION], z[start:start + REGION] = key[:REGION], z[:REGION]
        ik.append(key.bfloat16())
        iz.append(z.bfloat16())
    q, pq, pw, gate = [], [], [], []
    n += case.padded_tokens  # padding rows hold values too (what the runner's buffers last held)
    for _ in range(x.steps):
        q.append(randn(n, heads, HEAD_SIZE).bfloat16())
        proxy = torch.zeros(groups, n, PADDED_INDEX_HEADS, PROXY_DIM)
        proxy[:, :, : x.index_heads] = randn(groups, n, x.index_heads, PROXY_DIM, scale=0.5)
        pq.append(to_e4m3(proxy))
        w = torch.zeros(groups, n, PADDED_INDEX_HEADS)
        w[:, :, : x.index_heads] = torch.rand(groups, n, x.index_heads, generator=g)
        pw.append(w)
        gate.append(randn(n, heads, scale=2.0).bfloat16())
    ks, vs = kv_scales(case)
    dev = torch.device(device)
    return Step5Inputs([t.to(dev) for t in k], [t.to(dev) for t in v], [t.to(dev) for t in ik],
                       [t.to(dev) for t in iz], [t.to(dev) for t in q], [t.to(dev) for t in pq],
                       [t.to(dev) for t in pw], [t.to(dev) for t in gate], ks, vs)


def slot(case: Case, req: int, position: int) -> int:
    """The physical KV slot of request `req`'s token at `position`."""
    bs = case.block_size
    return case.block_table[req][position // bs] * bs + position % bs


# -- the writers -------------------------------------------------------------------------------------------------
def slots_of(case: Case, req: int, positions_: range, device) -> torch.Tensor:
    """The physical KV slots of request `req`'s tokens at `positions_` (int64)."""
    p = torch.arange(positions_.start, positions_.stop, positions_.step, dtype=torch.int64)
    row = torch.tensor(case.block_table[req], dtype=torch.int64)
    return (row[p // case.block_size] * case.block_size + p % case.block_size).to(device)


def write_kv(cache: torch.Tensor, case: Case, inp: Step5Inputs, req: int, positions_: range) -> None:
    """The packed cache [blocks, groups, block_size, 384] holds K then V of each written token: bf16 as is, or (a
    uint8 cache) e4m3 of K / k_scale and V / v_scale, the bytes vLLM's fp8 cache stores."""
    if not len(positions_):
        return
    bs = case.block_size
    s = slots_of(case, req, positions_, cache.device)
    k = inp.k[req][positions_.start:positions_.stop].float()
    v = inp.v[req][positions_.start:positions_.stop].float()
    if cache.dtype == torch.uint8:
        kv = to_e4m3(torch.cat([k / inp.k_scale, v / inp.v_scale], dim=-1)).view(torch.uint8)
    else:
        kv = torch.cat([k, v], dim=-1).to(cache.dtype)
    cache[s // bs, :, s % bs] = kv  # [tokens, groups, 384]


def encode_summaries(key: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Regions' summaries as vLLM's Triton `_update_decode` writes them (uint8 [regions, 256], e4m3 bytes), from
    their rows (key and z [regions, 8, 256]): an online softmax over a region's rows in position order, fp32, one
    running maximum over all 256 dims, each row weighted by exp(z - max); then numerator / max(denominator, 1e-20),
    rounded to bf16, then to e4m3. Elementwise per region (regions side by side change no rounding)."""
    key, z = key.float(), z.float()
    regions = key.shape[0]
    num = torch.zeros(regions, PROXY_DIM, dtype=torch.float32, device=key.device)
    den = torch.zeros_like(num)
    mx = torch.full((regions, 1), float("-inf"), dtype=torch.float32, device=key.device)
    for row in range(key.shape[1]):
        new = torch.maximum(mx, z[:, row].amax(dim=1, keepdim=True))
        scale = torch.where(den > 0, torch.exp(mx - new), torch.zeros((), device=key.device))
        w = torch.exp(z[:, row] - new)
        num, den, mx = num * scale + w * key[:, row], den * scale + w, new
    return to_e4m3((num / torch.clamp(den, min=1e-20)).bfloat16()).view(torch.uint8)


def encode_summary(key: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """One region's summary (uint8 [256]) from its rows (key and z [8, 256]): `encode_summaries` of one region."""
    return encode_summaries(key[None], z[None])[0]


def request_summaries(inp: Step5Inputs, req: int, regions: int) -> torch.Tensor:
    """The summaries of request `req`'s first `regions` regions (uint8 [regions, 256])."""
    span = regions * REGION
    return encode_summaries(inp.index_key[req][:span].view(regions, REGION, PROXY_DIM),
                            inp.index_z[req][:span].view(regions, REGION, PROXY_DIM))


def write_summaries(mean: torch.Tensor, case: Case, inp: Step5Inputs, req: int, regions: range) -> None:
    """Closed regions' summaries into the summary cache [blocks, 1, block_size // 8, 256] (uint8)."""
    if not len(regions):
        return
    bs = case.block_size
    values = request_summaries(inp, req, regions.stop)[regions.start:]
    s = slots_of(case, req, range(regions.start * REGION, regions.stop * REGION, REGION), mean.device)
    mean[s // bs, 0, s % bs // REGION] = values.to(mean.device)


def ring_row(case: Case, req: int, position: int, rows_per_block: int, capacity: int) -> int:
    """The CSA tail ring's row of a token: its request's first block's ring, `position % capacity` into it."""
    return case.block_table[req][0] * rows_per_block + position % capacity


def write_ring(rows: torch.Tensor, case: Case, inp: Step5Inputs, req: int, positions_: range, rows_per_block: int,
               capacity: int) -> None:
    """The open region's rows ([key | z], bf16 [512] each) the tail ring holds for later summarizing."""
    for p in positions_:
        row = ring_row(case, req, p, rows_per_block, capacity)
        rows[row, :PROXY_DIM] = inp.index_key[req][p]
        rows[row, PROXY_DIM:] = inp.index_z[req][p]
