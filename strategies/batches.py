"""Hypothesis strategies for the steps a sparse-MLA backend sees.

Small composable pieces (requests, block tables, top-k rows, DCP splits, call sites) joined by
`index_cases` and `attention_cases`. Every draw shrinks toward the plain case: fewer requests, shorter
contexts, the first top-k width, block size 64, no DCP, a contiguous block table, the call vLLM makes today.

Each piece takes an optional `Swarm` (strategies.swarm): under one, every knob it turns is pinned by the swarm
or drawn uniformly over the knob's categories (boundaries included); without one it draws as it always has.
A target hands the campaign a `CaseSpace`: the strategy for any swarm, and the knobs it turns.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from dataclasses import dataclass
from typing import Callable

from hypothesis import strategies as st

from strategies.case import (
    FP8_PER_TENSOR_SCALES,
    FP8_SCALES,
    INVALID_AT,
    MAX_DECODE_QUERY_LEN,
    TOPK_PICKS,
    VALUE_KINDS,
    Case,
    Dcp,
    IndexCall,
    Request,
    TopkSpec,
    pcp_splits,
    rank_owned_positions,
)
from strategies.profiles import Profile
from strategies.swarm import KNOBS, Swarm, category
from strategies.traces import earlier_steps


def _flag(draw, swarm: Swarm | None, name: str, on: str) -> bool:
    """A two-way knob: a boolean drawn as before without a swarm, the swarm's category with one."""
    return draw(st.booleans()) if swarm is None else category(draw, swarm, name) == on


@dataclass(frozen=True)
class CaseSpace:
    """A target's cases: the strategy under any swarm (None: the plain one) and the knobs it turns, each with the
    categories this target and profile draw."""

    draw: Callable[[Swarm | None], st.SearchStrategy[Case]]
    knobs: dict[str, tuple[str, ...]]

    def strategy(self, swarm: Swarm | None = None) -> st.SearchStrategy[Case]:
        return self.draw(swarm)


def _domains(names, **values) -> dict[str, tuple[str, ...]]:
    return {n: tuple(values[n]) if n in values else KNOBS[n].values for n in names}


_REQUEST_KNOBS = ("decodes", "decode_query_len", "decode_context", "padding_rows", "prefills", "prefill_len", "prefill_context",
                  "block_edge", "table_layout", "table_last_column", "block_size", "topk_width", "topk_valid",
                  "invalid_at", "topk_pick", "past_table")


