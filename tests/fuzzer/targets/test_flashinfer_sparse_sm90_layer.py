"""`vllm.flashinfer_sparse_sm90.layer` on CPU: MLAAttention on FLASHINFER_MLA_SPARSE_SM90. Its builder's reorder
threshold (128 query tokens at 16 heads) decides the split, and the builder asks the layer whether prefills leave for
dense MHA to plan FlashInfer for the decode prefix alone: a decode and a 140-token short prefill take forward_mqa and
dense MHA (with chunked context where the prefill has some). The SM90 backend's mutant (a plan made for more tokens
serves a smaller step, class A) is found through the layer, whose decode prefix is such a smaller step. FlashInfer's
wrapper is the stand-in, named in every result."""

import dataclasses
import functools
import json

import pytest

from oracles.verdict import primary
from strategies.case import Request, TopkSpec
from tests.conftest import attnfuzz
from tests.fuzzer.targets.test_flashmla_layer import layer_case

pytestmark = pytest.mark.vllm
STANDIN = "BatchMLAPagedAttentionWrapper (flashinfer.mla: FlashInfer 0.7.2.post1's fa3 planner and SM90 kernel)"


@functools.cache
def target():
    from fuzzer.targets.flashinfer_sparse_sm90_layer import FlashInferMLASparseSM90Layer

    t = FlashInferMLASparseSM90Layer("cpu")
    if t.unavailable():
        pytest.skip(t.unavailable())
    t.prepare()
    return t


DECODE_PLUS_SHORT_PREFILL = ([Request(1, 70), Request(140, 0)], 1)
DECODE_PLUS_CHUNKED_PREFILL = ([Request(1, 70), Request(140, 60)], 1)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8"])
@pytest.mark.parametrize("shape", [DECODE_PLUS_SHORT_PREFILL, DECODE_PLUS_CHUNKED_PREFILL], ids=["fresh", "context"])
def test_a_decode_and_a_short_prefill_take_both_routes_and_pass(kv_cache_dtype, shape):
    t = target()
    case = layer_case(*shape, kv_cache_dtype, topk=256)
    obs = t.run(case)
    verdicts = t.oracle(case, obs)
    assert all(v.ok for v in verdicts), verdicts
    route = obs.notes["route"]
    assert route["mqa_tokens"] == 1 and route["mha_tokens"] == 140
    assert route["chunked_context"] == (shape is DECODE_PLUS_CHUNKED_PREFILL)
    # FlashInfer planned for the decode prefix alone (the layer's own routing decision), clamped on the device
    assert {"mqa", "mha.dense", "kernel.flashinfer_mla", "sm90.plan.clamp_kv_end", "sm90.pack_indices"} <= set(
        obs.notes["paths"])
    assert obs.emulated[0] == STANDIN  # FlashInfer: a stand-in on a CPU, and says so


def test_a_prefill_past_top_k_stays_on_forward_mqa():
    """seq_len > top-k: vLLM keeps the prefill on forward_mqa, and the builder plans every row (each holding
    min(visible, top-k) valid entries, as the indexer fills it: the count the builder plans)."""
    case = layer_case([Request(1, 70), Request(140, 200)], 1, "bfloat16", topk=256)
    case = dataclasses.replace(case, topk=tuple(TopkSpec(256) for _ in case.requests)).validate()
    obs = target().run(case)
    assert all(v.ok for v in target().oracle(case, obs))
    assert obs.notes["route"]["mqa_tokens"] == 141 and obs.notes["route"]["mha_tokens"] == 0


def test_the_sm90_plan_reuse_mutant_is_found_through_the_layer():
    """Two decode steps of 4 tokens, then a decode and a short prefill: the builder plans the decode prefix alone (1
    row), which the mutant serves with the 4-row plan of the step before (vLLM replans on any other token count)."""
    from vllm.v1.attention.backends.mla import flashinfer_mla_sparse_sm90 as sm90

    from fuzzer.mutants import load

    t = target()
    first = layer_case([Request(2, 40), Request(2, 20)], 2, "bfloat16", topk=256)
    second = layer_case([Request(1, 42), Request(140, 0)], 1, "bfloat16", topk=256)
    second = dataclasses.replace(second, block_table=((1, 0, 0), (3, 4, 5)), earlier=(
        dataclasses.replace(first, block_table=((1, 0, 0), (2, 0, 0))),)).validate()
    obs = t.run(second)
    assert all(v.ok for v in t.oracle(second, obs)) and obs.notes["route"]["mha_tokens"] == 140
    original = vars(sm90._SM90State)["plan"]
    try:
        load("sm90-plan-reused-for-fewer-tokens").apply()
        obs = t.run(second)
    finally:
        sm90._SM90State.plan = original  # the rest of the session runs unpatched vLLM
    failed = [v for v in t.oracle(second, obs) if not v.ok]
    assert failed and primary(failed).check == "memory" and "A" in {v.bug_class for v in failed}, failed


def test_a_small_campaign_runs_clean_and_names_the_standin(tmp_path):
    r = attnfuzz("run", "--target", "vllm.flashinfer_sparse_sm90.layer", "--seed", "1", "--max-examples", "6",
                 "--kv-cache-dtype", "bfloat16", "--json", str(tmp_path / "t.json"), "--repros",
                 str(tmp_path / "repros"), state=tmp_path / "state")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((tmp_path / "t.json").read_text())
    assert not summary["findings"]
    assert STANDIN in json.dumps(summary), "FlashInfer's stand-in is named"
