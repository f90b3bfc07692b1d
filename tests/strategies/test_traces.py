"""Traces: the steps one engine ran before a case (strategies.traces), as plain data and as tensors."""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings

from strategies.batches import AttentionFeatures, attention_space
from strategies.case import ENGINE_FIELDS, Case, CaseError, Request, TopkSpec
from strategies.profiles import PROFILES
from strategies.swarm import Swarm, case_features
from strategies.tensors import materialize_attention_inputs, written_slots

SPACE = attention_space(PROFILES["cpu"], AttentionFeatures(kv_cache_dtypes=("bfloat16", "fp8_ds_mla"), traces=True))
FAST = settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck),
                phases=[Phase.generate])


def _step(reqs, table, seed, num_decodes=0):
    return Case(requests=tuple(reqs), num_decodes=num_decodes, block_size=16, block_table=table, topk_width=128,
                topk=tuple(TopkSpec(valid=128) for _ in reqs), seed=seed)


# A request decoding for two steps: step 1 computes positions 0..19 (its first step: the harness writes them
# all), step 2 decodes position 20, the last step position 21; a second request arrives in the last step with a
# prefix-cache hit on block 3 (written before the trace).
FIRST = _step([Request(4, 16)], ((1, 2),), seed=11)
SECOND = _step([Request(1, 20)], ((1, 2),), seed=12, num_decodes=1)
TRACE = dataclasses.replace(_step([Request(1, 21), Request(2, 16)], ((1, 2), (3, 4)), seed=13, num_decodes=1),
                            earlier=(FIRST, SECOND))


def test_each_step_writes_its_new_tokens_and_context_no_step_wrote():
    first, second, last = TRACE.steps
    assert written_slots(first).tolist() == list(range(16, 36))  # a first step: every slot its requests hold
    assert written_slots(second).tolist() == [16 + 20]  # then only the new token
    # The last: its decode token, and the arriving request's cached prefix (block 3) and new tokens (block 4).
    assert written_slots(last).tolist() == [16 + 21, *range(48, 64), 64, 65]
    assert [s.earlier for s in TRACE.steps] == [(), (FIRST,), (FIRST, SECOND)]


def test_a_step_reads_what_the_step_that_last_wrote_a_slot_wrote():
    last = materialize_attention_inputs(TRACE)
    for step, slots in ((FIRST, range(16, 36)), (SECOND, [36]), (dataclasses.replace(TRACE, earlier=()), [37, 48, 64])):
        own = materialize_attention_inputs(dataclasses.replace(step, earlier=()))
        for s in slots:
            assert torch.equal(last.kv_c[s], own.kv_c[s]), (step.seed, s)


@FAST
@given(SPACE.strategy(None))
def test_drawn_traces_are_valid_cases_of_one_engine(case):
    assert Case.from_json(case.to_json()) == case
    for step in case.earlier:
        assert all(getattr(step, f) == getattr(case, f) for f in ENGINE_FIELDS)
        assert not step.earlier
        assert step.num_tokens <= PROFILES["cpu"].for_attention().max_tokens  # the profile's step size
    # Every context slot a step reads was written by it or by an earlier step.
    done = set()
    for step in case.steps:
        done |= set(written_slots(step).tolist())
        inp = materialize_attention_inputs(dataclasses.replace(step, earlier=()))
        for r, req in enumerate(step.requests):
            assert set(inp.slot_of[r][: req.context_len].tolist()) <= done


@FAST
@given(SPACE.strategy(Swarm((("trace", "long"),))))
def test_a_swarm_pins_the_trace_length(case):
    assert 2 <= len(case.earlier) <= 3
    assert case_features(case, SPACE.knobs, 1024)["trace"] == {"long"}


def test_single_steps_only_when_the_profile_allows_one():
    space = attention_space(dataclasses.replace(PROFILES["cpu"], max_steps=1),
                            AttentionFeatures(kv_cache_dtypes=("bfloat16",), traces=True))
    assert "trace" not in space.knobs

    @FAST
    @given(space.strategy(None))
    def single(case):
        assert not case.earlier

    single()


@pytest.mark.parametrize("field, value", [("heads", 32), ("block_size", 32), ("kv_cache_dtype", "fp8_ds_mla")])
def test_an_earlier_step_of_another_engine_is_refused_by_name(field, value):
    bad = dataclasses.replace(TRACE, earlier=(dataclasses.replace(FIRST, **{field: value}),))
    with pytest.raises(CaseError, match=rf"case.earlier\[0\].{field}: one engine"):
        bad.validate()
    with pytest.raises(CaseError, match=r"case.earlier\[0\].requests\[0\].query_len"):
        Case.from_dict({**TRACE.to_dict(), "earlier": [{**FIRST.to_dict(), "requests": [{"query_len": -1, "context_len": 0}]}]})


# -- MTP draft steps -------------------------------------------------------------------------------------------

DRAFT_SPACE = attention_space(PROFILES["cpu"], AttentionFeatures(kv_cache_dtypes=("bfloat16",), traces=True,
                                                                 mtp_draft=True))


@FAST
@given(DRAFT_SPACE.strategy(Swarm((("mtp_draft", "on"), ("trace", "long")))))
def test_a_draft_step_holds_the_step_before_s_requests_one_token_on(case):
    """Pinned on, the two steps before the case are the draft model's: a first draft step and one on its
    metadata (Case.mtp_draft), each a decode of one token per request in the case's own block-table rows."""
    assert Case.from_json(case.to_json()) == case
    drafts = [k for k, s in enumerate(case.steps) if s.mtp_draft]
    if not drafts:  # no request of the case has 3 cached tokens: nothing could have drafted before it
        assert all(r.context_len < 3 or not r.query_len for r in case.requests)
        return
    assert drafts == [len(case.steps) - 2] and case_features(case, DRAFT_SPACE.knobs, 1)["mtp_draft"] == {"on"}
    base, draft = case.steps[-3], case.steps[-2]
    assert [r.query_len for r in draft.requests] == [1] * len(draft.requests) and base.block_table == draft.block_table
    assert [r.context_len for r in draft.requests] == [r.context_len + 1 for r in base.requests]


def test_a_draft_step_that_does_not_follow_its_step_before_names_the_field():
    base = _step([Request(1, 20), Request(1, 5)], ((1, 2), (3, 4)), seed=1, num_decodes=2)
    draft = dataclasses.replace(base, requests=(Request(1, 21), Request(1, 6)), mtp_draft=True)
    dataclasses.replace(draft, earlier=(base,)).validate()  # one token on, same rows: a draft step
    with pytest.raises(CaseError, match="mtp_draft"):
        dataclasses.replace(draft, requests=(Request(1, 22), Request(1, 6)), earlier=(base,)).validate()
    with pytest.raises(CaseError, match="mtp_draft"):  # a single step has no step before it
        draft.validate()