@dataclass(frozen=True)
class IndexFeatures:
    """What the installed release's index kernels accept (targets fill this in from vLLM)."""

    dcp: bool = False  # draw DCP splits (the DCP filter target)
    block_stride_rows: bool = False
    idx_mapping: bool = False
    prefill_workspace: bool = True
    row_contract_breaks: bool = True  # draw call sites that pass the full-batch req_id_per_token


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@st.composite
def requests(draw, p: Profile, topk_width: int, max_decode_query_len: int = MAX_DECODE_QUERY_LEN,
             vllm_order: bool = False, swarm: Swarm | None = None,
             decode_only: bool = False, padding_rows: bool = True) -> tuple[tuple[Request, ...], int]:
    """Requests in vLLM's batch order (decodes, padding rows, extends/prefills) and the decode count.
    `decode_only`: no prefills after decodes (a steady-state decode step, what full CUDA graphs replay).
    `padding_rows`: whether zero-length padding rows may follow the decodes (False: an eager engine's batch).

    `vllm_order`: exactly as vLLM's model runner leaves a batch: `reorder_batch_to_split_decodes_and_prefills`
    puts prefills with cached context (extends, prefix-cache hits) before fresh ones, and zero-length padding
    rows come only with uniform decode batches (full CUDA graphs), never before prefills."""
    c = functools.partial(category, draw, swarm)
    kind = c("decodes")
    n_dec = draw(st.integers(0 if kind != "some" else min(1, p.max_decodes), p.max_decodes if kind != "none" else 0))
    mtp = c("decode_query_len")
    q_dec = draw(st.integers(1 if mtp != "mtp" else min(2, max_decode_query_len),
                             max_decode_query_len if mtp != "one" else 1))
    budget = p.max_tokens
    reqs = []
    for _ in range(n_dec):
        if budget < q_dec:
            break
        long = c("decode_context")
        lo, hi = {None: (0, p.max_context), "short": (0, p.max_context // 8),
                  "long": (-(-p.max_context // 2), p.max_context)}[long]
        reqs.append(Request(q_dec, draw(st.integers(lo, hi))))
        budget -= q_dec
    pads = c("padding_rows")
    if padding_rows:
        reqs += [Request(0, 0)] * draw(st.integers(0 if pads != "some" or not reqs else 1,
                                                   2 if reqs and pads != "none" else 0))  # padded decode batch (C/D)
    num_decodes = len(reqs)
    many = c("prefills")
    if decode_only and reqs:
        many = "none"
    lo, hi = (0 if reqs else 1), p.max_prefills
    lo, hi = {None: (lo, hi), "none": (lo, lo), "one": (1, 1), "several": (min(2, hi), hi)}[many]
    for _ in range(draw(st.integers(lo, hi))):
        if budget < 1:
            break
        if swarm is None:
            # Short prefills (seq_len <= topk) leave the MQA path for dense MHA: draw them often.
            short = draw(st.booleans())
            q = draw(st.integers(1, max(1, min(budget, topk_width if short else budget))))
            ctx_cap = max(0, topk_width - q) if short else p.max_context
            ctx = draw(st.integers(0, min(ctx_cap, p.max_context)))  # > 0: chunked context / prefix-cache hit
        else:
            q, ctx = _swarm_prefill(draw, c("prefill_len"), c("prefill_context"), budget, topk_width, p.max_context,
                                    context_pinned=swarm.pinned("prefill_context") is not None)
        reqs.append(Request(q, ctx))
        budget -= q
    if vllm_order and len(reqs) > num_decodes:
        pads = sum(1 for r in reqs[:num_decodes] if r.query_len == 0)
        prefills = sorted(reqs[num_decodes:], key=lambda r: r.context_len == 0)  # stable: extends first
        reqs, num_decodes = [r for r in reqs[:num_decodes] if r.query_len] + prefills, num_decodes - pads
    if not any(r.query_len for r in reqs):
        reqs.append(Request(1, draw(st.integers(0, p.max_context))))
    return tuple(reqs), num_decodes


def _swarm_prefill(draw, length: str, context: str, budget: int, width: int, max_context: int,
                   context_pinned: bool) -> tuple[int, int]:
    """(query_len, context_len) of one prefill in the category asked for, where the budget allows: `threshold`
    puts seq_len at topk - 1, topk or topk + 1, where the dense-MHA split sits. A length the budget cannot make
    without cached context gets some, unless the swarm pinned the context to none."""
    cached = context == "cached" or (not context_pinned and length != "short" and budget < width + 2)
    if length == "threshold":
        seq = width + draw(st.sampled_from((0, 1, -1)))
        if not cached and seq <= budget:
            return seq, 0
        lo, hi = max(1, seq - max_context), min(budget, seq - 1)
        if lo <= hi:
            q = draw(st.integers(lo, hi))
            return q, seq - q
    if length == "long":
        q = draw(st.integers(1, budget))
        lo = max(1, width + 2 - q)
        if not cached:
            return q, 0
        return q, draw(st.integers(lo if lo <= max_context else 1, max(1, max_context)))
    q = draw(st.integers(1, max(1, min(budget, width - 2))))  # short (and what the budget leaves of the others)
    cap = min(max_context, width - 2 - q)
    return q, draw(st.integers(1, cap)) if cached and cap >= 1 else 0


def _at_block_edges(draw, reqs: tuple[Request, ...], num_decodes: int, block_size: int, max_context: int,
                    swarm: Swarm | None) -> tuple[Request, ...]:
    """Under a swarm that asks for block edges: some requests' cached context, or whole sequence, ends exactly
    on a block boundary. Fresh prefills keep no context (vLLM's batch order puts them last)."""
    if category(draw, swarm, "block_edge") != "some":
        return reqs
    out = []
    for i, r in enumerate(reqs):
        if r.query_len and (i < num_decodes or r.context_len) and draw(st.booleans()):
            if draw(st.booleans()):  # the context ends on the edge
                ctx = max(block_size, r.context_len // block_size * block_size)
            else:  # the sequence does
                ctx = -(-r.seq_len // block_size) * block_size - r.query_len
            if 0 < ctx <= max_context:
                r = Request(r.query_len, ctx)
        out.append(r)
    return tuple(out)


@st.composite
def block_tables(draw, blocks_needed: list[int], allow_idx_mapping: bool, shareable: list[int] | None = None,
                 swarm: Swarm | None = None, pool: int = 0):
    """Rows of physical block ids: contiguous, permuted, or sharing prefix blocks; 0 pads a row.

    `shareable`: per row, how many leading blocks may be shared (None: any). vLLM shares only full blocks of
    cached tokens; a block a request writes its new tokens into is never another request's context.
    `pool`: the ids lie anywhere in a cache of this many blocks (large-cache profiles), not from 1 up."""
    last = category(draw, swarm, "table_last_column")
    width = max(max(blocks_needed, default=0), 1) + draw(st.integers(0 if last != "spare" else 1,
                                                                     2 if last != "used" else 0))
    total = sum(blocks_needed)
    layout = category(draw, swarm, "table_layout") or draw(st.sampled_from(("arange", "permuted", "shared_prefix")))
    # With a pool, the ids sit in its top eighth: the cache is then at least 7/8 of the pool.
    base = draw(st.integers(max(1, pool - total - pool // 8), pool - total)) if pool > total + 1 else 1
    ids = list(range(base, base + total))
    if layout == "permuted" and total > 1:
        if pool:  # tens of thousands of blocks: a shuffle seeded by one draw (a drawn permutation overruns)
            random.Random(draw(st.integers(0, 2**32 - 1))).shuffle(ids)
        else:
            ids = [i + 1 for i in draw(st.permutations(range(total)))]
    rows, k = [], 0
    for n in blocks_needed:
        rows.append(ids[k : k + n] + [0] * (width - n))
        k += n
    if layout == "shared_prefix" and len(rows) > 1:
        for i, (row, n) in enumerate(zip(rows[1:], blocks_needed[1:]), start=1):
            shared = min(n, blocks_needed[0], draw(st.integers(1, 4)))
            if shareable is not None:
                shared = min(shared, shareable[0], shareable[i])
            row[:shared] = rows[0][:shared]
    idx_mapping = None
    if allow_idx_mapping and _flag(draw, swarm, "idx_mapping", "on"):
        # A persistent block table: requests live in arbitrary rows, other rows hold stale ids.
        n_rows = len(rows) + draw(st.integers(0, 2))
        where = draw(st.permutations(range(n_rows)))[: len(rows)]
        table = [[(7 * r + c) % (total + 1) for c in range(width)] for r in range(n_rows)]
        for row, w in zip(rows, where):
            table[w] = row
        rows, idx_mapping = table, tuple(where)
    return tuple(tuple(r) for r in rows), idx_mapping


# The per-request TopkSpec strategies are built once per width: a fresh st.builds drawn for every request costs
# Hypothesis a signature inspection per draw (about half of drawing a 16-request case).
@functools.lru_cache(maxsize=None)
def topk_specs(width: int) -> st.SearchStrategy[TopkSpec]:
    return st.builds(
        TopkSpec,
        valid=st.integers(0, width),
        invalid_at=st.sampled_from(INVALID_AT),
        past_seq=st.integers(0, 3),
        past_table=st.integers(0, 3),
        pick=st.sampled_from(TOPK_PICKS),
    )


@st.composite
def swarm_topk_specs(draw, width: int, swarm: Swarm, past_seq: bool, past_table: int,
                     valid: int | None = None) -> TopkSpec:
    """One request's TopkSpec under a swarm: the valid count by category (0, 1, some, topk - 1, topk)."""
    if valid is None:
        v = category(draw, swarm, "topk_valid")
        valid = {"zero": 0, "one": 1, "minus_one": width - 1, "full": width}.get(v)
        valid = draw(st.integers(min(2, width), max(2, width - 2))) if valid is None else valid
    invalid_at = category(draw, swarm, "invalid_at")
    seq = draw(st.integers(1, 3)) if past_seq and category(draw, swarm, "past_seq") == "some" else 0
    table = draw(st.integers(1, past_table)) if past_table and category(draw, swarm, "past_table") == "some" else 0
    pick = category(draw, swarm, "topk_pick")
    return TopkSpec(valid, invalid_at, seq, table, pick)


def _interleaves(block_size: int) -> list[int]:
    return [1] + [i for i in (2, 4, 8, 16, 32, 64) if block_size % i == 0]


def _swarm_dcp(draw, swarm: Swarm, size: int, interleaves: list[int], rank: bool) -> Dcp:
    r = 0
    if rank:
        where = category(draw, swarm, "dcp_rank")
        r = {"first": 0, "last": size - 1}.get(where)
        r = (draw(st.integers(1, size - 2)) if size > 2 else 0) if r is None else r
    many = category(draw, swarm, "dcp_interleave") == "many"
    return Dcp(size, r, draw(st.sampled_from(interleaves[1:])) if many and len(interleaves) > 1 else 1)


@st.composite
def dcp_splits(draw, p: Profile, block_size: int, swarm: Swarm | None = None) -> Dcp:
    pinned = category(draw, swarm, "dcp", tuple(map(str, p.dcp_sizes)))
    size = int(pinned) if pinned else draw(st.sampled_from(p.dcp_sizes))
    if size == 1:
        return Dcp()
    interleaves = _interleaves(block_size)
    if swarm is not None:
        return _swarm_dcp(draw, swarm, size, interleaves, rank=True)
    return Dcp(size, draw(st.integers(0, size - 1)), draw(st.sampled_from(interleaves)))


@st.composite
def index_calls(draw, f: IndexFeatures, case_has_decodes: bool, case_has_prefills: bool, dcp: Dcp,
                swarm: Swarm | None = None) -> IndexCall:
    token_rows = "decodes" if case_has_decodes and _flag(draw, swarm, "token_rows", "decodes") else "all"
    req_id_rows = "match"
    if (f.row_contract_breaks and token_rows == "decodes" and case_has_prefills
            and _flag(draw, swarm, "req_id_rows", "full_batch")):
        req_id_rows = "full_batch"
    workspace = (f.prefill_workspace and dcp.size == 1 and case_has_prefills
                 and _flag(draw, swarm, "prefill_workspace", "on"))
    return IndexCall(_flag(draw, swarm, "valid_counts", "on"), workspace, token_rows, req_id_rows)


def _paged_batch(reqs, num_decodes: int, block_size: int, table, topk_width: int) -> dict:
    """The Case fields every strategy draws the same way: the requests and their paged cache (draws nothing)."""
    return dict(requests=reqs, num_decodes=num_decodes, block_size=block_size, block_table=table,
                topk_width=topk_width)


def index_knobs(p: Profile, f: IndexFeatures) -> dict[str, tuple[str, ...]]:
    names = [*_REQUEST_KNOBS, "past_seq", "valid_counts", "token_rows"]
    names += [n for n, on in (("idx_mapping", f.idx_mapping), ("block_stride", f.block_stride_rows),
                              ("prefill_workspace", f.prefill_workspace), ("req_id_rows", f.row_contract_breaks))
              if on]
    if f.dcp:
        names += ["dcp", "dcp_rank", "dcp_interleave"]
    return _domains(names, block_size=map(str, p.block_sizes),
                    topk_width=_width_categories(p.topk_widths, True, p.edge_topk_widths),
                    dcp=map(str, p.dcp_sizes))


def index_space(p: Profile, f: IndexFeatures) -> CaseSpace:
    return CaseSpace(lambda swarm: index_cases(p, f, swarm), index_knobs(p, f))


# Unpinned, the widths where the index remap's tiling changes are drawn this many times their share: one
# category among the profile's many ordinary widths, and the only one that reaches the multi-tile path.
TILE_EDGE_WEIGHT = 3


def _widths(draw, swarm: Swarm | None, widths: tuple[int, ...], other: bool, edge: tuple[int, ...] = ()) -> int:
    categories = _width_categories(widths, other, edge)
    pin = category(draw, swarm, "topk_width", categories + (("tile_edge",) * (TILE_EDGE_WEIGHT - 1) if edge else ()))
    if pin == "tile_edge":
        return draw(st.sampled_from(edge))
    if pin is None:  # the profile's widths first (shrinking goes to 128), then any multiple of 128 up to 2048
        return draw(st.one_of(st.sampled_from(widths), st.integers(1, 16).map(lambda k: 128 * k))) if other \
            else draw(st.sampled_from(widths))
    return int(pin) if pin != "other" else draw(st.integers(1, 16).map(lambda k: 128 * k).filter(lambda w: w not in widths))


def _width_categories(widths: tuple[int, ...], other: bool, edge: tuple[int, ...]) -> tuple[str, ...]:
    return (*map(str, widths), *(("other",) if other else ()), *(("tile_edge",) if edge else ()))


def _sampled(draw, swarm: Swarm | None, name: str, options: tuple):
    pin = category(draw, swarm, name, tuple(map(str, options)))
    return draw(st.sampled_from(options)) if pin is None else options[[str(o) for o in options].index(pin)]


@st.composite
def index_cases(draw, p: Profile, f: IndexFeatures, swarm: Swarm | None = None) -> Case:
    topk_width = _widths(draw, swarm, p.topk_widths, other=True, edge=p.edge_topk_widths)
    reqs, num_decodes = draw(requests(p, topk_width, swarm=swarm))
    block_size = _sampled(draw, swarm, "block_size", p.block_sizes)
    reqs = _at_block_edges(draw, reqs, num_decodes, block_size, p.max_context, swarm)
    dcp = draw(dcp_splits(p, block_size, swarm)) if f.dcp else Dcp()
    local = [_local_len(r.seq_len, dcp) for r in reqs]
    table, idx_mapping = draw(block_tables([_cdiv(n, block_size) for n in local], f.idx_mapping, swarm=swarm,
                                           pool=p.slot_pool // block_size))
    stride = 0
    if f.block_stride_rows and _flag(draw, swarm, "block_stride", "on"):
        stride = block_size * draw(st.integers(2, 3))  # other layers' pages between this layer's blocks
    has_dec = any(r.query_len for r in reqs[:num_decodes])
    has_pre = any(r.query_len for r in reqs[num_decodes:])
    specs = (topk_specs(topk_width) if swarm is None else swarm_topk_specs(topk_width, swarm, True, 3)
             for _ in reqs)
    return Case(
        **_paged_batch(reqs, num_decodes, block_size, table, topk_width),
        topk=tuple(draw(s) for s in specs),
        block_stride_rows=stride,
        idx_mapping=idx_mapping,
        dcp=dcp,
        call=draw(index_calls(f, has_dec, has_pre, dcp, swarm)),
        seed=draw(st.integers(0, 2**16)),
    ).validate()


def _local_len(seq_len: int, dcp: Dcp) -> int:
    return rank_owned_positions(seq_len, dcp.size, dcp.rank, dcp.interleave) if dcp.size > 1 else seq_len


@dataclass(frozen=True)
class AttentionFeatures:
    """What a backend target takes (targets fill this in from the backend class)."""

    kv_cache_dtypes: tuple[str, ...] = ("bfloat16",)
    heads: tuple[int, ...] | None = None  # per rank (128 heads over TP 1-16); None: the profile's
    block_sizes: tuple[int, ...] | None = None  # None: the profile's
    block_stride_rows: bool = True
    # Rows of a request whose whole sequence fits in top-k select every visible position, as vLLM's indexer
    # does. Layer-level targets need it: the dense-MHA route attends to all of them, by design.
    indexer_fills_short_seqs: bool = False
    # Batches only in the order vLLM's model runner makes (see `requests`): for the layer targets, which run
    # vLLM's whole forward as the runner calls it (0.26's chunked-context metadata even counts the prefill tokens
    # with context as a prefix of the prefills; 0.33's DCP context metadata mis-merges a short prefill's context
    # when a zero-length row precedes the prefills, which the runner never makes).
    vllm_batch_order: bool = False
    # DCP splits (decode context parallelism): `heads` is then per rank before the query all-gather, and a
    # split is drawn only where the gathered heads (heads x size) stay within this bound (FlashMLA's fp8
    # kernel pads local and gathered heads to one envelope, 64 or 128, and refuses DCP otherwise).
    dcp: bool = False
    dcp_max_gathered_heads: int = 64
    dcp_sizes: tuple[int, ...] | None = None  # None: the profile's (a real process group has one size)
    # Also draw DCP splits outside that bound (and heads the mixed-batch path does not take), where vLLM must
    # refuse the configuration instead of computing with mismatched head padding.
    dcp_outside_envelope: bool = False
    # Prefill context parallelism with DCP (Dcp.pcp, Dcp.tp): the layouts named here (of PCP_LAYOUTS), heads per
    # rank whose TP world fits the model's heads; with `dcp_outside_envelope`, heads whose fp8 envelope vLLM must
    # refuse too. The pcp_prefill knob pins whether a prefill splits over the PCP ranks or runs whole on each.
    pcp_layouts: tuple[str, ...] = ()
    # Padding rows come with their padded tokens (Case.padded_tokens), as vLLM's runner makes them under full
    # CUDA graphs. Targets that feed those rows to vLLM set it; the others keep padding rows of no tokens.
    cudagraph_padding: bool = False
    # Cases may be traces: steps one engine ran before them (strategies.traces), for targets that keep their
    # builder, impl, cache and buffers across steps as vLLM's model runner does.
    traces: bool = False
    # Traces may hold MTP draft steps (the step before's metadata updated in place), for targets that run them.
    mtp_draft: bool = False
    # The engine's CUDA-graph modes to draw (Case.cudagraph): "full" for targets that capture and replay decode steps.
    cudagraph_modes: tuple[str, ...] = ("none",)
    # How the indexer's rows are drawn (the knob `topk_rows`): "drawn", each request's valid count by its TopkSpec
    # (0, 1, some, topk - 1, topk: the valid counts a backend must take from the indices); "indexer", every row holds
    # min(visible positions, topk) valid positions, as DeepSeek's indexer (top_k_per_row) fills them: the count
    # FLASHINFER_MLA_SPARSE_SM90 plans each row with, derived from its context and not read from the indices.
    topk_rows: tuple[str, ...] = ("drawn",)
    # The fp8_ds_mla scale conventions to draw (of FP8_SCALES); None: every one.
    fp8_scales: tuple[str, ...] | None = None
    # Every row's valid entries first, then -1, as vLLM's indexer writes its rows (vllm.indexer's `topk` check), for
    # a backend that reads the first min(visible positions, topk) entries of a row without compacting it
    # (ROCM_AITER_MLA_SPARSE's ragged remap): the -1 entries drawn elsewhere are outside its contract.
    topk_valid_first: bool = False
    # Graph padding tokens (cudagraph_padding) only in full-graph engines: vLLM's runner pads the attention metadata
    # for FULL graphs only (`pad_attn`), so an eager step never has them. For a backend whose Python refuses the
    # padded metadata that only its captured kernels ever see (ROCM_AITER_MLA_SPARSE's remap asserts equal rows).
    graph_padding_full_only: bool = False


TOTAL_HEADS = 128  # DeepSeek-V3.2's attention heads: heads per rank are 128 / TP

# Prefill context parallelism x DCP (x TP) layouts vLLM's ParallelConfig allows (DCP spans the PCP ranks, or the
# whole PCP x TP world): name -> (pcp, dcp, tp).
PCP_LAYOUTS = {"pcp2.dcp2": (2, 2, 1), "pcp2.dcp2.tp2": (2, 2, 2), "pcp2.dcp4": (2, 4, 2), "pcp4.dcp4": (4, 4, 1)}
# PCP without DCP (DCP 1: every rank holds the whole cache): vLLM shards decode requests over the PCP ranks there
# (ParallelConfig.pcp_shard_decode_requests), one owner each, and dense-MHA prefill is allowed.
PCP_ONLY_LAYOUTS = {"pcp2": (2, 1, 1), "pcp2.tp2": (2, 1, 2), "pcp4": (4, 1, 1)}


def _fp8_pad(heads: int) -> int:
    return 64 if heads <= 64 else 128


def _pcp_layout_fits(name: str, heads: int) -> bool:
    """The layout's TP world fits the model's heads, and (DCP past PCP gathers q over TP) the local and
    gathered heads pad to one fp8 kernel envelope, as FlashMLA's builder requires."""
    pcp, dcp, tp = PCP_LAYOUTS[name] if name in PCP_LAYOUTS else PCP_ONLY_LAYOUTS[name]
    gathered = heads * tp if dcp > pcp else heads
    return heads * tp <= TOTAL_HEADS and _fp8_pad(heads) == _fp8_pad(gathered)


def _pcp_prefills(draw, reqs: tuple[Request, ...], num_decodes: int, pcp: int, budget: int,
                  swarm: Swarm | None) -> tuple[Request, ...]:
    """The pcp_prefill knob pinned: a prefill that splits over the PCP ranks, or one too short to split, if the
    step has none (the last prefill's query length changed, its context kept, within the token budget)."""
    want = category(draw, swarm, "pcp_prefill")
    prefills = [i for i in range(num_decodes, len(reqs)) if reqs[i].query_len]
    if want is None or not prefills or any(pcp_splits(reqs[i].query_len, pcp) == (want == "split") for i in prefills):
        return reqs
    i = prefills[-1]
    room = budget - sum(r.query_len for r in reqs) + reqs[i].query_len
    lengths = [q for q in range(1, room + 1) if pcp_splits(q, pcp) == (want == "split")]
    if not lengths:
        return reqs
    return (*reqs[:i], Request(draw(st.sampled_from(lengths)), reqs[i].context_len), *reqs[i + 1:])


@st.composite
def attention_dcp_splits(draw, p: Profile, block_size: int, heads: int, max_gathered_heads: int,
                         only_sizes: tuple[int, ...] | None = None, swarm: Swarm | None = None) -> Dcp:
    """A whole DCP group (every rank runs; `rank` stays 0): sizes 2 first (shrinking goes there), 1 as the
    no-DCP baseline, interleave 1 or any power of two dividing the block size. DCP reuses TP ranks, so its
    size divides TP = TOTAL_HEADS / heads (vLLM's ParallelConfig checks tp % dcp == 0)."""
    sizes = [n for n in (2, 1, 3, 4, 8) if n in (only_sizes or (1, *p.dcp_sizes)) and heads * n <= max_gathered_heads
             and (TOTAL_HEADS // heads) % n == 0]
    size = _sampled(draw, swarm, "dcp", tuple(sizes))
    if size == 1:
        return Dcp()
    if swarm is not None:
        return _swarm_dcp(draw, swarm, size, _interleaves(block_size), rank=False)
    return Dcp(size, 0, draw(st.sampled_from(_interleaves(block_size))))


@functools.lru_cache(maxsize=None)
def attention_topk_specs(width: int) -> st.SearchStrategy[TopkSpec]:
    # The indexer only emits positions < seq_len: no `past_seq` (its slots hold other data by design).
    return st.builds(TopkSpec, valid=st.integers(0, width), invalid_at=st.sampled_from(INVALID_AT),
                     past_table=st.integers(0, 2), pick=st.sampled_from(TOPK_PICKS))


@functools.lru_cache(maxsize=None)
def _indexer_full_spec(width: int) -> st.SearchStrategy[TopkSpec]:
    return st.builds(TopkSpec, valid=st.just(width), invalid_at=st.sampled_from(INVALID_AT))


def _attention_heads(p: Profile, f: AttentionFeatures, outside: bool) -> tuple[int, ...]:
    if f.pcp_layouts:  # heads some layout takes (outside its envelope too, where asked)
        return tuple(h for h in (f.heads or p.attn_heads) if any(
            _pcp_layout_fits(n, h) or (outside and h * PCP_LAYOUTS[n][2] <= TOTAL_HEADS) for n in f.pcp_layouts))
    heads_choices = tuple(f.heads or p.attn_heads) + ((32,) if outside else ())
    if f.dcp and f.dcp_sizes:  # a fixed group size: only head counts whose TP it divides
        heads_choices = tuple(h for h in heads_choices if any(
            (TOTAL_HEADS // h) % n == 0 and (outside or h * n <= f.dcp_max_gathered_heads) for n in f.dcp_sizes))
    return heads_choices


def attention_knobs(p: Profile, f: AttentionFeatures) -> dict[str, tuple[str, ...]]:
    p = p.for_attention()
    names = [*_REQUEST_KNOBS, "heads", "kv_cache_dtype", "values"]
    if "drawn" not in f.topk_rows:  # every row the indexer's: no valid count to draw
        names.remove("topk_valid")
    if f.topk_valid_first:  # -1 entries only at the tail: no place to draw
        names.remove("invalid_at")
    if len(f.topk_rows) > 1:
        names.append("topk_rows")
    scales: tuple[str, ...] = ()
    if "fp8_ds_mla" in f.kv_cache_dtypes:
        scales = f.fp8_scales or FP8_SCALES
    elif "fp8" in f.kv_cache_dtypes:
        scales = FP8_PER_TENSOR_SCALES
    if scales:
        names.append("fp8_scale")
    if f.block_stride_rows:
        names.append("block_stride")
    if f.traces and p.max_steps > 1:
        names.append("trace")
        if f.mtp_draft:
            names.append("mtp_draft")
    if len(f.cudagraph_modes) > 1:
        names.append("cudagraph")
    domains = dict(block_size=map(str, f.block_sizes or p.block_sizes), topk_width=map(str, p.topk_widths),
                   heads=map(str, _attention_heads(p, f, False)), kv_cache_dtype=f.kv_cache_dtypes,
                   cudagraph=f.cudagraph_modes, fp8_scale=scales, topk_rows=f.topk_rows)
    if f.pcp_layouts:
        names += ["cp_layout", "dcp_interleave", "pcp_prefill"]
        domains["cp_layout"] = [n for n in f.pcp_layouts if any(_pcp_layout_fits(n, h) for h in _attention_heads(p, f, False))]
    elif f.dcp:
        names += ["dcp", "dcp_interleave"]
        heads = _attention_heads(p, f, False)  # sizes some head count allows (TP % DCP == 0, the gathered bound)
        domains["dcp"] = [str(n) for n in sorted({1, *(f.dcp_sizes or p.dcp_sizes)}) if any(
            h * n <= f.dcp_max_gathered_heads and (TOTAL_HEADS // h) % n == 0 for h in heads)]
    return _domains(names, **domains)


def attention_space(p: Profile, f: AttentionFeatures) -> CaseSpace:
    return CaseSpace(lambda swarm: attention_cases(p, f, swarm), attention_knobs(p, f))


@st.composite
def attention_cases(draw, p: Profile, f: AttentionFeatures, swarm: Swarm | None = None) -> Case:

    p = p.for_attention()
    outside = (f.dcp or f.pcp_layouts) and f.dcp_outside_envelope and draw(st.integers(0, 9)) == 0  # one in ten
    heads_choices = _attention_heads(p, f, outside)
    if f.pcp_layouts and swarm is not None and swarm.pinned("cp_layout") and not outside:
        heads_choices = tuple(h for h in heads_choices if _pcp_layout_fits(swarm.pinned("cp_layout"), h)) or heads_choices
    if f.dcp and swarm is not None and swarm.pinned("dcp") and not outside:  # heads the pinned DCP size allows
        n = int(swarm.pinned("dcp"))
        heads_choices = tuple(h for h in heads_choices if h * n <= f.dcp_max_gathered_heads
                              and (TOTAL_HEADS // h) % n == 0) or heads_choices
    heads = _sampled(draw, swarm, "heads", heads_choices)
    topk_width = _widths(draw, swarm, p.topk_widths, other=False)
    block_size = _sampled(draw, swarm, "block_size", f.block_sizes or p.block_sizes)
    bound = 1024 if outside else f.dcp_max_gathered_heads
    if f.pcp_layouts:
        layouts = tuple(n for n in f.pcp_layouts if _pcp_layout_fits(n, heads)
                        or (outside and heads * PCP_LAYOUTS[n][2] <= TOTAL_HEADS)) or f.pcp_layouts[:1]
        pcp, size, tp = PCP_LAYOUTS[_sampled(draw, swarm, "cp_layout", layouts)]
        many = category(draw, swarm, "dcp_interleave")
        interleaves = _interleaves(block_size)
        interleave = (draw(st.sampled_from(interleaves)) if many is None else
                      draw(st.sampled_from(interleaves[1:])) if many == "many" and len(interleaves) > 1 else 1)
        dcp = Dcp(size, 0, interleave, pcp, tp)
    else:
        dcp = draw(attention_dcp_splits(p, block_size, heads, bound, f.dcp_sizes, swarm)) if f.dcp else Dcp()
    cudagraph = _sampled(draw, swarm, "cudagraph", f.cudagraph_modes)
    # A full-graph engine's step is a steady-state decode step half the time (what its graphs replay).
    steady = cudagraph == "full" and (swarm is None or swarm.pinned("prefills") is None) and draw(st.booleans())
    # vLLM allows multi-token (MTP) decodes under DCP only with interleave 1 (supports_dcp_with_varlen).
    reqs, num_decodes = draw(requests(p, topk_width, 1 if dcp.interleave > 1 else MAX_DECODE_QUERY_LEN,
                                      vllm_order=f.vllm_batch_order, swarm=swarm, decode_only=steady))
    if dcp.pcp > 1:
        reqs = _pcp_prefills(draw, reqs, num_decodes, dcp.pcp, p.max_tokens, swarm)
    reqs = _at_block_edges(draw, reqs, num_decodes, block_size, p.max_context, swarm)
    # Under DCP a block id names one block on every rank: a "virtual" block of block_size x size tokens.
    virtual = block_size * dcp.size
    table, _ = draw(block_tables([_cdiv(r.seq_len, virtual) for r in reqs], False,
                                 shareable=[r.context_len // virtual for r in reqs], swarm=swarm, pool=p.slot_pool // block_size))
    stride = block_size * draw(st.integers(2, 3)) if f.block_stride_rows and _flag(draw, swarm, "block_stride", "on") \
        else 0
    kv_dtype = _sampled(draw, swarm, "kv_cache_dtype", f.kv_cache_dtypes)
    # (Drawn only where the target takes both: other targets' cases stay the draws they were.)
    indexer_rows = f.topk_rows == ("indexer",) or (
        len(f.topk_rows) > 1 and _sampled(draw, swarm, "topk_rows", f.topk_rows) == "indexer")

    def spec(r: Request):
        full = indexer_rows or (f.indexer_fills_short_seqs and r.seq_len <= topk_width)
        if swarm is not None:
            drawn = swarm_topk_specs(topk_width, swarm, False, 2, valid=topk_width if full else None)
        else:
            drawn = _indexer_full_spec(topk_width) if full else attention_topk_specs(topk_width)
        return drawn.map(lambda t: dataclasses.replace(t, invalid_at="tail")) if f.topk_valid_first else drawn

    case = Case(
        **_paged_batch(reqs, num_decodes, block_size, table, topk_width),
        topk=tuple(draw(spec(r)) for r in reqs),
        block_stride_rows=stride,
        dcp=dcp,
        heads=heads,
        kv_cache_dtype=kv_dtype,
        fp8_scale=(_sampled(draw, swarm, "fp8_scale", f.fp8_scales or FP8_SCALES) if kv_dtype == "fp8_ds_mla" else
                   _sampled(draw, swarm, "fp8_scale", FP8_PER_TENSOR_SCALES) if kv_dtype == "fp8" else "pow2"),
        values=_sampled(draw, swarm, "values", VALUE_KINDS),
        seed=draw(st.integers(0, 2**16)),
        padded_tokens=(_graph_padding(reqs, num_decodes) if f.cudagraph_padding
                       and (cudagraph == "full" or not f.graph_padding_full_only) else 0),
        cudagraph=cudagraph,
    ).validate()
    if not f.traces or p.max_steps < 2:
        return case
    # Drawn last: shrinking the earlier steps away leaves the case as it was.
    earlier = draw(earlier_steps(case, spec, swarm, 1 if dcp.interleave > 1 else MAX_DECODE_QUERY_LEN,
                                 max_earlier=p.max_steps - 1, max_tokens=p.max_tokens, mtp_draft=f.mtp_draft))
    return dataclasses.replace(case, earlier=earlier).validate() if earlier else case


def _graph_padding(reqs: tuple[Request, ...], num_decodes: int) -> int:
    """The tokens a full CUDA graph gives a uniform decode batch's trailing padding rows (0: not such a batch)."""
    pads = sum(1 for r in reqs if r.query_len == 0)
    if num_decodes != len(reqs) or not pads or any(r.query_len == 0 for r in reqs[: len(reqs) - pads]):
        return 0
    return pads * max(r.query_len for r in reqs)
