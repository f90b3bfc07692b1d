"""The `vllm.dsv32.attention.dcp` target on CPU: DeepSeek-V3.2's attention module under DCP alone, every rank emulated
in one process (each rank's indexer scoring its shard and merging the global top-k, its layer gathering the query
heads, attending over its shard and merging by LSE), judged as the undivided module (oracles/dsv32.py
`judge_dsv32_dcp`); its cases, a short clean campaign and PR 50005's attention half reverted found through the CLI."""

import dataclasses
import functools

import pytest
import torch

from strategies.case import Case, Dcp, IndexerStep, Request
from tests.fuzzer.targets.judged import assert_reached, clean_campaign, first_finding, run_judged

pytestmark = pytest.mark.vllm


@functools.cache
def target():
    from fuzzer.targets.dsv32_attention_dcp import Dsv32AttentionDcp

    t = Dsv32AttentionDcp("cpu")
    if t.unavailable():
        pytest.skip(t.unavailable())
    t.prepare()
    return t


def step(requests, num_decodes, table, dcp, attention_heads=8, width=512, mtp=0, pad=0, earlier=(), skip=False, seed=5):
    return Case(requests=tuple(requests), num_decodes=num_decodes, block_size=64, block_table=tuple(table),
                topk_width=width, topk=(), heads=32, seed=seed, padded_tokens=pad, kv_cache_dtype="fp8_ds_mla",
                cudagraph="full" if pad else "none", earlier=tuple(earlier), dcp=dcp,
                indexer=IndexerStep(num_speculative_tokens=mtp, attention_heads=attention_heads,
                                    skip_topk_layer=skip)).validate()


DCP_PATHS = {"indexer.dcp_merge", "dcp.query_gather", "dcp.combine", "dcp.filter", "fp8.mixed_batch"}
CASES = {
    # decodes past the top-k on 2 ranks (a virtual block: 128 tokens): local top-k, global merge, gather, combine
    "decodes": (step([Request(1, 700), Request(1, 300)], 2, [tuple(range(1, 7)), (7, 8, 9, 0, 0, 0)], Dcp(2)),
                DCP_PATHS | {"indexer.decode", "mqa"}),
    # MTP decodes (native next_n 2), an extend and a fresh prefill past the top-k, a skip_topk layer: all on MQA
    "mtp_mixed": (step([Request(2, 700), Request(2, 530), Request(6, 600), Request(9, 0)], 2,
                       [tuple(range(1, 7)), tuple(range(7, 12)) + (0,), tuple(range(12, 17)) + (0,), (17,) + (0,) * 5],
                       Dcp(2), mtp=1, skip=True),
                  DCP_PATHS | {"indexer.decode.native_mtp", "indexer.prefill", "dsv32.layer.skip_topk"}),
    # a decode and an extend within the top-k on 4 ranks, interleave 2: the extend on dense MHA, its cached context
    # gathered over the ranks
    "dense_mha": (step([Request(1, 40), Request(9, 30)], 1, [(1,), (2,)], Dcp(4, 0, 2), attention_heads=16),
                  {"mha.dense", "mha.chunked_context.dcp", "indexer.dcp_merge", "dcp.combine"}),
    # 8 ranks, interleave 16, a full graph's padded decode batch: padding rows finite
    "graph_padded": (step([Request(1, 1200), Request(1, 80), Request(0, 0), Request(0, 0)], 4,
                          [(1, 2, 3), (4, 0, 0), (0, 0, 0), (0, 0, 0)], Dcp(8, 0, 16), pad=2),
                     DCP_PATHS | {"batch.padding_rows"}),
}


@pytest.mark.parametrize("name", CASES)
def test_a_step_on_every_rank_is_judged_as_the_undivided_module(name):
    case, paths = CASES[name]
    obs, verdicts = run_judged(target(), case)
    assert_reached(obs, paths)
    assert {"topk", "cache_write", "output"} <= {v.check for v in verdicts}
    assert not len(obs.outputs["dcp_topk_rows_differ"]) and not obs.memory
    heads = case.indexer.attention_heads * case.dcp.size  # every rank's heads, side by side
    assert obs.outputs["out"].shape == (case.num_tokens, heads * 128)
    assert ("out_skip_topk" in obs.outputs) == case.indexer.skip_topk_layer


