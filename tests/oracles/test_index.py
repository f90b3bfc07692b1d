"""The index oracle against a brute-force loop over the documented formula."""

import torch
from hypothesis import given, settings

from oracles.index import RemapArgs, compare_remap, expected_remap, remap_args_for
from strategies.batches import IndexFeatures, index_cases
from strategies.profiles import PROFILES
from strategies.tensors import materialize_index_inputs


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
    from tests.strategies.test_case import small_case

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
    swapped = compacted.clone(); swapped[0, 0] = 6  # a slot no entry maps to: the address is wrong
    assert compare_remap(swapped, counts, exp, compacted=True)[0].what == "slot"
    holed = compacted.clone(); holed[0, 0] = -1  # a hole in the valid prefix: the compaction is wrong
    assert compare_remap(holed, counts, exp, compacted=True)[0].what == "set"


def _row_is_as_specified(row: list[int], spec, visible: int, seq_len: int, table_tokens: int, width: int) -> None:
    """One row of topk_indices against TopkSpec's words (materialize_index_inputs builds every row at once).
    Past-table entries can be visible positions too (under DCP the table holds fewer positions than the
    sequence), so rows are read in order: valid, past the sequence, past the table."""
    n_valid = min(spec.valid, visible, width)
    n_seq = min(spec.past_seq if table_tokens > seq_len else 0, width - n_valid)
    n_table = min(spec.past_table, width - n_valid - n_seq)
    entries = [p for p in row if p != -1]
    assert len(entries) == n_valid + n_seq + n_table, (row, spec)
    far = [p for p in entries if p >= table_tokens + 2**30]  # the last of >1 past-table entries, when it fits
    assert len(far) == (1 if spec.past_table > 1 and n_table == spec.past_table else 0), (row, spec)
    if spec.invalid_at == "scattered":  # shuffled: only what each entry can be
        seq = [p for p in entries if seq_len <= p < table_tokens]
        valid = [p for p in entries if p < visible and p < table_tokens]
        assert len(seq) == n_seq and len(valid) <= n_valid and len(set(valid)) == len(valid), (row, spec)
        assert all(0 <= p < visible or p >= table_tokens for p in entries if p not in seq), (row, spec)
        return
    valid, seq, table = entries[:n_valid], entries[n_valid:n_valid + n_seq], entries[n_valid + n_seq:]
    assert all(0 <= p < visible for p in valid) and len(set(valid)) == len(valid), (row, spec)
    assert all(seq_len <= p < table_tokens for p in seq), (row, spec)
    assert all(table_tokens <= p < table_tokens + 4096 for p in table if p not in far), (row, spec)
    assert far == table[-1:] if far else True, (row, spec)
    n_invalid = width - len(entries)
    lead = {"tail": 0, "head": n_invalid, "leading_tiles": min(n_invalid, 16 * (1 + n_invalid // 64))}[spec.invalid_at]
    assert row[lead:lead + len(entries)] == entries, (row, spec)


def _rows_are_as_specified(case):
    index = materialize_index_inputs(case)
    table_tokens = len(case.block_table[0]) * case.block_size * case.dcp.size
    rows = index.topk_indices.tolist()
    assert len(rows) == case.num_tokens and index.req_id_per_token.tolist() == [
        r for r, req in enumerate(case.requests) for _ in range(req.query_len)]
    for r, (req, spec) in enumerate(zip(case.requests, case.topk)):
        for i in range(req.query_len):
            _row_is_as_specified(rows[case.token_start(r) + i], spec, req.context_len + i + 1, req.seq_len,
                                 table_tokens, case.topk_width)


@settings(max_examples=150, deadline=None)
@given(index_cases(PROFILES["cpu"], IndexFeatures(dcp=True, block_stride_rows=True, idx_mapping=True)))
def test_topk_rows_are_as_specified(case):
    _rows_are_as_specified(case)


def test_topk_rows_truncate_at_the_width():
    from strategies.case import Case, Request, TopkSpec

    for at in ("tail", "head", "leading_tiles", "scattered"):
        # 130 visible positions for a width of 128: the valid entries fill the row, the out-of-range ones fall off;
        # and a short row whose two past-table entries fit (the last far past the table).
        case = Case((Request(2, 128), Request(3, 1)), 0, 64, ((1, 2, 3, 0), (4, 0, 0, 0)), 128,
                    (TopkSpec(128, at, 3, 3), TopkSpec(2, at, 1, 2)), seed=5).validate()
        _rows_are_as_specified(case)


def test_a_compacted_row_holding_another_ranks_tokens_is_named_owner():
    # DCP 2, interleave 2, rank 0: tokens 0,1 are rank 0's, 2,3 rank 1's; local slot = t // 4 * 2 + t % 2.
    a = RemapArgs(req_id=torch.tensor([0], dtype=torch.int32), block_table=torch.tensor([[0]], dtype=torch.int32),
                  token_indices=torch.tensor([[0, 2, 3, -1]], dtype=torch.int32), block_size=64, block_stride_rows=64,
                  dcp_size=2, dcp_rank=0, dcp_interleave=2)
    exp, blind = expected_remap(a), expected_remap(a, any_owner=True)
    assert exp.tolist() == [[0, -1, -1, -1]] and blind.tolist() == [[0, 0, 1, -1]]
    # Round-robin ownership (interleave ignored) keeps token 2 as well: slot 0 again, then token 3's slot 1.
    (m,) = compare_remap(torch.tensor([[0, 1, -1, -1]]), torch.tensor([2]), exp, compacted=True, owner_blind=blind)
    assert m.what == "owner" and "slots [1]" in m.detail
    # A wrong count with nothing foreign in the row stays a count mismatch.
    (m,) = compare_remap(torch.tensor([[0, -1, -1, -1]]), torch.tensor([2]), exp, compacted=True, owner_blind=blind)
    assert m.what == "count"
