"""The dense sparse-MLA oracle against an explicit-loop brute force, plus lse_merge,
tolerance and error_margin."""

import math

import pytest
import torch

from oracles import attention
from oracles.attention import error_margin, lse_merge, sparse_mla_reference, tolerance


def brute_force(q, kv, indices, sm_scale, d_v):
    """Python loops over tokens, heads and selected keys; duplicates count each time."""
    T, H, _ = q.shape
    S = kv.shape[0]
    out = torch.zeros(T, H, d_v, dtype=torch.float64)
    lse = torch.full((T, H), -math.inf, dtype=torch.float64)
    for t in range(T):
        sel = [j for j in indices[t].tolist() if 0 <= j < S]
        for h in range(H):
            if not sel:
                continue
            scores = [float(q[t, h].double() @ kv[j].double()) * sm_scale for j in sel]
            m = max(scores)
            row_lse = m + math.log(sum(math.exp(s - m) for s in scores))
            for s, j in zip(scores, sel):
                out[t, h] += math.exp(s - row_lse) * kv[j, :d_v].double()
            lse[t, h] = row_lse
    return out, lse


def make_case(T=6, H=3, S=20, K=8, D=576, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g)
    kv = torch.randn(S, D, generator=g)
    indices = torch.randint(0, S, (T, K), generator=g, dtype=torch.int32)
    indices[0, :3] = -1                          # -1 padding at the start
    indices[1, 4] = -1                           # ... and in the middle
    indices[2, 1] = S                            # >= S: not selected
    indices[2, 5] = S + 100
    indices[3, 2] = -7                           # any negative: not selected
    indices[4] = -1                              # no valid index at all
    indices[5, :4] = indices[5, 4]               # duplicates
    return q, kv, indices


def check_close(actual, expected, tol=1e-5):
    assert error_margin(actual, expected, tol, tol) <= 1.0


@pytest.mark.parametrize("D,d_v", [(576, 512), (40, 32)])
def test_matches_brute_force(D, d_v):
    q, kv, indices = make_case(D=D)
    sm_scale = D ** -0.5
    out, lse = sparse_mla_reference(q, kv, indices, sm_scale, d_v=d_v)
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == (6, 3, d_v) and lse.shape == (6, 3)
    ref_out, ref_lse = brute_force(q, kv, indices, sm_scale, d_v)
    check_close(out, ref_out)
    check_close(lse, ref_lse)


def test_all_invalid_rows_give_zero_and_neg_inf():
    q, kv, _ = make_case()
    indices = torch.tensor([[-1] * 8, [20, 21, -1, -3, 99, -1, 20, -1]] * 3)
    out, lse = sparse_mla_reference(q, kv, indices, 0.1)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
    out, lse = sparse_mla_reference(q, kv[:0], indices.clamp(min=0), 0.1)  # S == 0
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_duplicates_count_each_time():
    q, kv, _ = make_case()
    q = q[:1, :1]
    sm_scale = 0.05
    out, lse = sparse_mla_reference(q, kv, torch.tensor([[3, 3, 5]]), sm_scale)
    sa = float(q[0, 0].double() @ kv[3].double()) * sm_scale
    sb = float(q[0, 0].double() @ kv[5].double()) * sm_scale
    expect_lse = math.log(2 * math.exp(sa) + math.exp(sb))
    expect_out = (2 * math.exp(sa - expect_lse) * kv[3, :512].double()
                  + math.exp(sb - expect_lse) * kv[5, :512].double())
    check_close(lse, torch.tensor([[expect_lse]]))
    check_close(out[0, 0], expect_out)
    single, _ = sparse_mla_reference(q, kv, torch.tensor([[3, 5]]), sm_scale)
    assert error_margin(out, single, 1e-5, 1e-5) > 1.0  # a duplicate is not deduplicated


