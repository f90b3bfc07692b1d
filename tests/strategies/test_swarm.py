"""Swarms: a pinned knob shows in the cases drawn under it; without a swarm the strategies draw as before."""

import random

import pytest
from hypothesis import HealthCheck, given, settings

from strategies.batches import AttentionFeatures, IndexFeatures, attention_space, index_space
from strategies.case import Case, IndexCall, Request, TopkSpec
from strategies.profiles import PROFILES
from strategies.swarm import (
    CALL_MODES,
    KNOBS,
    REQUIRES,
    Swarm,
    call_mode_partners,
    call_mode_pins,
    call_modes,
    category_share,
    coherent,
)
from tests.strategies import drawn

P = PROFILES["cpu"]
SPACES = {
    "index": index_space(P, IndexFeatures(dcp=True, block_stride_rows=True, idx_mapping=True)),
    "attention": attention_space(P, AttentionFeatures(kv_cache_dtypes=("bfloat16", "fp8_ds_mla"), dcp=True,
                                                      cudagraph_padding=True)),
}


def draw_cases(space, swarm, n=25):
    return drawn.draw_cases(space, swarm, n, 7)


# Categories the CPU profile's budget cannot always make (a 12-token attention step cannot hold a prefill of
# topk tokens without context), that a per-request knob takes only in some requests, or that vLLM's rules limit.
LOOSE = {"prefill_len", "table_last_column", "block_edge", "topk_valid", "invalid_at", "past_table", "past_seq",
         "prefills", "dcp_rank", "table_layout", "idx_mapping", "padding_rows", "decode_context",
         "decode_query_len",  # MTP decodes under DCP only with interleave 1, as vLLM allows
         "prefill_context"}  # a prefill past topk tokens in a 12-token step holds context even when pinned to none


@pytest.mark.parametrize("kind", SPACES)
def test_a_pinned_category_shows_in_the_cases(kind):
    space = SPACES[kind]
    for name, value, features in drawn.pinned_features(space, lambda swarm: draw_cases(space, swarm, 12),
                                                       P.max_context):
        # where the knob applies (a prefill's length, in a case whose token budget left room for a prefill)
        share = drawn.share(value, [f[name] for f in features if name in f])
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


def _index_case(width=256, **kw):
    reqs = (Request(1, 70), Request(5, 30))
    return Case(requests=reqs, num_decodes=1, block_size=64, block_table=((1, 2), (3, 0)), topk_width=width,
                topk=(TopkSpec(40), TopkSpec(20)), **kw).validate()


def test_call_modes_are_read_from_the_case():
    assert call_modes(_index_case()) == {"plain"}
    assert call_modes(_index_case(call=IndexCall(valid_counts=True))) == {"valid_counts"}
    assert call_modes(_index_case(2176, call=IndexCall(valid_counts=True))) == {"valid_counts"}  # one tile
    assert call_modes(_index_case(4224, call=IndexCall(valid_counts=True))) == {"compaction"}  # tiled
    assert call_modes(_index_case(4224)) == {"plain"}  # tiled, but no counting: nothing to compact
    both = _index_case(call=IndexCall(prefill_workspace=True), block_stride_rows=128, idx_mapping=(1, 0))
    assert call_modes(both) == {"prefill_workspace", "block_stride", "idx_mapping"}
    assert call_modes(_index_case(block_stride_rows=64)) == {"plain"}  # a stride of one block is packed


def test_a_category_s_share_includes_what_it_requires():
    knobs = SPACES["index"].knobs
    assert category_share("block_size", "16", knobs) == 1 / len(knobs["block_size"])
    # the full-batch req_id_per_token: the decode rows passed (which needs decodes) and prefills
    assert abs(category_share("req_id_rows", "full_batch", knobs) - 1 / 2 * (1 / 2 * 1 / 2) * (2 / 3)) < 1e-9


@pytest.mark.parametrize("mode", CALL_MODES)
def test_a_call_mode_s_pins_put_the_cases_in_it(mode):
    space = SPACES["index"]
    pins = call_mode_pins(mode, space.knobs)
    assert pins is not None and not {k for k, _ in call_mode_partners(mode, space.knobs)} & set(pins)
    swarm = coherent(pins, space.knobs, random.Random(0), keep=set(pins))
    assert all(swarm.pinned(k) == v for k, v in pins.items())
    cases = draw_cases(space, swarm, 12)
    share = sum(mode in call_modes(c) for c in cases) / len(cases)
    assert share >= (0.5 if mode == "valid_counts" else 0.9), (mode, share)  # a third of valid counts are tiled
    assert call_mode_pins("prefill_workspace", SPACES["attention"].knobs) is None  # not a knob there
