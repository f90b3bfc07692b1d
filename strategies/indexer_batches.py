"""Hypothesis strategies for DeepSeek-V3.2 / GLM-5 indexer steps (Case.indexer): what vLLM's sparse-attention
indexer sees from the model runner.

A step is a batch in vLLM's order: decodes (one token each, or 1 + k under MTP, uniform), padding rows as a full
CUDA graph pads a decode batch, then extends (prefix-cache hits, chunked prefills) and fresh prefills. Contexts run
past the top-k widths the kernels take (512, 1024, 2048), so the top-k selects; the index heads are DeepSeek-V3.2's
64 or GLM-5's 32; the top-k backend is any `sparse_indexer_topk_backend` an SM90 host resolves; a tight logits
budget splits the prefills into chunks; earlier steps of the same engine (a trace) wrote part of the cache and
left the persistent top-k buffer as they left it. Block tables are the sparse-MLA strategies' (strategies.batches):
in order, permuted, or sharing prefix blocks; the indexer's cache has 64-token blocks on CUDA.
"""

from __future__ import annotations

import dataclasses

from hypothesis import assume
from hypothesis import strategies as st

from strategies.batches import (
    PCP_LAYOUTS,
    PCP_ONLY_LAYOUTS,
    TOTAL_HEADS,
    CaseSpace,
    _at_block_edges,
    _cdiv,
    _domains,
    _graph_padding,
    _interleaves,
    _pcp_layout_fits,
    _sampled,
    block_tables,
    requests,
)
from strategies.case import (
    COOPERATIVE_MAX_ROWS,
    CUDAGRAPH_MODES,
    INDEXER_MAX_SPECULATIVE,
    INDEXER_TOPK_BACKENDS,
    VALUE_KINDS,
    Case,
    Dcp,
    IndexerStep,
    Request,
    TopkSpec,
)
from strategies.profiles import Profile
from strategies.swarm import Swarm, category
from strategies.traces import earlier_steps

INDEXER_BLOCK_SIZE = 64  # DeepseekV32IndexerBackend.get_supported_kernel_block_sizes on CUDA

INDEXER_KNOBS = ("decodes", "decode_query_len", "decode_context", "padding_rows", "prefills", "prefill_len",
                 "prefill_context", "block_edge", "table_layout", "table_last_column", "topk_width", "heads", "values",
                 "topk_backend", "logits_budget", "trace")


def indexer_knobs(p: Profile, topk_backends: tuple[str, ...] = INDEXER_TOPK_BACKENDS) -> dict[str, tuple[str, ...]]:
    x = p.indexer
    return _domains(INDEXER_KNOBS, topk_width=tuple(map(str, x.topk_widths)), heads=tuple(map(str, x.heads)),
                    topk_backend=topk_backends)


def indexer_space(p: Profile, topk_backends: tuple[str, ...] = INDEXER_TOPK_BACKENDS,
                  graph_modes: tuple[str, ...] = CUDAGRAPH_MODES) -> CaseSpace:
    return CaseSpace(lambda swarm: indexer_cases(p, topk_backends, swarm, graph_modes=graph_modes),
                     indexer_knobs(p, topk_backends))


