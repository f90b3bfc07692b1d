"""Traces: the steps one engine ran before a case, drawn backwards from it.

vLLM's model runner keeps one metadata builder, one impl, one KV cache and its persistent buffers for the
life of the engine, so a step runs on what earlier steps left: rows of `req_id_per_token_buffer` and of the
indexer's top-k buffer past this step's tokens, cache blocks a finished request wrote and a new one reuses,
context that earlier steps (not the harness) wrote. A trace is drawn from its last step back: the step
before a case holds each continuing request one step earlier (a decode of the same or another query length,
or the prefill chunk that wrote its last context tokens), plus requests that finished since, whose blocks
the case's requests now hold. The earlier step can be larger or smaller than the one after it (a batch
that shrinks leaves stale rows behind it).

Only the last step is drawn by the case strategies (swarms, boundaries): the steps before it follow from it,
so shrinking a trace's earlier steps away leaves the case it was, and a single step stays the default.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from hypothesis import strategies as st

from strategies.case import MAX_DECODE_QUERY_LEN, Case, Request, TopkSpec
from strategies.swarm import Swarm, category

MAX_EARLIER = 3  # earlier steps in a trace (the `trace` knob: single, short = 1, long = 2 or 3)
CHUNK = 96  # the largest prefill chunk an earlier step gives a continuing request's context


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@st.composite
def earlier_steps(draw, case: Case, spec: Callable[[Request], st.SearchStrategy[TopkSpec]],
                  swarm: Swarm | None = None, max_decode_query_len: int = MAX_DECODE_QUERY_LEN,
                  max_earlier: int = MAX_EARLIER, max_tokens: int = CHUNK, mtp_draft: bool = False) -> tuple[Case, ...]:
    """Up to `max_earlier` steps before `case`, oldest first, each of at most `max_tokens` query tokens (the
    profile's step size); `spec` draws a request's TopkSpec as the case's do; `mtp_draft`: the two steps
    before the case may be MTP draft steps (`draft_pair`)."""
    kind = category(draw, swarm, "trace")
    if kind is None:  # the plain search: any length, shrinking to a single step
        n = draw(st.integers(0, max_earlier))
    else:
        n = {"single": 0, "short": 1}[kind] if kind != "long" else draw(st.integers(2, max(2, max_earlier)))
    n = min(n, max_earlier)
    steps: list[Case] = []
    later = case
    # MTP draft steps: the two steps before the case are the draft model's fused multi-step decode (a first
    # draft step of one token per request, then a step on its metadata updated in place, one token on).
    mtp = category(draw, swarm, "mtp_draft") if mtp_draft else "off"
    if (mtp == "on" or (mtp is None and draw(st.integers(0, 3)) == 0)) and max_earlier >= 2 and n:
        pair = draft_pair(draw, case, spec, seed=case.seed + 7_000_003)
        if pair is not None:
            steps, later, n = list(pair), pair[0], max(0, max(n, 2) - 2)
    for k in range(n):
        step = draw(step_before(later, spec, max_decode_query_len, seed=case.seed + 1_000_003 * (k + 1),
                                max_tokens=max_tokens))
        if step is None:
            break
        steps.insert(0, step)
        later = step
    return tuple(steps)


def draft_pair(draw, later: Case, spec, seed: int) -> tuple[Case, Case] | None:
    """(the first draft step, the draft step after it on the same metadata) that ran before `later`: each of
    `later`'s requests with at least 3 cached tokens, one token per step, in `later`'s block-table rows."""
    rows = [(req, later.block_table[later.table_row(r)]) for r, req in enumerate(later.requests)
            if req.query_len and req.context_len >= 3]
    if not rows:
        return None
    table = tuple(row for _, row in rows)

    def step(back: int, k: int) -> Case:
        reqs = tuple(Request(1, req.context_len - back) for req, _ in rows)
        return dataclasses.replace(later, requests=reqs, num_decodes=len(reqs), block_table=table, idx_mapping=None,
                                   topk=tuple(draw(spec(r)) for r in reqs), seed=(seed + k) % 2**31,
                                   padded_tokens=0, cudagraph="none", earlier=(), mtp_draft=k == 1)

    if later.cudagraph != "none":  # a full-graph engine replays its draft steps from a graph: not this path
        return None
    return step(2, 0), step(1, 1)


@st.composite
def step_before(draw, later: Case, spec, max_decode_query_len: int, seed: int, max_tokens: int = CHUNK) -> Case | None:
    """The step the engine ran before `later`, of at most `max_tokens` query tokens; None when nothing of
    `later` could have run before it."""
    virtual = later.block_size * later.dcp.size  # tokens one block id names (a block on every DCP rank)
    width = len(later.block_table[0])
    q_dec = draw(st.integers(1, max(1, min(max_decode_query_len, max_tokens))))  # decode query length (1, or MTP)
    budget = max_tokens
    decodes, prefills = [], []  # (Request, block-table row)
    for r, req in enumerate(later.requests):
        if not req.query_len or not req.context_len or budget < 1 or draw(st.integers(0, 3)) == 0:
            continue  # padding rows and fresh prefills were not in the step before; some requests arrive now
        row = later.block_table[later.table_row(r)]
        if req.context_len >= q_dec and budget >= q_dec and draw(st.booleans()):
            decodes.append((Request(q_dec, req.context_len - q_dec), row))
            budget -= q_dec
        else:  # the prefill chunk that wrote its last context tokens
            q = draw(st.integers(1, min(req.context_len, CHUNK, budget)))
            prefills.append((Request(q, req.context_len - q), row))
            budget -= q
    # Requests that finished since: their blocks are free now, and `later`'s requests may hold them for the
    # tokens they write (a block that is context in `later` was not free in between).
    context = {later.block_table[later.table_row(r)][p // virtual]
               for r, req in enumerate(later.requests) for p in range(0, req.context_len, virtual)}
    used = sorted({b for row in later.block_table for b in row if b} - context)
    for _ in range(draw(st.integers(0 if decodes or prefills else 1, 2))):
        if budget < 1:
            break
        blocks = draw(st.integers(1, min(width, 4)))
        reuse = draw(st.booleans()) and len(used) >= blocks
        ids = draw(st.permutations(used))[:blocks] if reuse else [later.num_blocks + 1 + i for i in range(blocks)]
        seq = draw(st.integers(1, blocks * virtual))
        row = tuple(ids) + (0,) * (width - blocks)
        if seq > q_dec and budget >= q_dec and draw(st.booleans()):
            decodes.append((Request(q_dec, seq - q_dec), row))
            budget -= q_dec
        else:
            q = draw(st.integers(1, min(seq, CHUNK, budget)))
            prefills.append((Request(q, seq - q), row))
            budget -= q
    batch = decodes + prefills
    if not batch:
        return None
    reqs = tuple(r for r, _ in batch)
    return dataclasses.replace(
        later, requests=reqs, num_decodes=len(decodes), block_table=tuple(row for _, row in batch), idx_mapping=None,
        topk=tuple(draw(spec(r)) for r in reqs), seed=seed % 2**31, padded_tokens=0, earlier=())
