"""Properties of the generated cases that the oracles rely on."""

from hypothesis import HealthCheck, given, settings

from strategies.batches import AttentionFeatures, attention_cases
from strategies.profiles import PROFILES


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(attention_cases(PROFILES["cpu"], AttentionFeatures(kv_cache_dtypes=("bfloat16", "fp8_ds_mla"))))
def test_no_request_writes_into_a_block_another_request_reads(case):
    """vLLM shares only full blocks of cached tokens: a block holding a request's new tokens belongs to it
    alone. (A shared block written with new tokens once made the fp8 oracle judge wrongly.)"""
    owners: dict[int, set[int]] = {}
    written: dict[int, int] = {}
    for r, req in enumerate(case.requests):
        row = case.block_table[case.table_row(r)]
        for pos in range(req.seq_len):
            block = row[pos // case.block_size]
            owners.setdefault(block, set()).add(r)
            if pos >= req.context_len:
                written[block] = r
    for block, r in written.items():
        assert owners[block] == {r}, (case.summary(), block, owners[block])


def test_indexer_rows_and_per_tensor_fp8_scales_as_flashinfer_sm90_s_cases_draw_them():
    """topk_rows ("indexer",): every row asks for every visible position up to top-k; an "fp8" cache's fp8_scale is
    one of the per-tensor k_scales; and the knob topk_valid is not turned."""
    from hypothesis import HealthCheck, given, settings

    from strategies.batches import AttentionFeatures, attention_knobs, attention_space
    from strategies.case import FP8_PER_TENSOR_SCALES
    from strategies.profiles import PROFILES

    f = AttentionFeatures(kv_cache_dtypes=("bfloat16", "fp8"), topk_rows=("indexer",), block_sizes=(64, 128))
    knobs = attention_knobs(PROFILES["cpu"], f)
    assert "topk_valid" not in knobs and knobs["fp8_scale"] == FP8_PER_TENSOR_SCALES

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(attention_space(PROFILES["cpu"], f).strategy())
    def check(case):
        assert all(t.valid == case.topk_width for s in case.steps for t in s.topk)
        assert case.kv_cache_dtype != "fp8" or case.fp8_scale in FP8_PER_TENSOR_SCALES

    check()