@st.composite
def indexer_cases(draw, p: Profile, topk_backends: tuple[str, ...] = INDEXER_TOPK_BACKENDS,
                  swarm: Swarm | None = None, dcp: Dcp | None = None, kv_cache_dtype: str = "bfloat16",
                  graph_modes: tuple[str, ...] = CUDAGRAPH_MODES) -> Case:
    """`dcp`: the steps under decode context parallelism (every rank runs them): block ids name a block on every
    rank (the table covers virtual blocks of block_size x dcp.size tokens), top-k widths the DCP merge takes, and
    MTP decodes only with interleave 1 (vLLM's supports_dcp_with_varlen). `graph_modes`: the engines drawn, eager
    ("none": no graph padding), full-graph (a padded steady-state decode) or both."""
    x, dcp = p.indexer, dcp or Dcp()
    sizes = dataclasses.replace(p, max_decodes=x.max_decodes, max_prefills=x.max_prefills, max_tokens=x.max_tokens,
                                max_context=x.max_context)
    widths = x.topk_widths
    if dcp.size > 1:
        widths = tuple(w for w in widths if w in DCP_MERGE_TOPK_WIDTHS) or DCP_MERGE_TOPK_WIDTHS[:1]
    topk_width = _sampled(draw, swarm, "topk_width", widths)
    heads = _sampled(draw, swarm, "heads", x.heads)
    mtp = category(draw, swarm, "decode_query_len")
    num_spec = draw(st.integers(1 if mtp == "mtp" else 0, 0 if mtp == "one" else INDEXER_MAX_SPECULATIVE))
    if dcp.interleave > 1:
        num_spec = 0
    # A full-graph engine replays a steady-state decode step, padded: drawn half the time without a swarm.
    padded = category(draw, swarm, "padding_rows")
    steady = "none" not in graph_modes or padded == "some" or (padded is None and draw(st.booleans()))
    # padding rows come with a full graph's padding: an eager batch has none
    reqs, num_decodes = draw(requests(sizes, topk_width, 1 + num_spec, vllm_order=True, swarm=swarm,
                                      decode_only=steady, padding_rows="full" in graph_modes))
    reqs = _at_block_edges(draw, reqs, num_decodes, INDEXER_BLOCK_SIZE, x.max_context, swarm)
    reqs = _short_decodes(draw, reqs, num_decodes, dcp)
    virtual = INDEXER_BLOCK_SIZE * dcp.size  # under DCP a block id names one block on every rank
    table, _ = draw(block_tables([_cdiv(r.seq_len, virtual) for r in reqs], False,
                                 shareable=[r.context_len // virtual for r in reqs], swarm=swarm))
    padded_tokens = _graph_padding(reqs, num_decodes)
    assume(padded_tokens or "none" in graph_modes)
    budget = category(draw, swarm, "logits_budget") or draw(st.sampled_from(("default", "tight")))
    # cooperative and persistent refuse other widths (vLLM raises: a configuration error, not a bug to find)
    backends = tuple(b for b in topk_backends if topk_width in (512, 1024, 2048) or b in ("auto", "per_row", "torch"))
    rows = sum(r.query_len for r in reqs[:num_decodes]) + padded_tokens
    backends = tuple(b for b in backends if b != "cooperative" or rows <= COOPERATIVE_MAX_ROWS)
    indexer = IndexerStep(topk_backend=_sampled(draw, swarm, "topk_backend", backends or topk_backends),
                          num_speculative_tokens=num_spec, max_logits_mb=x.tight_logits_mb if budget == "tight" else 512,
                          num_sms=_sms(draw(st.sampled_from(x.sms)), num_spec))
    case = Case(requests=reqs, num_decodes=num_decodes, block_size=INDEXER_BLOCK_SIZE, block_table=table,
                topk_width=topk_width, topk=(), heads=heads, kv_cache_dtype=kv_cache_dtype, dcp=dcp,
                values=_sampled(draw, swarm, "values", VALUE_KINDS), seed=draw(st.integers(0, 2**16)),
                padded_tokens=padded_tokens, cudagraph="full" if padded_tokens else "none",
                indexer=indexer).validate()
    if p.max_steps < 2:
        return case
    # Drawn last: shrinking the earlier steps away leaves the case as it was. The indexer makes every row, so the
    # earlier steps hold no drawn top-k either.
    earlier = draw(earlier_steps(case, lambda r: st.just(TopkSpec(0)), swarm, 1 + num_spec,
                                 max_earlier=p.max_steps - 1, max_tokens=x.max_tokens))
    earlier = tuple(dataclasses.replace(e, topk=(), cudagraph=case.cudagraph) for e in earlier)
    if case.indexer.topk_backend == "cooperative" and max(
            s.num_decode_tokens + s.padded_tokens for s in (*earlier, case)) > COOPERATIVE_MAX_ROWS:
        # an engine whose decode batches pass cooperative's row limit is configured "auto" (vLLM refuses it)
        auto = dataclasses.replace(case.indexer, topk_backend="auto")
        case = dataclasses.replace(case, indexer=auto)
        earlier = tuple(dataclasses.replace(e, indexer=auto) for e in earlier)
    return dataclasses.replace(case, earlier=earlier).validate() if earlier else case


def _sms(num_sms: int, num_spec: int) -> int:
    """SM90 runs next_n 4 (3 draft tokens) on clusters of 2 SMs: 1 SM becomes 2 there."""
    return 2 if num_sms == 1 and num_spec == 3 else num_sms


def _short_decodes(draw, reqs: tuple[Request, ...], num_decodes: int, dcp: Dcp) -> tuple[Request, ...]:
    """Under DCP, half the time, a decode between two others of a request too short to reach the last rank (at most
    (size - 1) x interleave tokens: a short prompt's first tokens): its DCP-local length there is 0 between two
    requests that have keys, as the indexer then hands DeepGEMM's paged logits. Shrinking undoes it."""
    room = (dcp.size - 1) * dcp.interleave
    if dcp.size < 2 or num_decodes < 3 or not draw(st.booleans()):
        return reqs
    i = draw(st.integers(1, num_decodes - 2))
    r = reqs[i]
    if not 0 < r.query_len <= room:  # a graph's padding request stays as it is
        return reqs
    return (*reqs[:i], Request(r.query_len, draw(st.integers(0, room - r.query_len))), *reqs[i + 1:])


def attention_module_space(p: Profile, attention_heads: tuple[int, ...],
                           graph_modes: tuple[str, ...] = CUDAGRAPH_MODES) -> CaseSpace:
    """DeepSeek-V3.2's attention module around its indexer (`vllm.dsv32.attention`): the indexer's steps (same knobs),
    each engine with the module's MLA heads per rank and, half the time, a second layer that reuses the first's top-k."""
    return CaseSpace(lambda swarm: attention_module_cases(p, attention_heads, swarm, graph_modes), indexer_knobs(p))


@st.composite
def attention_module_cases(draw, p: Profile, attention_heads: tuple[int, ...], swarm: Swarm | None = None,
                           graph_modes: tuple[str, ...] = CUDAGRAPH_MODES) -> Case:
    case = draw(indexer_cases(p, INDEXER_TOPK_BACKENDS, swarm, graph_modes=graph_modes))
    # Drawn after the steps (the engine's fields: every step of a trace holds them): shrinking keeps them.
    x = dataclasses.replace(case.indexer, attention_heads=draw(st.sampled_from(attention_heads)),
                            skip_topk_layer=draw(st.booleans()))
    earlier = tuple(dataclasses.replace(e, indexer=x) for e in case.earlier)
    return dataclasses.replace(case, indexer=x, earlier=earlier).validate()


# The DCP top-k merge (`_merge_dcp_topk_global`) takes these widths only (vLLM raises on others: a configuration
# error); the first is where shrinking goes.
DCP_MERGE_TOPK_WIDTHS = (512, 1024, 2048)
# FlashMLA sparse under DCP: the fp8 mixed-batch path only (fewer than 32 heads a rank), the gathered heads inside
# the local heads' fp8 envelope (64), DCP dividing TP = 128 / heads (powers of two: 3 divides no TP here).
DCP_SIZES = (2, 4, 8)
DCP_MAX_GATHERED_HEADS = 64


def _merge_topk_widths(p: Profile) -> Profile:
    """The profile with the indexer's top-k widths narrowed to those the DCP merge takes."""
    x = p.indexer
    widths = tuple(w for w in x.topk_widths if w in DCP_MERGE_TOPK_WIDTHS) or DCP_MERGE_TOPK_WIDTHS[:1]
    return dataclasses.replace(p, indexer=dataclasses.replace(x, topk_widths=widths))


def attention_module_dcp_space(p: Profile, attention_heads: tuple[int, ...], combine_rows: int | None = None,
                               graph_modes: tuple[str, ...] = CUDAGRAPH_MODES) -> CaseSpace:
    """DeepSeek-V3.2's attention module under DCP (`vllm.dsv32.attention.dcp`): a DCP group of 2-8 ranks (heads per
    rank whose TP it divides and whose gathered heads stay within FlashMLA's fp8 envelope), its interleave, then the
    indexer's steps over virtual blocks, an fp8_ds_mla MLA cache (vLLM runs FlashMLA sparse under DCP on no other),
    and half the time a skip_topk layer. `combine_rows`: a cap on tokens x gathered heads x ranks a step's LSE
    combine runs per layer (None: none), each step's tokens cut to fit it (at least 2): where the combine's kernel is
    interpreted it costs a program per token and gathered head on every rank."""
    p = _merge_topk_widths(p)  # the knobs' top-k widths too
    return CaseSpace(lambda swarm: attention_module_dcp_cases(p, attention_heads, combine_rows, swarm, graph_modes),
                     indexer_knobs(p))


@st.composite
def attention_module_dcp_cases(draw, p: Profile, attention_heads: tuple[int, ...], combine_rows: int | None = None,
                               swarm: Swarm | None = None, graph_modes: tuple[str, ...] = CUDAGRAPH_MODES) -> Case:
    fits = [(h, n) for n in DCP_SIZES for h in attention_heads
            if h < 32 and h * n <= DCP_MAX_GATHERED_HEADS and (TOTAL_HEADS // h) % n == 0]
    size = draw(st.sampled_from(sorted({n for _, n in fits})))
    heads = draw(st.sampled_from([h for h, n in fits if n == size]))
    # interleave 1 half the time (where shrinking goes): the only one under which vLLM takes MTP decodes with DCP
    interleave = draw(st.sampled_from(_interleaves(INDEXER_BLOCK_SIZE)[1:])) if draw(st.booleans()) else 1
    if combine_rows is not None:
        x = p.indexer
        p = dataclasses.replace(p, indexer=dataclasses.replace(
            x, max_tokens=min(x.max_tokens, max(2, combine_rows // (heads * size * size)))))
    case = draw(indexer_cases(p, INDEXER_TOPK_BACKENDS, swarm, dcp=Dcp(size, 0, interleave),
                              kv_cache_dtype="fp8_ds_mla", graph_modes=graph_modes))
    x = dataclasses.replace(case.indexer, attention_heads=heads, skip_topk_layer=draw(st.booleans()))
    earlier = tuple(dataclasses.replace(e, indexer=x) for e in case.earlier)
    return dataclasses.replace(case, indexer=x, earlier=earlier).validate()


SHARDQ_TP_SIZES = (2, 4)  # TP ranks ShardQ splits a prefill's tokens over (each rank runs a step's whole seam)


def attention_module_shardq_space(p: Profile, attention_heads: tuple[int, ...]) -> CaseSpace:
    """DeepSeek-V3.2's attention module under TP with ShardQ (`vllm.dsv32.attention.shardq`, vLLM 0.34+): 2 or 4 TP
    ranks, heads per rank under FlashMLA's bf16-prefill threshold (ShardQ runs the fp8 mixed-batch kernel: fewer
    than 32, every rank's heads at most 128), the indexer's steps on an fp8_ds_mla cache every rank holds whole,
    eager (vLLM turns ShardQ off under full graphs), half the time a skip_topk layer, and the fewest prefill tokens
    ShardQ splits (sparse_mla_shard_q_min_tokens) drawn up to the step's prefill tokens, so that the step splits
    wherever a prompt reaches past the top-k and every rank gets a token."""
    return CaseSpace(lambda swarm: attention_module_shardq_cases(p, attention_heads, swarm), indexer_knobs(p))


@st.composite
def attention_module_shardq_cases(draw, p: Profile, attention_heads: tuple[int, ...],
                                  swarm: Swarm | None = None) -> Case:
    fits = [(h, n) for n in SHARDQ_TP_SIZES for h in attention_heads if h < 32 and (TOTAL_HEADS // h) % n == 0]
    tp = draw(st.sampled_from(sorted({n for _, n in fits})))
    heads = draw(st.sampled_from([h for h, n in fits if n == tp]))
    case = draw(indexer_cases(p, INDEXER_TOPK_BACKENDS, swarm, dcp=Dcp(1, 0, 1, 1, tp), kv_cache_dtype="fp8_ds_mla",
                              graph_modes=("none",)))
    prefill_tokens = case.num_tokens - case.num_decode_tokens
    x = dataclasses.replace(case.indexer, attention_heads=heads, skip_topk_layer=draw(st.booleans()),
                            shardq_min_tokens=draw(st.integers(1, max(1, prefill_tokens))))
    earlier = tuple(dataclasses.replace(e, indexer=x) for e in case.earlier)
    return dataclasses.replace(case, indexer=x, earlier=earlier).validate()


def attention_module_pcp_space(p: Profile, attention_heads: tuple[int, ...],
                               combine_rows: int | None = None) -> CaseSpace:
    """DeepSeek-V3.2's attention module under PCP x DCP (`vllm.dsv32.attention.pcp_dcp`): a PCP x DCP (x TP) layout
    of PCP_LAYOUTS, or of PCP_ONLY_LAYOUTS (PCP without DCP: decodes sharded over the PCP ranks), that the heads per
    rank fit, then the steps of `attention_module_dcp_space` under it, eager (the PCP runner pads no graph).
    `combine_rows` as there, over the layout's world."""
    p = _merge_topk_widths(p)
    return CaseSpace(lambda swarm: attention_module_pcp_cases(p, attention_heads, combine_rows, swarm),
                     indexer_knobs(p))


@st.composite
def attention_module_pcp_cases(draw, p: Profile, attention_heads: tuple[int, ...], combine_rows: int | None = None,
                               swarm: Swarm | None = None) -> Case:
    layouts = {**PCP_LAYOUTS, **PCP_ONLY_LAYOUTS}
    fits = [(n, h) for n in layouts for h in attention_heads if h < 32 and _pcp_layout_fits(n, h)]
    name = draw(st.sampled_from(sorted({n for n, _ in fits})))
    heads = draw(st.sampled_from([h for n, h in fits if n == name]))
    pcp, size, tp = layouts[name]
    interleave = draw(st.sampled_from(_interleaves(INDEXER_BLOCK_SIZE)[1:])) if size > 1 and draw(st.booleans()) else 1
    if combine_rows is not None:
        x = p.indexer
        p = dataclasses.replace(p, indexer=dataclasses.replace(
            x, max_tokens=min(x.max_tokens, max(2, combine_rows // (heads * tp * size * pcp)))))
    # eager: the PCP runner pads no graph, so its batches hold no padding rows either
    case = draw(indexer_cases(p, INDEXER_TOPK_BACKENDS, swarm, dcp=Dcp(size, 0, interleave, pcp, tp),
                              kv_cache_dtype="fp8_ds_mla", graph_modes=("none",)))
    x = dataclasses.replace(case.indexer, attention_heads=heads, skip_topk_layer=draw(st.booleans()))
    earlier = tuple(dataclasses.replace(e, indexer=x) for e in case.earlier)
    return dataclasses.replace(case, indexer=x, earlier=earlier).validate()
