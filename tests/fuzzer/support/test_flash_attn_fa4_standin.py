"""attnfuzz's stand-in of FA4's `_flash_attn_fwd` in the sparse-MLA gather form vLLM's FLASH_ATTN_MLA_SPARSE_FA4 calls
(through vLLM's own flash_attn_varlen_func, fa_version=4): the kernels walk ceil(valid / 128) blocks of 128 entries of
each gather row (at least one), count an entry iff 0 <= idx < seqused_k, give a token with no counted entry out 0 and
LSE -inf; FA4's own checks; what the stand-in does not model (could-not-test); memory outside k / v recorded. At the
edges: empty rows, -1 entries, the last partial block, the last row of the cache and one past it."""

import math

import pytest
import torch

from fuzzer.support.errors import StandInRefused
from fuzzer.support.standins import flash_attn_fa4 as fa4
from tests.fuzzer.support.sanitized import violations_during as _violations

ROWS, W = 300, 256
SCALE = 1.0 / math.sqrt(576)


def _inputs(tokens, heads, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(ROWS, 576, generator=g).bfloat16()
    q = torch.randn(tokens, heads, 576, generator=g).bfloat16()
    return rows, q


def _call(rows, q, gather, valid, seqused=None, **kw):
    """As vLLM's FlashAttnMLASparseFA4Impl._forward_mqa_kernel calls it (after its wrapper): k and v views of the
    flat rows, one query row a token, cu_seqlens_k zeros, seqused_k the rows for every token."""
    t = q.shape[0]
    seqused = torch.full((t,), rows.shape[0], dtype=torch.int32) if seqused is None else seqused
    return fa4._flash_attn_fwd(q[..., 512:], rows[:, 512:].unsqueeze(1), rows[:, :512].unsqueeze(1),
                               qv=q[..., :512], cu_seqlens_q=torch.arange(t + 1, dtype=torch.int32),
                               cu_seqlens_k=torch.zeros(t + 1, dtype=torch.int32), seqused_k=seqused,
                               max_seqlen_q=1, max_seqlen_k=rows.shape[0], gather_kv_indices=gather,
                               gather_kv_valid_length=valid, softmax_scale=SCALE, return_lse=True, **kw)[:2]


def _reference(rows, q, picks):
    """softmax over the picked rows of SCALE x q.row (576 wide), times the rows' latent; natural-log LSE."""
    out, lse = [], []
    for t, idx in enumerate(picks):
        if not idx:
            out.append(torch.zeros(q.shape[1], 512))
            lse.append(torch.full((q.shape[1],), -math.inf))
            continue
        k = rows[torch.tensor(idx)].float()
        s = (q[t].float() @ k.T) * SCALE
        out.append(torch.softmax(s, -1) @ k[:, :512])
        lse.append(torch.logsumexp(s, -1))
    return torch.stack(out), torch.stack(lse)


def _gather(*rows_of_entries):
    g = torch.full((len(rows_of_entries), W), -1, dtype=torch.int32)
    for t, entries in enumerate(rows_of_entries):
        for j, idx in entries.items():
            g[t, j] = idx
    return g


@pytest.mark.parametrize("heads", [16, 128])  # the sparse decode kernel, the MLA forward kernel
def test_counted_entries_are_the_walked_blocks_in_range_entries(heads):
    """Token 0: valid 3, entries at 0-2 plus one at 100 (past valid, inside the one walked block: counted, only the
    value masks) and one at 200 (the second block, never walked). Token 1: valid 130 walks both blocks; a -1 at the
    start, an entry at 129 (second block), the cache's last row (ROWS - 1) and an index at seqused_k (masked).
    Token 2: no valid entry (valid 0, all -1): out 0, LSE -inf."""
    rows, q = _inputs(3, heads)
    gather = _gather({0: 7, 1: 9, 2: 11, 100: 13, 200: 15}, {0: -1, 1: 4, 129: 250, 130: ROWS - 1, 131: ROWS}, {})
    valid = torch.tensor([3, 130, 0], dtype=torch.int32)
    (out, lse), found = _violations(lambda: _call(rows, q, gather, valid))
    assert not found
    ref_out, ref_lse = _reference(rows, q, [[7, 9, 11, 13], [4, 250, ROWS - 1], []])
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    assert out.shape == (3, heads, 512) and out.dtype == torch.bfloat16 and lse.shape == (3, heads)
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()


def test_without_valid_length_every_block_is_walked_and_negative_lengths_walk_one():
    rows, q = _inputs(2, 8)
    gather = _gather({0: 3, 200: 5}, {0: 6, 128: 8})
    out, _ = _call(rows, q, gather, None)
    torch.testing.assert_close(out.float(), _reference(rows, q, [[3, 5], [6, 8]])[0], atol=2e-2, rtol=2e-2)
    out, _ = _call(rows, q, gather, torch.tensor([-5, 0], dtype=torch.int32))
    torch.testing.assert_close(out.float(), _reference(rows, q, [[3], [6]])[0], atol=2e-2, rtol=2e-2)


def test_seqused_k_masks_by_index_value_and_past_k_s_rows_is_a_memory_violation():
    """seqused_k is the bound on an entry's index (FA3's call form passes a count there: every row at or past it
    masked); a seqused_k past k's rows lets an index reach outside k and v: recorded, skipped."""
    rows, q = _inputs(2, 8)
    gather = _gather({0: 2, 1: 50}, {0: 2, 1: ROWS + 4})
    (out, _), found = _violations(lambda: _call(rows, q, gather, torch.tensor([2, 2], dtype=torch.int32),
                                                seqused=torch.tensor([10, ROWS + 10], dtype=torch.int32)))
    assert {v.argument for v in found} == {"k", "v"} and all(fa4.KERNEL == v.kernel for v in found)
    torch.testing.assert_close(out.float(), _reference(rows, q, [[2], [2]])[0], atol=2e-2, rtol=2e-2)


def test_a_token_past_cu_seqlens_q_reads_seqused_k_past_its_end_on_the_decode_kernel():
    rows, q = _inputs(3, 16)
    gather = _gather({0: 1}, {0: 2}, {0: 3})
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32)  # 2 batches, 3 query rows
    (_, found) = _violations(lambda: fa4._flash_attn_fwd(
        q[..., 512:], rows[:, 512:].unsqueeze(1), rows[:, :512].unsqueeze(1), qv=q[..., :512], cu_seqlens_q=cu_q,
        cu_seqlens_k=torch.zeros(3, dtype=torch.int32), seqused_k=torch.full((2,), ROWS, dtype=torch.int32),
        gather_kv_indices=gather, gather_kv_valid_length=torch.ones(3, dtype=torch.int32)))
    assert [v.argument for v in found] == ["seqused_k"]


