"""Hypothesis strategies for Step5 DSA steps (Case.step5): what vLLM's STEP5_DSA backend sees on its decode route.

A step is a batch of decodes of one token each (the backend's uniform route, `is_decode`), run for `Step5.steps`
consecutive steps by one engine (each request one token on per step; the case is the last). The strategy places
requests where the backend's edges are: fewer closed regions than topk (every one kept), within one of topk, or far
more (the indexer's cut); a last token that closes its 8-token region (its summary is written this step) or opens
one; regions with repeated keys (equal scores at the cut, broken by region order); batches of more than 128
(token, KV group) rows, which the attention kernel runs as one split; padding rows after the decodes as a full CUDA
graph pads the batch (slot -1, an all-null table row). Block tables in order or
permuted, with a spare column or none. Sizes come from the profile (Profile.step5).

Every knob is a swarm knob (strategies.swarm); without a swarm each is drawn uniformly over its categories.
"""

from __future__ import annotations

from hypothesis import strategies as st

from strategies.batches import CaseSpace, _domains
from strategies.case import Case, Request, Step5
from strategies.profiles import Profile
from strategies.swarm import Swarm, category

MANY_MAX_CONTEXT = 256  # tokens a request of a "many" batch holds at most (its rows' cost)

STEP5_KNOBS = ("step5_groups", "step5_heads", "step5_index_heads", "step5_topk", "step5_context", "step5_region_edge",
               "step5_steps", "step5_regions", "step5_defer_clear", "step5_kv", "step5_batch", "padded_tokens", "block_size", "table_layout",
               "table_last_column")


def step5_knobs(p: Profile, kv_cache_dtypes: tuple[str, ...] = ("bfloat16", "fp8")) -> dict[str, tuple[str, ...]]:
    kv = tuple(k for k in ("bfloat16", "fp8", "fp8_calibrated") if k.removesuffix("_calibrated") in kv_cache_dtypes)
    return _domains(STEP5_KNOBS, step5_topk=map(str, p.step5.topks), block_size=map(str, p.step5.block_sizes),
                    table_layout=("arange", "permuted"), step5_kv=kv)


def step5_space(p: Profile, kv_cache_dtypes: tuple[str, ...] = ("bfloat16", "fp8")) -> CaseSpace:
    knobs = step5_knobs(p, kv_cache_dtypes)
    return CaseSpace(lambda swarm: step5_cases(p, knobs, swarm), knobs)


@st.composite
def step5_cases(draw, p: Profile, knobs: dict[str, tuple[str, ...]], swarm: Swarm | None = None) -> Case:
    s, swarm = p.step5, swarm or Swarm()

    def c(name: str) -> str:
        return category(draw, swarm, name, knobs[name])

    groups, per_group = int(c("step5_groups")), int(c("step5_heads"))
    topk, bs, kv = int(c("step5_topk")), int(c("block_size")), c("step5_kv")
    if kv != "bfloat16" and bs * groups < 32:  # an fp8 page too small for the tail ring's 7 rows: vLLM refuses it
        bs = 32
    many = c("step5_batch") == "many"
    steps = draw(st.integers(2, 2 if many else s.max_steps)) if c("step5_steps") == "several" else 1
    max_regions = min(s.max_context, MANY_MAX_CONTEXT) // 8 if many else s.max_context // 8
    lo, hi = {"short": (0, min(topk - 1, max_regions)), "edge": (max(topk - 1, 0), min(topk + 1, max_regions)),
              "long": (min(topk + 2, max_regions), max_regions)}[c("step5_context")]
    edge = c("step5_region_edge")
    reqs = []
    # more (token, group) rows than 128 take sparse_decode_attention's single split (sparse_decode_splits)
    count = draw(st.integers(-(-129 // groups), 136 // groups)) if many else draw(st.integers(1, s.max_decodes))
    for i in range(count):
        closed = draw(st.integers(lo, max(lo, hi)))  # closed regions before the last token's own
        offset = {"closes": 7, "opens": 0, "any": draw(st.integers(0, 7))}[edge if i == 0 else "any"]
        position = max(closed * 8 + offset, steps - 1)  # the last token's; each earlier step one token before
        reqs.append(Request(1, position))
    spare = c("table_last_column") == "spare"
    needed = [-(-r.seq_len // bs) for r in reqs]
    width = max(needed) + (1 if spare else 0)
    total = sum(needed)
    ids = list(range(1, total + 1))
    if c("table_layout") == "permuted" and total > 1:
        ids = [i + 1 for i in draw(st.permutations(range(total)))]
    table, k = [], 0
    for n in needed:
        table.append(tuple(ids[k:k + n]) + (0,) * (width - n))
        k += n
    return Case(
        requests=tuple(reqs), num_decodes=len(reqs), block_size=bs, block_table=tuple(table), topk_width=128, topk=(),
        heads=groups * per_group, kv_cache_dtype=kv.removesuffix("_calibrated"),
        fp8_scale="arbitrary" if kv == "fp8_calibrated" else "pow2", seed=draw(st.integers(0, 2**16)),
        padded_tokens=draw(st.integers(1, 4)) if c("padded_tokens") == "some" else 0,
        step5=Step5(groups=groups, index_heads=int(c("step5_index_heads")), region_topk=topk, steps=steps,
                    defer_inactive_clear=c("step5_defer_clear") == "on", regions=c("step5_regions")),
    ).validate()
