"""Case -> tensors, deterministically from the case's seed, on any device.

The tensors are what vLLM's metadata builder would hand a sparse-MLA backend for this step:
`req_id_per_token`, `block_table`, `topk_indices` (request-local positions, -1 = not selected), the
prefill-workspace rows, and (for DCP) the rank-local view. No vLLM import: oracles never call the target.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from strategies.case import INVALID_AT, Case

TILE = 16  # the attention kernels' softmax tile along top-k (bug class I: whole leading tiles of -1)


@dataclass(frozen=True)
class IndexInputs:
    req_id_per_token: torch.Tensor  # int32 [num_tokens]: batch row of each token
    block_table: torch.Tensor  # int32 [rows, width]
    topk_indices: torch.Tensor  # int32 [num_tokens, topk_width]
    idx_mapping: torch.Tensor | None  # int32 [num_reqs]
    prefill_request_id: torch.Tensor  # int32 [num_tokens]: -1 for decode tokens, else prefill index
    prefill_workspace_starts: torch.Tensor  # int32 [num_prefills]: workspace row of each prefill's token 0
    seq_lens: torch.Tensor  # int32 [num_reqs]
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]


def _topk_indices(case: Case, table_tokens: int, g: torch.Generator) -> torch.Tensor:
    """int64 [num_tokens, topk_width], every query row at once. A row of request r holds `valid` distinct
    visible positions (capped by what is visible and by the width), then `past_seq` entries past the sequence
    but inside the block table, then `past_table` entries just past the block table (the last one far past it,
    a wrapped/garbage index), truncated to the width; the rest are -1, placed as `invalid_at` says. The valid
    positions are a random choice of the visible ones, or (pick "recent") the newest.

    Only the random permutations are drawn row by row: torch has no batched randperm, and a randperm per row
    (a shuffle in C, O(visible)) costs less on a CPU than top-k or a sort over random keys for every visible
    position of every row (one CPU thread, 512 rows over 4,608 positions: randperms ~15 ms, rand + topk ~35 ms)."""
    width, specs, num_tokens = case.topk_width, case.topk, case.num_tokens
    if num_tokens == 0:
        return torch.zeros(0, width, dtype=torch.int64)
    query_lens = torch.tensor([r.query_len for r in case.requests])

    def per_token(values) -> torch.Tensor:  # one value per request -> one per query token
        return torch.tensor(values, dtype=torch.int64).repeat_interleave(query_lens)

    seq_len = per_token([r.seq_len for r in case.requests])
    # Causal: query i of a request sees its own position and all before it.
    visible = torch.cat([torch.arange(r.context_len + 1, r.seq_len + 1) for r in case.requests])
    n_valid = torch.minimum(visible, per_token([min(s.valid, width) for s in specs]))
    past_seq = torch.where(seq_len < table_tokens, per_token([s.past_seq for s in specs]), 0)
    past_table = per_token([s.past_table for s in specs])
    length = (n_valid + past_seq + past_table).clamp(max=width)  # entries that fit in the row
    n_invalid = width - length
    at = {name: per_token([s.invalid_at == name for s in specs]).bool() for name in INVALID_AT}
    # Where the entries start: head puts every -1 first; leading_tiles whole 16-wide tiles of -1, the rest after.
    lead = torch.where(at["head"], n_invalid, 0)
    lead = torch.where(at["leading_tiles"], torch.minimum(n_invalid, TILE * (1 + n_invalid // (4 * TILE))), lead)

    # The rows are written by scatter into a -1 row with one spare column, the sink of entries past the width.
    topk = torch.full((num_tokens, width + 1), -1, dtype=torch.int64)
    # Valid: the first n_valid of one permutation of the visible positions per row (all rows' permutations
    # end to end in one tensor, padded so that every row can read max(n_valid) of it).
    k = int(n_valid.max())
    permuted = torch.where(n_valid > 0, visible, 0)
    flat = torch.cat([torch.randperm(v, generator=g) for v in permuted.tolist() if v]
                     + [torch.zeros(k, dtype=torch.int64)])
    m = torch.arange(k)
    valid = flat.take((permuted.cumsum(0) - permuted)[:, None] + m)
    # recent: the newest n_valid visible positions, newest first (the last slots of the row's sequence).
    recent = per_token([s.pick == "recent" for s in specs]).bool()
    valid = torch.where(recent[:, None], (visible[:, None] - 1 - m).clamp(min=0), valid)
    topk.scatter_(1, torch.where(m < n_valid[:, None], lead[:, None] + m, width), valid)
    # Then past_seq entries (past the sequence, inside the block table), then past_table ones (just past the
    # table; the last of several far past it: a wrapped/garbage index).
    n_seq, n_table = int(past_seq.max()), int(past_table.max())
    # A bound per row by modulo (randint takes one bound); the bias, span / 2**40, is nil.
    seq_extra = seq_len[:, None] + torch.randint(0, 2**40, (num_tokens, n_seq), generator=g) % (
        (table_tokens - seq_len).clamp(min=1)[:, None])
    table_extra = table_tokens + torch.randint(0, 4096, (num_tokens, n_table), generator=g)
    far = (past_table > 1).nonzero().flatten()
    table_extra[far, past_table[far] - 1] += 2**30
    extra = torch.cat([seq_extra, table_extra], dim=1)
    i = torch.arange(n_seq + n_table)
    kept = torch.where(i < n_seq, i < past_seq[:, None], i - n_seq < past_table[:, None])
    pos = lead[:, None] + n_valid[:, None] + kept.cumsum(1) - 1
    topk.scatter_(1, torch.where(kept & (pos < lead[:, None] + length[:, None]), pos, width), extra)
    topk = topk[:, :width]
    scattered = at["scattered"].nonzero().flatten()
    if len(scattered):  # the whole row shuffled
        perm = torch.stack([torch.randperm(width, generator=g) for _ in range(len(scattered))])
        topk[scattered] = topk[scattered].gather(1, perm)
    return topk


def materialize_index_inputs(case: Case, device: str | torch.device = "cpu") -> IndexInputs:
    g = torch.Generator().manual_seed(case.seed)
    d = case.dcp
    width = len(case.block_table[0])
    # Under DCP the block table is the rank's: it spans rank-local positions, which cover
    # dcp_size times as many global positions.
    table_tokens = width * case.block_size * d.size
    topk = _topk_indices(case, table_tokens, g)
    req_ids, prefill_ids, starts = [], [], []
    workspace = 0
    for r, req in enumerate(case.requests):
        is_prefill = r >= case.num_decodes
        if is_prefill:
            starts.append(workspace)
            workspace += req.seq_len
        req_ids += [r] * req.query_len
        prefill_ids += [len(starts) - 1 if is_prefill else -1] * req.query_len
    qsl = [0]
    for req in case.requests:
        qsl.append(qsl[-1] + req.query_len)

    def i32(x, shape=None):
        t = torch.tensor(x, dtype=torch.int32)
        return (t.reshape(shape) if shape is not None else t).to(device)

    return IndexInputs(
        req_id_per_token=i32(req_ids, (-1,)),
        block_table=i32(case.block_table),
        topk_indices=topk.to(torch.int32).to(device),
        idx_mapping=None if case.idx_mapping is None else i32(case.idx_mapping),
        prefill_request_id=i32(prefill_ids, (-1,)),
        prefill_workspace_starts=i32(starts, (-1,)),
        seq_lens=i32([q.seq_len for q in case.requests], (-1,)),
        query_start_loc=i32(qsl),
    )


# --- attention inputs -------------------------------------------------------------------------------------

KV_LORA_RANK, ROPE_DIM, HEAD_SIZE = 512, 64, 576
SM_SCALE = 192**-0.5  # DeepSeek-V3: (qk_nope_head_dim 128 + qk_rope_head_dim 64) ** -0.5
_VALUE_SCALE = {"normal": 0.25, "large": 4.0, "tiny": 1e-3, "zero_tiles": 0.25}


FP8_MAX = 448.0  # e4m3's largest finite value


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x as e4m3, saturating at +-448 as vLLM's writers do (__NV_SATFINITE): torch's own conversion saturates on a
    CPU but gives NaN bytes on CUDA for |x| >= 464, a cache vLLM never writes."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_kv_scale(case: Case, std: float | None = None) -> float:
    """The layer's k_scale for a per-tensor fp8 cache (kv_cache_dtype "fp8"): vLLM's writer stores x / k_scale as
    e4m3 for both parts of an entry, and a reader multiplies back. fp8_scale "pow2": 1.0, vLLM's default where the
    checkpoint has no kv-cache scales; "arbitrary": a calibrated checkpoint's, amax / 448 for values up to 8 standard
    deviations of the values' (`std`, default the case's `values` scale; none saturates; not a power of two)."""
    if case.fp8_scale == "pow2":
        return 1.0
    return (_VALUE_SCALE[case.values] if std is None else std) * 8 / FP8_MAX


QUERY_STD = 0.25  # the attention inputs' q: 0.25 N(0, 1) (_step_values)


def fp8_query_scale(case: Case) -> float:
    """The layer's q_scale where it quantizes the query to fp8 (a per-tensor fp8 cache on a backend that takes the
    query quantized): fp8_scale "pow2": 1.0, vLLM's default; "arbitrary": a calibrated checkpoint's, amax / 448 for
    q's 8 standard deviations."""
    return 1.0 if case.fp8_scale == "pow2" else QUERY_STD * 8 / 448


