"""The `vllm.dsv32.attention.pcp_dcp` target on CPU: DeepSeek-V3.2's attention module with its real indexer under
PCP x DCP (and PCP alone), every rank of the PCP x TP world emulated in one process and fed by vLLM's PCPManager,
judged as the undivided module (oracles/dsv32.py `judge_dsv32_dcp`) on a few fixed steps."""

import functools
import json

import pytest

from strategies.case import Case, Dcp, IndexerStep, Request
from tests.conftest import attnfuzz

pytestmark = pytest.mark.vllm


@functools.cache
def target():
    from fuzzer.targets.dsv32_attention_pcp import Dsv32AttentionPcp

    t = Dsv32AttentionPcp("cpu")
    if t.unavailable():
        pytest.skip(t.unavailable())
    t.prepare()
    return t


def step(requests, num_decodes, table, dcp, attention_heads=8, width=512, earlier=(), skip=False, seed=5):
    return Case(requests=tuple(requests), num_decodes=num_decodes, block_size=64, block_table=tuple(table),
                topk_width=width, topk=(), heads=32, seed=seed, kv_cache_dtype="fp8_ds_mla", cudagraph="none",
                earlier=tuple(earlier), dcp=dcp,
                indexer=IndexerStep(attention_heads=attention_heads, skip_topk_layer=skip)).validate()


PCP_PATHS = {"pcp.cache_inputs_gather", "pcp.finalize_decode", "dsv32.layer.indexer", "indexer.prefill"}
CASES = {
    # pcp2.dcp2: a decode past the top-k and an extend too short to split (whole on each PCP rank)
    "decode_and_whole_extend": (step([Request(1, 700), Request(9, 600)], 1, [tuple(range(1, 7)), tuple(range(7, 12)) + (0,)],
                                     Dcp(2, 0, 1, 2, 1)), PCP_PATHS | {"indexer.dcp_merge", "indexer.decode"}),
    # pcp2.dcp2: a prefill split over the PCP ranks in head-tail chunks, interleave 4, a skip_topk layer
    "split_prefill_skip_topk": (step([Request(40, 300)], 0, [(1, 2, 3, 0)], Dcp(2, 0, 4, 2, 1), skip=True),
                                PCP_PATHS | {"pcp_dcp.kv_gather", "dsv32.layer.skip_topk"}),
    # pcp2.dcp2.tp2: four ranks, the heads split over TP
    "tp2": (step([Request(1, 520), Request(12, 0)], 1, [(1, 2, 3, 4, 5), (6, 0, 0, 0, 0)], Dcp(2, 0, 1, 2, 2)),
            PCP_PATHS | {"indexer.decode"}),
    # pcp2 (no DCP): two decodes sharded over the PCP ranks (one each), a short prefill split and on dense MHA
    "pcp_only_sharded_decodes": (step([Request(1, 700), Request(1, 300), Request(40, 0)], 2,
                                      [tuple(range(1, 12)), tuple(range(12, 17)) + (0,) * 6, (17,) + (0,) * 10],
                                      Dcp(1, 0, 1, 2, 1)),
                                 {"pcp.cache_inputs_gather", "indexer.decode", "mha.dense", "mha.chunked_context"}),
    # pcp4.tp1 (no DCP): one decode on PCP rank 0, the other ranks with no rows (the manager's empty segment)
    "pcp_only_idle_ranks": (step([Request(1, 200)], 1, [(1, 2, 3, 4)], Dcp(1, 0, 1, 4, 1), skip=True),
                            {"pcp.cache_inputs_gather", "indexer.decode", "dsv32.layer.skip_topk"}),
}


@pytest.mark.parametrize("name", CASES)
def test_a_step_on_every_rank_is_judged_as_the_undivided_module(name):
    case, paths = CASES[name]
    t = target()
    obs = t.run(case)
    verdicts = t.oracle(case, obs)
    assert obs.error is None and all(v.ok for v in verdicts), (case.summary(), obs.error, verdicts)
    assert paths <= set(obs.notes["paths"]), sorted(obs.notes["paths"])
    assert {"topk", "cache_write", "output"} <= {v.check for v in verdicts}
    assert not len(obs.outputs["dcp_topk_rows_differ"]) and not obs.memory
    heads = case.indexer.attention_heads * case.dcp.tp  # every TP rank's heads, side by side
    assert obs.outputs["out"].shape == (case.num_tokens, heads * 128)
    assert ("out_skip_topk" in obs.outputs) == case.indexer.skip_topk_layer
    assert obs.notes["pcp_paths"]["decode_sharded"] == (case.dcp.size == 1 and case.num_decodes > 0)
    assert obs.notes["route"]["mha_tokens"] == int(obs.outputs["mha_rows"].sum())
    if case.dcp.size > 1:  # vLLM's builder keeps prefills off dense MHA under PCP + DCP
        assert not obs.outputs["mha_rows"].any()


