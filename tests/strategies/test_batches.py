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
