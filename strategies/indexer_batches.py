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

from hypothesis import strategies as st

from strategies.batches import CaseSpace, _at_block_edges, _cdiv, _domains, _graph_padding, _sampled, block_tables, requests
from strategies.case import INDEXER_MAX_SPECULATIVE, INDEXER_TOPK_BACKENDS, VALUE_KINDS, Case, IndexerStep, TopkSpec
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


def indexer_space(p: Profile, topk_backends: tuple[str, ...] = INDEXER_TOPK_BACKENDS) -> CaseSpace:
    return CaseSpace(lambda swarm: indexer_cases(p, topk_backends, swarm), indexer_knobs(p, topk_backends))


@st.composite
def indexer_cases(draw, p: Profile, topk_backends: tuple[str, ...] = INDEXER_TOPK_BACKENDS,
                  swarm: Swarm | None = None) -> Case:
    x = p.indexer
    sizes = dataclasses.replace(p, max_decodes=x.max_decodes, max_prefills=x.max_prefills, max_tokens=x.max_tokens,
                                max_context=x.max_context)
    topk_width = _sampled(draw, swarm, "topk_width", x.topk_widths)
    heads = _sampled(draw, swarm, "heads", x.heads)
    mtp = category(draw, swarm, "decode_query_len")
    num_spec = draw(st.integers(1 if mtp == "mtp" else 0, 0 if mtp == "one" else INDEXER_MAX_SPECULATIVE))
    # A full-graph engine replays a steady-state decode step, padded: drawn half the time without a swarm.
    padded = category(draw, swarm, "padding_rows")
    steady = padded == "some" or (padded is None and draw(st.booleans()))
    reqs, num_decodes = draw(requests(sizes, topk_width, 1 + num_spec, vllm_order=True, swarm=swarm,
                                      decode_only=steady))
    reqs = _at_block_edges(draw, reqs, num_decodes, INDEXER_BLOCK_SIZE, x.max_context, swarm)
    table, _ = draw(block_tables([_cdiv(r.seq_len, INDEXER_BLOCK_SIZE) for r in reqs], False,
                                 shareable=[r.context_len // INDEXER_BLOCK_SIZE for r in reqs], swarm=swarm))
    padded_tokens = _graph_padding(reqs, num_decodes)
    budget = category(draw, swarm, "logits_budget") or draw(st.sampled_from(("default", "tight")))
    # cooperative and persistent refuse other widths (vLLM raises: a configuration error, not a bug to find)
    backends = tuple(b for b in topk_backends if topk_width in (512, 1024, 2048) or b in ("auto", "per_row", "torch"))
    indexer = IndexerStep(topk_backend=_sampled(draw, swarm, "topk_backend", backends or topk_backends),
                          num_speculative_tokens=num_spec, max_logits_mb=x.tight_logits_mb if budget == "tight" else 512)
    case = Case(requests=reqs, num_decodes=num_decodes, block_size=INDEXER_BLOCK_SIZE, block_table=table,
                topk_width=topk_width, topk=(), heads=heads, kv_cache_dtype="bfloat16",
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
    return dataclasses.replace(case, earlier=earlier).validate() if earlier else case


def attention_module_space(p: Profile, attention_heads: tuple[int, ...]) -> CaseSpace:
    """DeepSeek-V3.2's attention module around its indexer (`vllm.dsv32.attention`): the indexer's steps (same knobs),
    each engine with the module's MLA heads per rank and, half the time, a second layer that reuses the first's top-k."""
    return CaseSpace(lambda swarm: attention_module_cases(p, attention_heads, swarm), indexer_knobs(p))


@st.composite
def attention_module_cases(draw, p: Profile, attention_heads: tuple[int, ...], swarm: Swarm | None = None) -> Case:
    case = draw(indexer_cases(p, INDEXER_TOPK_BACKENDS, swarm))
    # Drawn after the steps (the engine's fields: every step of a trace holds them): shrinking keeps them.
    x = dataclasses.replace(case.indexer, attention_heads=draw(st.sampled_from(attention_heads)),
                            skip_topk_layer=draw(st.booleans()))
    earlier = tuple(dataclasses.replace(e, indexer=x) for e in case.earlier)
    return dataclasses.replace(case, indexer=x, earlier=earlier).validate()