def test_a_trace_keeps_every_ranks_engine():
    table = [(1, 2, 3, 4, 5, 6), (7, 8, 9, 0, 0, 0)]
    first = step([Request(20, 0), Request(30, 300)], 0, table, Dcp(2, 0, 4))
    case = step([Request(1, 20), Request(1, 330)], 2, table, Dcp(2, 0, 4), earlier=[first])
    obs, _ = run_judged(target(), case)
    assert len(obs.steps) == 1


def test_ranks_that_disagree_or_merge_wrong_are_class_g():
    case, _ = CASES["decodes"]
    t = target()
    obs = t.run(case)
    obs.outputs["dcp_topk_rows_differ"] = torch.tensor([1])
    out = obs.outputs["out"].clone()
    out[:, 8 * 128:] = 0  # rank 1's heads
    obs.outputs["out"] = out
    bad = {v.check: v for v in t.oracle(case, obs) if not v.ok}
    assert {c: v.bug_class for c, v in bad.items()} == {"dcp_topk": "G", "output": "G"}, bad
    # the other rank's rows judged too: a top-k as well (a tie chosen otherwise), or wrong on their own
    assert "both ranks' rows are a top-k of the same scores" in bad["dcp_topk"].detail, bad["dcp_topk"].detail
    obs.outputs["dcp_topk_other"] = obs.outputs["dcp_topk_other"].clone()
    obs.outputs["dcp_topk_other"][1, :4] = -1
    detail = next(v.detail for v in t.oracle(case, obs) if v.check == "dcp_topk")
    assert "the other rank's rows, judged alone: 1 token rows wrong; first: request 1" in detail, detail


def test_a_request_without_keys_on_a_rank_hands_its_query_to_the_next_where_an_sm_crosses_it():
    """vLLM 0.33.0's DeepGEMM (docs/bug-reports/vllm-0.33.0-deepgemm-sm90-paged-logits-zero-length-request.md; the
    stand-in models the kernel): a one-token request has no keys on rank 1, and when one SM's share of the paged
    logits runs from the request before it to the one after (2 SMs here; 132 need ~40 requests), the one after is
    scored with its query. Named by its own signature; on 132 SMs the same step is clean."""
    table = [tuple(range(1, 13)), (13,) + (0,) * 11, tuple(range(14, 25)) + (0,), tuple(range(25, 33)) + (0,) * 4]
    case = step([Request(1, 1500), Request(1, 0), Request(1, 1400), Request(1, 900)], 4, table, Dcp(2))
    run_judged(target(), case)
    case = dataclasses.replace(case, indexer=dataclasses.replace(case.indexer, num_sms=2)).validate()
    obs = target().run(case)
    failed = [v for v in target().oracle(case, obs) if not v.ok]
    assert [v.signature for v in failed] == ["topk:topk:after_zero_length"], failed
    assert "request 2 (decode)" in failed[0].detail


def test_cases_are_configurations_vllm_runs():
    from hypothesis import HealthCheck, given, settings

    from strategies.indexer_batches import attention_module_dcp_space
    from strategies.profiles import PROFILES

    p = PROFILES["cpu"]
    seen = set()

    @settings(max_examples=40, database=None, suppress_health_check=list(HealthCheck), deadline=None, derandomize=True)
    @given(attention_module_dcp_space(p, p.attn_heads, combine_rows=768).strategy())
    def check(case):
        h, n = case.indexer.attention_heads, case.dcp.size
        seen.add(n)
        assert h < 32 and h * n <= 64 and (128 // h) % n == 0 and case.kv_cache_dtype == "fp8_ds_mla"
        assert case.topk_width in (512, 1024, 2048)
        assert case.dcp.interleave == 1 or case.indexer.num_speculative_tokens == 0
        for s in case.steps:
            assert s.num_tokens <= max(2, 768 // (h * n * n))
            for r, row in zip(s.requests, s.block_table):
                assert len([b for b in row if b]) * 64 * n >= r.seq_len or r.seq_len == 0

    check()
    assert seen == {2, 4, 8}


@pytest.mark.nightly  # 38 s on the CI host; the DCP step tests above stay in CI
def test_a_short_clean_campaign(tmp_path):
    clean_campaign(tmp_path, "vllm.dsv32.attention.dcp", 8, "--seed", "3")


def test_pr_50005_reverted_is_found(tmp_path):
    finding = first_finding(tmp_path, "vllm.dsv32.attention.dcp", "--max-examples", "20", "--max-findings", "1",
                            "--no-shrink", "--seed", "1", "--inject", "dsv32-dcp-no-query-gather-merge")
    assert "G" in finding["bug_classes"], finding