def test_tp_ranks_may_choose_among_tied_scores_each_their_own_way():
    """Under PCP + DCP every TP rank runs a prefill token's top-k itself, over the whole gathered context, and the
    top-k kernels take tied scores in atomics' arrival order (the stand-in: an order drawn afresh each call). TP peers
    of one PCP rank sit in different DCP groups (DCP spans PCP first), so rows they pick differently are no DCP
    disagreement: each rank's heads are judged with the rows that rank picked (an H100 gate once took them for one)."""
    import dataclasses

    import itertools

    from fuzzer.support.standins import indexer_ops

    case = dataclasses.replace(step([Request(24, 560)], 0, [tuple(range(1, 10)) + (0,)], Dcp(2, 0, 4, 2, 2)),
                               values="zero_tiles").validate()  # zero key tiles: many index scores exactly 0
    t = target()
    indexer_ops._SELECT_CALLS = itertools.count()  # the stand-in's tie orders as in a fresh process, whatever ran before
    obs = t.run(case)
    verdicts = t.oracle(case, obs)
    assert obs.error is None and all(v.ok for v in verdicts), [v for v in verdicts if not v.ok]
    by_tp = obs.outputs["topk_by_tp"][:, :case.num_tokens].sort(dim=2).values
    assert bool((by_tp[0] != by_tp[1]).any()), "no tied row chosen differently: the case no longer tests this"
    assert not len(obs.outputs["dcp_topk_rows_differ"])
    # a TP peer's rows are judged as a top-k too
    row = int((by_tp[0] != by_tp[1]).any(dim=1).nonzero()[0])
    obs.outputs["topk_by_tp"][1, row, :8] = -1
    bad = [v for v in t.oracle(case, obs) if not v.ok]
    assert [v.where for v in bad if v.check == "topk"] == ["tp1.topk"], bad


def test_decodes_are_sharded_over_pcp_ranks_without_dcp_only():
    """The runner's PCPManager shards decodes (one owner each) exactly where ParallelConfig says: PCP without DCP."""
    from fuzzer.support import pcp_runtime

    batch = pcp_runtime.global_batch([1, 1, 1], [10, 20, 30], [False, False, False], "cpu")
    for dcp, owners in ((1, [[0, 2], [1]]), (2, [[0, 1, 2], [0, 1, 2]])):
        seen = []
        for p in range(2):
            manager, local = pcp_runtime.rank_batch(batch, 2, p, dcp, 0, 1, "cpu")
            seen.append(manager._local_gather_idx[:local.num_tokens].tolist())
            assert (local.dcp_local_seq_lens is not None) == (dcp > 1)  # set after the partition, as the runner does
        assert seen == owners, (dcp, seen)


@pytest.mark.nightly
def test_indexer_keys_left_rank_major_are_found(tmp_path):
    """pcp-dcp-indexer-gather-rank-major (the gathered index-key shards not de-interleaved) through the CLI."""
    run = attnfuzz("run", "--target", "vllm.dsv32.attention.pcp_dcp", "--max-examples", "60", "--max-findings", "1",
                   "--no-shrink", "--seed", "1", "--inject", "pcp-dcp-indexer-gather-rank-major",
                   "--json", str(tmp_path / "run.json"), state=tmp_path / "state")
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    finding = json.loads((tmp_path / "run.json").read_text())["findings"][0]
    assert "O" in finding["bug_classes"], finding


def test_cases_are_pcp_layouts_vllm_runs_eagerly():
    from hypothesis import HealthCheck, given, settings

    from strategies.batches import PCP_LAYOUTS, PCP_ONLY_LAYOUTS, _pcp_layout_fits
    from strategies.indexer_batches import attention_module_pcp_space
    from strategies.profiles import PROFILES

    p = PROFILES["cpu"]
    seen = set()

    @settings(max_examples=40, database=None, suppress_health_check=list(HealthCheck), deadline=None, derandomize=True)
    @given(attention_module_pcp_space(p, p.attn_heads, combine_rows=768).strategy())
    def check(case):
        d, h = case.dcp, case.indexer.attention_heads
        name = next(n for n, lay in {**PCP_LAYOUTS, **PCP_ONLY_LAYOUTS}.items() if lay == (d.pcp, d.size, d.tp))
        seen.add(name)
        assert _pcp_layout_fits(name, h) and case.kv_cache_dtype == "fp8_ds_mla" and case.dcp.layout == name
        assert d.interleave == 1 or (case.indexer.num_speculative_tokens == 0 and d.size > 1)
        assert all(s.cudagraph == "none" and not s.padded_tokens for s in case.steps)
        assert all(r.query_len for s in case.steps for r in s.requests)  # no padding rows: they come with a graph's

    check()
    assert len(seen & set(PCP_LAYOUTS)) >= 2 and seen & set(PCP_ONLY_LAYOUTS), seen
