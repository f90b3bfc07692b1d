"""The `vllm.dsv32.attention.shardq` target on CPU (vLLM 0.34+): DeepSeek-V3.2's attention module under TP with ShardQ,
every TP rank emulated in one process (the indexer scoring the rank's token shard, shard_q / unshard_out over the
emulated TP group, the split tokens attended with every head), judged as the undivided module; its cases, and the
ShardQ split's decode offset dropped (a mutant) found through the CLI."""

import functools

import pytest

from strategies.case import Case, Dcp, IndexerStep, Request
from tests.fuzzer.targets.judged import assert_reached, first_finding, run_judged

pytestmark = pytest.mark.vllm


@functools.cache
def target():
    from fuzzer.targets.dsv32_attention_shardq import Dsv32AttentionShardQ

    t = Dsv32AttentionShardQ("cpu")
    if t.unavailable():
        pytest.skip(t.unavailable())
    t.prepare()
    return t


def step(requests, num_decodes, table, tp, attention_heads=16, width=512, min_tokens=1, skip=False, mtp=0):
    return Case(requests=tuple(requests), num_decodes=num_decodes, block_size=64, block_table=tuple(table),
                topk_width=width, topk=(), heads=32, seed=7, kv_cache_dtype="fp8_ds_mla", dcp=Dcp(1, 0, 1, 1, tp),
                indexer=IndexerStep(num_speculative_tokens=mtp, attention_heads=attention_heads, skip_topk_layer=skip,
                                    shardq_min_tokens=min_tokens)).validate()


CASES = {
    # a decode, then a prompt past the top-k split over 2 ranks: the split's top-k rows start past the decode's
    "after_decodes": (step([Request(1, 600), Request(8, 600)], 1, [tuple(range(1, 11)), tuple(range(11, 21))], 2),
                      {"shardq.split", "shardq.split.after_decodes", "fp8.mixed_batch"}),
    # prompts only, 4 ranks of 8 heads, MTP's decode threshold, a skip_topk layer reusing the split rows
    "prefills_tp4": (step([Request(16, 520), Request(6, 100)], 0, [tuple(range(1, 11)), (11, 12, 0, 0, 0, 0, 0, 0, 0, 0)],
                          4, attention_heads=8, skip=True, mtp=1),
                     {"shardq.split", "dsv32.layer.skip_topk"}),
    # every prompt within the top-k: no split, the heads-split TP path (short prefills on dense MHA)
    "no_split": (step([Request(1, 100), Request(4, 50)], 1, [(1, 2), (3, 4)], 2), {"shardq.none"}),
}


@pytest.mark.parametrize("name", CASES)
def test_a_step_on_every_tp_rank_is_judged_as_the_undivided_module(name):
    case, paths = CASES[name]
    obs, verdicts = run_judged(target(), case)
    assert_reached(obs, paths)
    assert {"topk", "output"} <= {v.check for v in verdicts} and not obs.memory
    assert obs.outputs["out"].shape == (case.num_tokens, case.indexer.attention_heads * case.dcp.tp * 128)
    assert obs.outputs["topk_by_tp"].shape[0] == case.dcp.tp


def test_cases_are_configurations_vllm_runs_shardq_on():
    from hypothesis import HealthCheck, given, settings

    from strategies.indexer_batches import attention_module_shardq_space
    from strategies.profiles import PROFILES

    p = PROFILES["cpu"]
    seen = set()

    @settings(max_examples=40, database=None, suppress_health_check=list(HealthCheck), deadline=None, derandomize=True)
    @given(attention_module_shardq_space(p, p.attn_heads).strategy())
    def check(case):
        h, tp = case.indexer.attention_heads, case.dcp.tp
        seen.add(tp)
        assert h < 32 and h * tp <= 128 and case.kv_cache_dtype == "fp8_ds_mla" and case.cudagraph == "none"
        assert case.dcp.size == 1 and case.dcp.layout == f"tp{tp}"
        assert 1 <= case.indexer.shardq_min_tokens <= max(1, case.num_tokens - case.num_decode_tokens)

    check()
    assert seen == {2, 4}


def test_split_tokens_reading_their_requests_without_the_decode_offset_are_found(tmp_path):
    target()  # skips where the release has no ShardQ
    finding = first_finding(tmp_path, "vllm.dsv32.attention.shardq", "--inject", "shardq-req-id-decode-offset-dropped",
                            "--max-examples", "20", "--seed", "3", "--no-shrink")
    assert finding["bug_classes"] and set(finding["bug_classes"]) <= {"G", "I"}, finding