@dataclass(frozen=True)
class AttentionInputs:
    index: IndexInputs
    q: torch.Tensor  # bf16 [num_tokens, heads, 576]: (ql_nope | q_pe) as forward_mqa receives it
    kv_c: torch.Tensor  # bf16 [num_slots, 512]: the latent of the token held in each physical cache slot
    k_pe: torch.Tensor  # bf16 [num_slots, 64]
    slot_of: list[torch.Tensor]  # per request: int64 [seq_len] physical slot of each position
    num_slots: int  # num_blocks * block_size (logical slots; the cache may space blocks further apart)


def _slots(case: Case, positions) -> torch.Tensor:
    """Physical slots of the given (request, range of positions) pairs, unique, int64."""
    out = [torch.tensor(case.block_table[case.table_row(r)], dtype=torch.int64)[p // case.block_size] * case.block_size
           + p % case.block_size for r, p in positions]
    return torch.unique(torch.cat(out)) if out else torch.zeros(0, dtype=torch.int64)


@functools.lru_cache(maxsize=64)  # a trace asks for every earlier step's, at every step: each is made once
def written_slots(case: Case) -> torch.Tensor:
    """The slots written before this step's attention call, int64: its new tokens' (the layer writes them),
    and any context slot no earlier step of the trace wrote (the cache as steps before the trace left it:
    prefix-cache hits, earlier chunks). For a single step: every slot its requests hold. Shared: never
    modify the tensor returned."""
    new = _slots(case, [(r, torch.arange(q.context_len, q.seq_len)) for r, q in enumerate(case.requests)])
    context = _slots(case, [(r, torch.arange(q.context_len)) for r, q in enumerate(case.requests)])
    if case.earlier:
        context = context[~torch.isin(context, _written_before(case))]
    return torch.unique(torch.cat([new, context]))


@functools.lru_cache(maxsize=64)
def _written_before(case: Case) -> torch.Tensor:
    """Every slot the steps before `case` wrote (theirs, and what they found written), int64, unique."""
    before = case.steps[-2]
    return torch.unique(torch.cat([written_slots(before), *((_written_before(before),) if before.earlier else ())]))


def materialize_attention_inputs(case: Case, device: str | torch.device = "cpu") -> AttentionInputs:
    """Values live per physical slot, so requests that share prefix blocks see the same K/V there. In a
    trace each step draws its own values and writes them to the slots it writes (`written_slots`): a step's
    K/V are, slot by slot, what the last step that wrote the slot wrote.

    Values are drawn on `device` by its own generator (tens of millions of them for a 4K-context batch: a
    CPU draw would cost more than the attention call), so a case holds the same values wherever it runs on
    the same kind of device; reproducers carry their tensors. Memoized per (case, device): the target and
    the oracle of one case share one materialization."""
    return _attention_inputs(case, str(torch.device(device)))


@functools.lru_cache(maxsize=2)  # the target's step, then the oracle's: kept small (gpu-scale values take GBs)
def _attention_inputs(case: Case, device: str) -> AttentionInputs:
    if not case.earlier:
        return _step_values(case, device)
    own = _step_values(dataclasses.replace(case, earlier=()), device)
    # Slot by slot, the step that wrote it last (-1: never written; nothing reads such a slot).
    writer = torch.full((own.num_slots,), -1, dtype=torch.int64)
    steps = case.steps
    for k, step in enumerate(steps):
        w = written_slots(step)
        writer[w[w < own.num_slots]] = k
    kv_c, k_pe = own.kv_c.clone(), own.k_pe.clone()
    for k, step in enumerate(steps[:-1]):
        mine = (writer == k).nonzero().flatten().to(device)
        if len(mine):
            theirs, _ = _slot_values(dataclasses.replace(step, earlier=()), device)
            kv_c[mine], k_pe[mine] = theirs[mine, :KV_LORA_RANK], theirs[mine, KV_LORA_RANK:]
    return dataclasses.replace(own, kv_c=kv_c, k_pe=k_pe)


class _BoundedMemo:
    """The most recent results of a function of a hashable key, up to `limit` bytes of tensors (the newest one
    is always kept): each step of a trace asks for the K/V of every step before it, and so does its oracle."""

    def __init__(self, limit: int):
        self.limit, self.entries = limit, {}

    def get(self, key, make):
        if key in self.entries:
            self.entries[key] = self.entries.pop(key)  # the most recent last
            return self.entries[key]
        value = self.entries[key] = make()
        size = lambda v: sum(t.numel() * t.element_size() for t in v if isinstance(t, torch.Tensor))  # noqa: E731
        while len(self.entries) > 1 and sum(size(v) for v in self.entries.values()) > self.limit:
            del self.entries[next(iter(self.entries))]
        return value


_SLOT_VALUES = _BoundedMemo(1 << 30)


def _slot_values(case: Case, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv bf16 [num_slots, 576], the state of the case's value generator after drawing it): a step's K/V per
    slot, drawn first from its seed; its q comes after, from that state."""

    def draw():
        g = torch.Generator(device=device).manual_seed(case.seed + 1)
        num_slots = case.num_blocks * case.block_size
        kv = torch.randn(num_slots, HEAD_SIZE, generator=g, device=device) * _VALUE_SCALE[case.values]
        if case.values == "zero_tiles":  # whole 128-wide NoPE tiles of zeros (fp8 scale edge cases)
            tiles = kv[:, :KV_LORA_RANK].view(num_slots, 4, 128)
            tiles[torch.rand(num_slots, 4, generator=g, device=device) < 0.5] = 0
        return kv.to(torch.bfloat16), g.get_state()

    return _SLOT_VALUES.get((case.seed, case.values, case.num_blocks * case.block_size, device), draw)


def _step_values(case: Case, device: str) -> AttentionInputs:
    index = materialize_index_inputs(case, device)
    kv, state = _slot_values(case, device)
    g = torch.Generator(device=device)
    g.set_state(state)
    q = torch.randn(case.num_tokens, case.heads, HEAD_SIZE, generator=g, device=device) * QUERY_STD
    slot_of = []
    for r, req in enumerate(case.requests):
        pos = torch.arange(req.seq_len)
        row = torch.tensor(case.block_table[case.table_row(r)], dtype=torch.int64)
        slot_of.append(row[pos // case.block_size] * case.block_size + pos % case.block_size)
    return AttentionInputs(index, q.to(torch.bfloat16), kv[:, :KV_LORA_RANK], kv[:, KV_LORA_RANK:], slot_of,
                           kv.shape[0])

QK_NOPE, V_HEAD = 128, 128  # DeepSeek-V3: per-head q/k NoPE and V widths before absorption


@dataclass(frozen=True)
class LayerInputs:
    """What vLLM's MLAAttention layer receives: q before W_UK absorption, the new tokens' latent, and the
    kv_b_proj weight whose per-head halves are W_UK (k NoPE) and W_UV (v)."""

    attention: AttentionInputs  # kv_c / k_pe per slot and the index inputs (its latent q is unused)
    q: torch.Tensor  # bf16 [num_tokens, heads, 192]: (q_nope 128 | q_pe 64)
    kv_b_weight: torch.Tensor  # bf16 [heads * 256, 512]: rows h*256 .. +128 W_UK[h], +128 .. +256 W_UV[h]

    def w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, 128, 512], W_UV [H, 128, 512]) in float64."""
        w = self.kv_b_weight.double().view(-1, QK_NOPE + V_HEAD, KV_LORA_RANK)
        return w[:, :QK_NOPE], w[:, QK_NOPE:]

    def latent_q(self) -> torch.Tensor:
        """float64 [T, H, 576]: q_nope absorbed through W_UK (what forward_mqa attends with), and q_pe."""
        w_uk, _ = self.w_uk_uv()
        q = self.q.double()
        return torch.cat([torch.einsum("thn,hnl->thl", q[..., :QK_NOPE], w_uk), q[..., QK_NOPE:]], dim=-1)


def materialize_layer_inputs(case: Case, device: str | torch.device = "cpu") -> LayerInputs:
    return _layer_inputs(case, str(torch.device(device)))


@functools.lru_cache(maxsize=2)
def _layer_inputs(case: Case, device: str) -> LayerInputs:
    attention = materialize_attention_inputs(case, device)
    g = torch.Generator(device=device).manual_seed(case.seed + 2)
    # W entries ~ 1/sqrt(128): the absorbed q keeps q's scale (the latent q of the MQA targets).
    w = torch.randn(case.heads * (QK_NOPE + V_HEAD), KV_LORA_RANK, generator=g, device=device) * QK_NOPE**-0.5
    q = torch.randn(case.num_tokens, case.heads, QK_NOPE + ROPE_DIM, generator=g, device=device) * 0.25
    if case.earlier:  # one layer runs the trace: its kv_b_proj weight is the first step's
        w = _layer_inputs(case.steps[0], device).kv_b_weight
    return LayerInputs(attention, q.to(torch.bfloat16), w.to(torch.bfloat16))