def test_fa4_s_own_checks():
    rows, q = _inputs(2, 16)
    valid = torch.ones(2, dtype=torch.int32)
    with pytest.raises(AssertionError):  # the gather's width a multiple of 128 (tile_n)
        _call(rows, q, torch.zeros(2, 64, dtype=torch.int32), valid)
    with pytest.raises(AssertionError, match="gather_kv_valid_length dtype"):
        _call(rows, q, _gather({}, {}), valid.long())
    with pytest.raises(AssertionError, match="seqused_k must have shape"):
        _call(rows, q, _gather({}, {}), valid, seqused=torch.full((3,), ROWS, dtype=torch.int32))
    with pytest.raises(AssertionError, match="qv.dtype"):
        fa4._flash_attn_fwd(q[..., 512:], rows[:, 512:].unsqueeze(1), rows[:, :512].unsqueeze(1),
                            qv=q[..., :512].half(), cu_seqlens_q=torch.arange(3, dtype=torch.int32),
                            cu_seqlens_k=torch.zeros(3, dtype=torch.int32), gather_kv_indices=_gather({}, {}))


@pytest.mark.parametrize("kw", [dict(causal=True), dict(page_table=torch.zeros(2, 1, dtype=torch.int32)),
                                dict(learnable_sink=torch.zeros(16)), dict(window_size_left=4),
                                dict(k_descale=torch.ones(1, 1))])
def test_forms_vllm_never_passes_are_refused(kw):
    rows, q = _inputs(2, 16)
    with pytest.raises(StandInRefused):
        _call(rows, q, _gather({}, {}), torch.ones(2, dtype=torch.int32), **kw)


def test_heads_the_kernels_do_not_take_and_fp8_are_refused():
    rows, q = _inputs(2, 4)
    with pytest.raises(StandInRefused, match="4 query heads"):
        _call(rows, q, _gather({}, {}), torch.ones(2, dtype=torch.int32))
    rows, q = _inputs(2, 16)
    with pytest.raises(StandInRefused):
        _call(rows.to(torch.float8_e4m3fn), q.to(torch.float8_e4m3fn), _gather({}, {}), torch.ones(2, dtype=torch.int32))


def test_importable_only_inside_the_block():
    import sys

    assert fa4.INTERFACE not in sys.modules
    with fa4.importable():
        from vllm.vllm_flash_attn.cute.interface import _flash_attn_fwd  # noqa: PLC0415 (what vLLM's wrapper does)

        assert _flash_attn_fwd.__module__ == fa4.__name__
    assert fa4.INTERFACE not in sys.modules
