"""Hypothesis strategies for the steps a sparse-MLA backend sees.

Small composable pieces (requests, block tables, top-k rows, DCP splits, call sites) joined by
`index_cases`. Every draw shrinks toward the plain case: fewer requests, shorter contexts, the first
top-k width, block size 64, no DCP, a contiguous block table, the call vLLM makes today.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from hypothesis import strategies as st

from strategies.case import (
    FP8_SCALES,
    INVALID_AT,
    MAX_DECODE_QUERY_LEN,
    VALUE_KINDS,
    Case,
    Dcp,
    IndexCall,
    Request,
    TopkSpec,
    rank_owned_positions,
)
from strategies.profiles import Profile


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
             vllm_order: bool = False) -> tuple[tuple[Request, ...], int]:
    """Requests in vLLM's batch order (decodes, padding rows, extends/prefills) and the decode count.

    `vllm_order`: exactly as vLLM's model runner leaves a batch: `reorder_batch_to_split_decodes_and_prefills`
    puts prefills with cached context (extends, prefix-cache hits) before fresh ones, and zero-length padding
    rows come only with uniform decode batches (full CUDA graphs), never before prefills."""
    n_dec = draw(st.integers(0, p.max_decodes))
    q_dec = draw(st.integers(1, max_decode_query_len))
    budget = p.max_tokens
    reqs = []
    for _ in range(n_dec):
        if budget < q_dec:
            break
        reqs.append(Request(q_dec, draw(st.integers(0, p.max_context))))
        budget -= q_dec
    reqs += [Request(0, 0)] * draw(st.integers(0, 2 if reqs else 0))  # padded decode batch (class C/D)
    num_decodes = len(reqs)
    for _ in range(draw(st.integers(0 if reqs else 1, p.max_prefills))):
        if budget < 1:
            break
        # Short prefills (seq_len <= topk) leave the MQA path for dense MHA: draw them often.
        short = draw(st.booleans())
        q = draw(st.integers(1, max(1, min(budget, topk_width if short else budget))))
        ctx_cap = max(0, topk_width - q) if short else p.max_context
        ctx = draw(st.integers(0, min(ctx_cap, p.max_context)))  # > 0: chunked context / prefix-cache hit
        reqs.append(Request(q, ctx))
        budget -= q
    if vllm_order and len(reqs) > num_decodes:
        pads = sum(1 for r in reqs[:num_decodes] if r.query_len == 0)
        prefills = sorted(reqs[num_decodes:], key=lambda r: r.context_len == 0)  # stable: extends first
        reqs, num_decodes = [r for r in reqs[:num_decodes] if r.query_len] + prefills, num_decodes - pads
    if not any(r.query_len for r in reqs):
        reqs.append(Request(1, draw(st.integers(0, p.max_context))))
    return tuple(reqs), num_decodes


@st.composite
def block_tables(draw, blocks_needed: list[int], allow_idx_mapping: bool, shareable: list[int] | None = None):
    """Rows of physical block ids: contiguous, permuted, or sharing prefix blocks; 0 pads a row.

    `shareable`: per row, how many leading blocks may be shared (None: any). vLLM shares only full blocks of
    cached tokens; a block a request writes its new tokens into is never another request's context."""
    width = max(max(blocks_needed, default=0), 1) + draw(st.integers(0, 2))
    total = sum(blocks_needed)
    layout = draw(st.sampled_from(("arange", "permuted", "shared_prefix")))
    ids = list(range(1, total + 1))
    if layout == "permuted" and total > 1:
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
    if allow_idx_mapping and draw(st.booleans()):
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
    )


@st.composite
def dcp_splits(draw, p: Profile, block_size: int) -> Dcp:
    size = draw(st.sampled_from(p.dcp_sizes))
    if size == 1:
        return Dcp()
    interleaves = [1] + [i for i in (2, 4, 8, 16, 32, 64) if block_size % i == 0]
    return Dcp(size, draw(st.integers(0, size - 1)), draw(st.sampled_from(interleaves)))


