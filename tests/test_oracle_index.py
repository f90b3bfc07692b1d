"""The index oracle against a brute-force loop over the documented formula."""

import torch
from hypothesis import given, settings

from oracles.index import RemapArgs, compare_remap, expected_remap, remap_args_for
from oracles.materialize import materialize_index_inputs
from strategies.batches import IndexFeatures, index_cases
from strategies.profiles import PROFILES


def brute(a: RemapArgs) -> list[list[int]]:
    out = []
    width = a.block_table.shape[1]
    for t, row in enumerate(a.token_indices.tolist()):
        req = int(a.req_id[t])
        trow = max(int(a.idx_mapping[req]), 0) if a.idx_mapping is not None else req
        prefill = a.prefill_request_id is not None and int(a.prefill_request_id[t]) >= 0
        res = []
        for p in row:
            if p < 0:
                res.append(-1)
                continue
            n, i = a.dcp_size, a.dcp_interleave
            owner, local = (p // i) % n, (p // (n * i)) * i + p % i
            if local // a.block_size >= width or (owner != a.dcp_rank and not prefill):
                res.append(-1)
            elif prefill:
                res.append(int(a.prefill_workspace_starts[int(a.prefill_request_id[t])]) + local)
            else:
                res.append(int(a.block_table[trow, local // a.block_size]) * a.block_stride_rows + local % a.block_size)
        out.append(res)
    return out


@settings(max_examples=120, deadline=None)
@given(index_cases(PROFILES["cpu"], IndexFeatures(dcp=True, block_stride_rows=True, idx_mapping=True,
                                                  row_contract_breaks=False)))
def test_expected_remap_matches_brute_force(case):
    a = remap_args_for(case, materialize_index_inputs(case))
    assert expected_remap(a).tolist() == brute(a)


def test_materialize_is_deterministic():
    from tests.test_case import small_case

    c = small_case(seed=7)
    a, b = materialize_index_inputs(c), materialize_index_inputs(c)
    assert torch.equal(a.topk_indices, b.topk_indices)


def test_compare_remap_sees_each_kind_of_error():
    exp = torch.tensor([[5, -1, 7, -1], [1, 2, -1, -1]])
    assert compare_remap(exp.clone(), None, exp, compacted=False) == []
    wrong = exp.clone(); wrong[0, 2] = 8
    assert compare_remap(wrong, None, exp, compacted=False)[0].what == "values"
    compacted = torch.tensor([[7, 5, -1, -1], [2, 1, -1, -1]])
    counts = torch.tensor([2, 2])
    assert compare_remap(compacted, counts, exp, compacted=True) == []
    assert compare_remap(compacted, torch.tensor([3, 2]), exp, compacted=True)[0].what == "count"
    stray = compacted.clone(); stray[1, 3] = 9
    assert compare_remap(stray, counts, exp, compacted=True)[0].what == "layout"
    swapped = compacted.clone(); swapped[0, 0] = 6
    assert compare_remap(swapped, counts, exp, compacted=True)[0].what == "set"
