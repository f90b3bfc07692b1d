import json

import pytest
from hypothesis import HealthCheck, given, settings

from strategies.batches import IndexFeatures, index_cases
from strategies.case import Case, CaseError, Dcp, IndexCall, Request, TopkSpec, rank_owned_positions
from strategies.profiles import PROFILES


def small_case(**kw) -> Case:
    base = dict(requests=(Request(1, 10), Request(5, 0)), num_decodes=1, block_size=64,
                block_table=((1,), (2,)), topk_width=128, topk=(TopkSpec(3), TopkSpec(5)))
    base.update(kw)
    return Case(**base).validate()


def test_json_round_trip():
    c = small_case(dcp=Dcp(2, 1, 4), call=IndexCall(True, False, "decodes", "full_batch"), idx_mapping=(1, 0))
    assert Case.from_json(c.to_json()) == c
    assert Case.from_dict(json.loads(c.to_json())) == c


@pytest.mark.parametrize("patch, message", [
    ({"requests": [{"query_len": -1, "context_len": 0}, {"query_len": 1, "context_len": 0}]}, "case.requests[0].query_len"),
    ({"dcp": {"size": 2, "rank": 3, "interleave": 1}}, "case.dcp.rank"),
    ({"dcp": {"size": 4, "rank": 0, "interleave": 1, "pcp": 2, "tp": 4}}, "case.dcp.size"),  # not PCP nor PCP x TP
    ({"dcp": {"size": 2, "rank": 0, "interleave": 1, "pcp": 1, "tp": 2}}, "case.dcp.tp"),
    ({"topk_width": 100}, "case.topk_width"),
    ({"bogus": 1}, "case.bogus: unknown field"),
    ({"topk": [{"valid": "x"}, {"valid": 1}]}, "case.topk[0].valid"),
    ({"topk": [{"valid": 1}, {"valid": 1, "pick": "oldest"}]}, "case.topk[1].pick"),
    ({"block_table": [[1], [2, 3]]}, "case.block_table[1]"),
    ({"kv_cache_dtype": "fp4"}, "case.kv_cache_dtype"),
    ({"num_decodes": 3}, "case.num_decodes"),
    ({"padded_tokens": 1}, "case.padded_tokens"),  # a batch with prefills and no padding rows: no CUDA graph pads it
])
def test_malformed_case_names_the_field(patch, message):
    data = json.loads(small_case().to_json())
    data.update(patch)
    with pytest.raises(CaseError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Case.from_dict(data)


def test_a_pcp_step_round_trips_and_a_dcp_only_one_reads_as_before():
    c = small_case(dcp=Dcp(4, 0, 2, pcp=2, tp=2))
    assert Case.from_json(c.to_json()) == c and c.dcp.layout == "pcp2.dcp4" and c.dcp.tp_ranks == 2
    assert "pcp=2/dcp=4/tp=2/i2" in c.summary()
    assert json.loads(small_case(dcp=Dcp(2, 1, 4)).to_json())["dcp"] == {"size": 2, "rank": 1, "interleave": 4}


def test_not_json():
    with pytest.raises(CaseError, match="not JSON"):
        Case.from_json("{")


def test_rank_owned_positions_partition_the_sequence():
    for seq in range(0, 70):
        for n in (1, 2, 3, 8):
            for inter in (1, 2, 4, 16):
                owned = [rank_owned_positions(seq, n, r, inter) for r in range(n)]
                brute = [sum(1 for t in range(seq) if (t // inter) % n == r) for r in range(n)]
                assert owned == brute


@settings(max_examples=150, deadline=None)
@given(index_cases(PROFILES["cpu"], IndexFeatures(dcp=True, block_stride_rows=True, idx_mapping=True)))
def test_generated_cases_are_valid_and_fit_the_profile(case):
    assert Case.from_json(case.to_json()) == case
    assert case.num_tokens <= PROFILES["cpu"].max_tokens + 4
    for i, r in enumerate(case.requests):  # every request's blocks are in its (rank-local) table row
        local = rank_owned_positions(r.seq_len, case.dcp.size, case.dcp.rank, case.dcp.interleave)
        row = case.block_table[case.table_row(i)]
        assert len(row) * case.block_size >= local


def test_padded_tokens_follow_the_runners_rule():
    """A full CUDA graph gives each trailing padding row of a uniform decode batch its query_len in tokens."""
    base = dict(requests=(Request(2, 30), Request(2, 5), Request(0, 0), Request(0, 0)), num_decodes=4, block_size=64,
                block_table=((1,), (2,), (0,), (0,)), topk_width=128, topk=(TopkSpec(1),) * 4)
    c = Case(**base, padded_tokens=4).validate()
    assert (c.num_tokens, c.num_actual_tokens) == (4, 8) and c.summary().endswith("padded_tokens=4")
    assert Case.from_json(c.to_json()) == c
    for wrong in (3, 2):
        with pytest.raises(CaseError, match="padded_tokens.*4 here"):
            Case(**base, padded_tokens=wrong).validate()


def test_recent_rows_select_the_newest_visible_positions():
    """pick=recent: each query row's valid entries are the newest positions it sees (the end of its last block)."""
    from strategies.tensors import materialize_index_inputs

    c = small_case(topk=(TopkSpec(3, pick="recent"), TopkSpec(2, pick="recent")))
    rows = materialize_index_inputs(c).topk_indices
    assert rows[0, :3].tolist() == [10, 9, 8]  # the decode at position 10 (context 10)
    assert [r[:2].tolist() for r in rows[1:]] == [[0, -1], [1, 0], [2, 1], [3, 2], [4, 3]]  # causal: row i sees 0..i


def test_an_explicit_cooperative_top_k_takes_at_most_64_decode_rows():
    """vLLM refuses sparse_indexer_topk_backend='cooperative' for a decode batch of more than 64 rows (a
    configuration error): such a case is malformed, named by its field, and the strategy never draws one."""
    import dataclasses

    from hypothesis import given, settings

    from strategies.case import COOPERATIVE_MAX_ROWS, Case, CaseError, IndexerStep, Request
    from strategies.indexer_batches import indexer_cases
    from strategies.profiles import PROFILES

    reqs = tuple(Request(context_len=8, query_len=1) for _ in range(COOPERATIVE_MAX_ROWS + 1))
    case = Case(requests=reqs, num_decodes=len(reqs), block_size=64, block_table=tuple((0,) for _ in reqs),
                topk_width=512, topk=(), heads=8, kv_cache_dtype="bfloat16", indexer=IndexerStep(topk_backend="auto"))
    case.validate()
    with pytest.raises(CaseError, match="indexer.topk_backend"):
        dataclasses.replace(case, indexer=IndexerStep(topk_backend="cooperative")).validate()
    with pytest.raises(CaseError, match=r"indexer.num_sms: must be in \[0, 132\]"):  # no more SMs than an H200
        dataclasses.replace(case, indexer=IndexerStep(num_sms=133)).validate()
    assert "sms=8" in dataclasses.replace(case, indexer=IndexerStep(num_sms=8)).validate().summary()

    @settings(max_examples=60, deadline=None, database=None)
    @given(indexer_cases(PROFILES["gpu"]))
    def drawn(c):
        if c.indexer.topk_backend == "cooperative":
            assert all(s.num_decode_tokens + s.padded_tokens <= COOPERATIVE_MAX_ROWS for s in c.steps)

    drawn()


def test_indexer_cases_draw_the_graph_modes_asked():
    """A run narrowed to eager engines (a sanitized one, `--cudagraph none`) draws no graph padding; one narrowed to
    full graphs draws padded steady-state decodes only."""
    from strategies.indexer_batches import indexer_cases
    from strategies.profiles import PROFILES

    for modes in (("none",), ("full",)):
        @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(indexer_cases(PROFILES["gpu"], graph_modes=modes))
        def drawn(c):
            assert {s.cudagraph for s in c.steps} == set(modes) and bool(c.padded_tokens) == (modes == ("full",))
            if modes == ("none",):  # no padding rows either: they come only with a graph's padding
                assert all(r.query_len for s in c.steps for r in s.requests)

        drawn()