@st.composite
def index_calls(draw, f: IndexFeatures, case_has_decodes: bool, case_has_prefills: bool, dcp: Dcp) -> IndexCall:
    token_rows = "decodes" if case_has_decodes and draw(st.booleans()) else "all"
    req_id_rows = "match"
    if f.row_contract_breaks and token_rows == "decodes" and case_has_prefills and draw(st.booleans()):
        req_id_rows = "full_batch"
    workspace = f.prefill_workspace and dcp.size == 1 and case_has_prefills and draw(st.booleans())
    return IndexCall(draw(st.booleans()), workspace, token_rows, req_id_rows)


def _paged_batch(reqs, num_decodes: int, block_size: int, table, topk_width: int) -> dict:
    """The Case fields every strategy draws the same way: the requests and their paged cache (draws nothing)."""
    return dict(requests=reqs, num_decodes=num_decodes, block_size=block_size, block_table=table,
                topk_width=topk_width)


@st.composite
def index_cases(draw, p: Profile, f: IndexFeatures) -> Case:
    # The profile's widths first (shrinking goes to 128), then any multiple of 128 up to 2048.
    topk_width = draw(st.one_of(st.sampled_from(p.topk_widths), st.integers(1, 16).map(lambda k: 128 * k)))
    reqs, num_decodes = draw(requests(p, topk_width))
    block_size = draw(st.sampled_from(p.block_sizes))
    dcp = draw(dcp_splits(p, block_size)) if f.dcp else Dcp()
    local = [_local_len(r.seq_len, dcp) for r in reqs]
    table, idx_mapping = draw(block_tables([_cdiv(n, block_size) for n in local], f.idx_mapping))
    stride = 0
    if f.block_stride_rows and draw(st.booleans()):
        stride = block_size * draw(st.integers(2, 3))  # other layers' pages between this layer's blocks
    has_dec = any(r.query_len for r in reqs[:num_decodes])
    has_pre = any(r.query_len for r in reqs[num_decodes:])
    return Case(
        **_paged_batch(reqs, num_decodes, block_size, table, topk_width),
        topk=tuple(draw(topk_specs(topk_width)) for _ in reqs),
        block_stride_rows=stride,
        idx_mapping=idx_mapping,
        dcp=dcp,
        call=draw(index_calls(f, has_dec, has_pre, dcp)),
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
    # Batches only in the order vLLM's model runner makes (see `requests`): for releases whose chunked-context
    # metadata relies on it (0.26 counts the prefill tokens with context as a prefix of the prefills).
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
    # Padding rows come with their padded tokens (Case.padded_tokens), as vLLM's runner makes them under full
    # CUDA graphs. Targets that feed those rows to vLLM set it; the others keep padding rows of no tokens.
    cudagraph_padding: bool = False


TOTAL_HEADS = 128  # DeepSeek-V3.2's attention heads: heads per rank are 128 / TP


@st.composite
def attention_dcp_splits(draw, p: Profile, block_size: int, heads: int, max_gathered_heads: int,
                         only_sizes: tuple[int, ...] | None = None) -> Dcp:
    """A whole DCP group (every rank runs; `rank` stays 0): sizes 2 first (shrinking goes there), 1 as the
    no-DCP baseline, interleave 1 or any power of two dividing the block size. DCP reuses TP ranks, so its
    size divides TP = TOTAL_HEADS / heads (vLLM's ParallelConfig checks tp % dcp == 0)."""
    sizes = [n for n in (2, 1, 3, 4, 8) if n in (only_sizes or (1, *p.dcp_sizes)) and heads * n <= max_gathered_heads
             and (TOTAL_HEADS // heads) % n == 0]
    size = draw(st.sampled_from(sizes))
    if size == 1:
        return Dcp()
    interleaves = [1] + [i for i in (2, 4, 8, 16, 32, 64) if block_size % i == 0]
    return Dcp(size, 0, draw(st.sampled_from(interleaves)))


@functools.lru_cache(maxsize=None)
def attention_topk_specs(width: int) -> st.SearchStrategy[TopkSpec]:
    # The indexer only emits positions < seq_len: no `past_seq` (its slots hold other data by design).
    return st.builds(TopkSpec, valid=st.integers(0, width), invalid_at=st.sampled_from(INVALID_AT),
                     past_table=st.integers(0, 2))


@functools.lru_cache(maxsize=None)
def _indexer_full_spec(width: int) -> st.SearchStrategy[TopkSpec]:
    return st.builds(TopkSpec, valid=st.just(width), invalid_at=st.sampled_from(INVALID_AT))


@st.composite
def attention_cases(draw, p: Profile, f: AttentionFeatures) -> Case:

    p = p.for_attention()
    outside = f.dcp and f.dcp_outside_envelope and draw(st.integers(0, 9)) == 0  # one case in ten
    heads_choices = tuple(f.heads or p.attn_heads) + ((32,) if outside else ())
    if f.dcp and f.dcp_sizes:  # a fixed group size: only head counts whose TP it divides
        heads_choices = tuple(h for h in heads_choices if any(
            (TOTAL_HEADS // h) % n == 0 and (outside or h * n <= f.dcp_max_gathered_heads) for n in f.dcp_sizes))
    heads = draw(st.sampled_from(heads_choices))
    topk_width = draw(st.sampled_from(p.topk_widths))
    block_size = draw(st.sampled_from(f.block_sizes or p.block_sizes))
    bound = 1024 if outside else f.dcp_max_gathered_heads
    dcp = draw(attention_dcp_splits(p, block_size, heads, bound, f.dcp_sizes)) if f.dcp else Dcp()
    # vLLM allows multi-token (MTP) decodes under DCP only with interleave 1 (supports_dcp_with_varlen).
    reqs, num_decodes = draw(requests(p, topk_width, 1 if dcp.interleave > 1 else MAX_DECODE_QUERY_LEN,
                                      vllm_order=f.vllm_batch_order))
    # Under DCP a block id names one block on every rank: a "virtual" block of block_size x size tokens.
    virtual = block_size * dcp.size
    table, _ = draw(block_tables([_cdiv(r.seq_len, virtual) for r in reqs], False,
                                 shareable=[r.context_len // virtual for r in reqs]))
    stride = block_size * draw(st.integers(2, 3)) if f.block_stride_rows and draw(st.booleans()) else 0
    kv_dtype = draw(st.sampled_from(f.kv_cache_dtypes))
    return Case(
        **_paged_batch(reqs, num_decodes, block_size, table, topk_width),
        topk=tuple(draw(_indexer_full_spec(topk_width) if f.indexer_fills_short_seqs and r.seq_len <= topk_width
                        else attention_topk_specs(topk_width)) for r in reqs),
        block_stride_rows=stride,
        dcp=dcp,
        heads=heads,
        kv_cache_dtype=kv_dtype,
        fp8_scale=draw(st.sampled_from(FP8_SCALES)) if kv_dtype == "fp8_ds_mla" else "pow2",
        values=draw(st.sampled_from(VALUE_KINDS)),
        seed=draw(st.integers(0, 2**16)),
        padded_tokens=_graph_padding(reqs, num_decodes) if f.cudagraph_padding else 0,
    ).validate()


def _graph_padding(reqs: tuple[Request, ...], num_decodes: int) -> int:
    """The tokens a full CUDA graph gives a uniform decode batch's trailing padding rows (0: not such a batch)."""
    pads = sum(1 for r in reqs if r.query_len == 0)
    if num_decodes != len(reqs) or not pads or any(r.query_len == 0 for r in reqs[: len(reqs) - pads]):
        return 0
    return pads * max(r.query_len for r in reqs)
