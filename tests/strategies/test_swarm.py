"""Swarms: a pinned knob shows in the cases drawn under it; without a swarm the strategies draw as before."""

import random

import pytest
from hypothesis import HealthCheck, given, seed, settings

from strategies.batches import AttentionFeatures, IndexFeatures, attention_space, index_space
from strategies.profiles import PROFILES
from strategies.swarm import KNOBS, REQUIRES, Swarm, case_features, coherent

P = PROFILES["cpu"]
SPACES = {
    "index": index_space(P, IndexFeatures(dcp=True, block_stride_rows=True, idx_mapping=True)),
    "attention": attention_space(P, AttentionFeatures(kv_cache_dtypes=("bfloat16", "fp8_ds_mla"), dcp=True,
                                                      cudagraph_padding=True)),
}


def draw_cases(space, swarm, n=25):
    cases = []

    @seed(7)
    @settings(max_examples=n, database=None, suppress_health_check=list(HealthCheck), deadline=None)
    @given(space.strategy(swarm))
    def collect(case):
        cases.append(case)

    collect()
    return cases


# Categories the CPU profile's budget cannot always make (a 12-token attention step cannot hold a prefill of
# topk tokens without context), that a per-request knob takes only in some requests, or that vLLM's rules limit.
LOOSE = {"prefill_len", "table_last_column", "block_edge", "topk_valid", "invalid_at", "past_table", "past_seq",
         "prefills", "dcp_rank", "table_layout", "idx_mapping", "padding_rows", "decode_context",
         "decode_query_len",  # MTP decodes under DCP only with interleave 1, as vLLM allows
         "prefill_context"}  # a prefill past topk tokens in a 12-token step holds context even when pinned to none


@pytest.mark.parametrize("kind", SPACES)
def test_a_pinned_category_shows_in_the_cases(kind):
    space = SPACES[kind]
    for name, values in space.knobs.items():
        for value in values:
            swarm = coherent({name: value}, space.knobs, random.Random(0), keep={name})
            if swarm.pinned(name) != value:
                continue  # its requirement cannot hold in this space
            cases = draw_cases(space, swarm, 12)
            # where the knob applies (a prefill's length, in a case whose token budget left room for a prefill)
            seen = [f[name] for f in (case_features(c, space.knobs, P.max_context) for c in cases) if name in f]
            share = sum(value in s for s in seen) / max(1, len(seen))
            # a permuted table of one or two blocks often comes out in order, and reads as arange
            floor = 0.1 if name == "table_layout" else 0.3 if name in LOOSE else 0.9
            assert share >= floor, (kind, name, value, share)


def test_requirements_are_pinned_with_the_knob_or_the_knob_is_dropped():
    knobs = SPACES["index"].knobs
    s = coherent({"req_id_rows": "full_batch"}, knobs, random.Random(0), keep={"req_id_rows"})
    assert s.pinned("token_rows") == "decodes" and s.pinned("decodes") == "some"
    s = coherent({"decode_query_len": "mtp", "decodes": "none"}, knobs, random.Random(0))
    assert s.pinned("decode_query_len") is None and s.pinned("decodes") == "none"
    s = coherent({"decode_query_len": "mtp", "decodes": "none"}, knobs, random.Random(0), keep={"decode_query_len"})
    assert s.pinned("decode_query_len") == "mtp" and s.pinned("decodes") == "some"
    assert all(k[0] in KNOBS and all(n in KNOBS for n, _ in needs) for k, needs in REQUIRES.items())


def test_an_unknown_knob_is_refused():
    with pytest.raises(ValueError, match="unknown knob 'nope'"):
        Swarm((("nope", "x"),))


@given(SPACES["attention"].strategy(Swarm((("kv_cache_dtype", "fp8_ds_mla"), ("fp8_scale", "arbitrary")))))
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
def test_swarm_cases_are_valid_cases(case):
    assert case.validate() is case and case.kv_cache_dtype == "fp8_ds_mla" and case.fp8_scale == "arbitrary"