def test_out_of_range_indices_are_ignored():
    q, kv, _ = make_case()
    q = q[:1]
    S = kv.shape[0]
    a = sparse_mla_reference(q, kv, torch.tensor([[0, S, S + 3, 1, -1, 2**30]]), 0.1)
    b = sparse_mla_reference(q, kv, torch.tensor([[0, 1]]), 0.1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_token_blocking_does_not_change_result(monkeypatch):
    q, kv, indices = make_case(T=9)
    whole = sparse_mla_reference(q, kv, indices, 0.1)
    monkeypatch.setattr(attention, "_BLOCK_ELEMS", 1)  # one token per block
    blocked = sparse_mla_reference(q, kv, indices, 0.1)
    assert torch.equal(whole[0], blocked[0]) and torch.equal(whole[1], blocked[1])


def split_attention(q, kv, indices, parts):
    """Attention over each key subset (rows not in the subset set to -1)."""
    outs, lses = [], []
    for rows in parts:
        keep = torch.isin(indices, torch.tensor(rows, dtype=indices.dtype))
        o, l = sparse_mla_reference(q, kv, torch.where(keep, indices, -1), 0.1)
        outs.append(o)
        lses.append(l)
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("parts", [
    [range(0, 10), range(10, 20)],
    [range(0, 7), range(7, 13), range(13, 20)],
    [range(0, 20), []],                                  # an empty part
    [[0, 2, 4, 6, 8, 10, 12, 14, 16, 18], [], [1, 3, 5, 7, 9, 11, 13, 15, 17, 19]],
])
def test_lse_merge_equals_attention_over_union(parts):
    q, kv, indices = make_case()
    full_out, full_lse = sparse_mla_reference(q, kv, indices, 0.1)
    outs, lses = split_attention(q, kv, indices, [list(p) for p in parts])
    outs[torch.isneginf(lses)] = float("nan")  # an empty shard's output must be ignored
    out, lse = lse_merge(outs, lses)
    check_close(out, full_out)
    check_close(lse, full_lse)
    assert torch.isneginf(lse[4]).all() and torch.equal(out[4], torch.zeros_like(out[4]))


def test_lse_merge_base2():
    q, kv, indices = make_case()
    full_out, full_lse = sparse_mla_reference(q, kv, indices, 0.1)
    outs, lses = split_attention(q, kv, indices, [range(0, 9), range(9, 20)])
    out2, lse2 = lse_merge(outs, lses / math.log(2), base_e=False)
    check_close(out2, full_out)
    check_close(lse2, full_lse / math.log(2))  # result stays in the inputs' base
    wrong_out, _ = lse_merge(outs, lses / math.log(2), base_e=True)  # base mismatch (class G)
    assert error_margin(wrong_out, full_out, 1e-3, 1e-3) > 1.0


def test_lse_merge_all_empty():
    outs = torch.full((3, 2, 4, 8), float("nan"))
    lses = torch.full((3, 2, 4), -math.inf)
    out, lse = lse_merge(outs, lses)
    assert torch.equal(out, torch.zeros(2, 4, 8)) and torch.isneginf(lse).all()


def test_tolerance():
    assert tolerance("bfloat16", "auto") == (1e-2, 1e-2)
    assert tolerance(torch.bfloat16, "bfloat16") == (1e-2, 1e-2)
    assert tolerance("bfloat16", "fp8_ds_mla") == (0.05, 0.065)
    with pytest.raises(ValueError):
        tolerance("bfloat16", "nvfp4_ds_mla")


def test_error_margin():
    e = torch.tensor([1.0, -2.0, 0.0, -math.inf])
    assert error_margin(e.clone(), e, 0.0, 0.0) == 0.0           # exact, -inf == -inf
    a = torch.tensor([1.1, -2.0, 0.0, -math.inf])
    assert error_margin(a, e, 0.01, 0.1) == pytest.approx(0.1 / (0.01 + 0.1))
    assert error_margin(torch.tensor([1.0, -2.0, float("nan"), -math.inf]), e, 1, 1) == math.inf
    assert error_margin(torch.tensor([1.0, -2.0, math.inf, -math.inf]), e, 1, 1) == math.inf
    assert error_margin(torch.tensor([1.0, -2.0, 0.0, -30.0]), e, 1, 1) == math.inf  # lse not -inf
    assert error_margin(torch.tensor([1.0, -2.0, 0.5, -math.inf]), e, 0.0, 0.0) == math.inf
    assert error_margin(a.bfloat16(), e, 0.01, 0.1) <= 1.0
