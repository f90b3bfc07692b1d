"""The indexer op stand-ins (fuzzer/support/standins/indexer_ops.py) against references written here, from the
kernels' contracts: the cache layout (block_size*head_dim e4m3 bytes then block_size fp32 scales per block), the
scale rule (amax / 448, ue8m0 to a power of two, "mxfp8" as four exponent bytes), the gather through block tables,
and top-k rows (which positions, relative to what, -1 fill, refusals), with each misuse recorded as a violation."""

import pytest
import torch

from fuzzer.support.interp.sanitizer import SANITIZER
from fuzzer.support.standins import indexer_ops as ops
from fuzzer.support.standins.cache_ops import EmptyLaunch
from tests.fuzzer.support.sanitized import violations  # noqa: F401  (a fixture)

HEAD_DIM = 128


def collected(before: int) -> list:
    return SANITIZER.violations[before:]


def reference_quant(x: torch.Tensor, scale_fmt: str):
    """One token's (e4m3 bytes, scale) as written, from the rule: scale = max(amax, 1e-4) / 448."""
    amax = max(float(x.float().abs().max()), 1e-4)
    scale = torch.tensor(amax, dtype=torch.float32) / 448.0
    if scale_fmt in ("ue8m0", "mxfp8"):
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    return q, scale


def cache_parts(cache: torch.Tensor, block: int, row: int):
    block_size = cache.shape[1]
    flat = cache[block].reshape(-1)
    values = flat[row * HEAD_DIM:(row + 1) * HEAD_DIM]
    scale = flat[block_size * HEAD_DIM + 4 * row: block_size * HEAD_DIM + 4 * row + 4]
    return values, scale


@pytest.mark.parametrize("scale_fmt", ["", "ue8m0", "mxfp8"])
def test_write_layout_scale_and_skipped_slots(scale_fmt, violations):
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(6, HEAD_DIM, generator=g) * torch.tensor([0.001, 1, 30, 0.3, 5, 2])[:, None]).bfloat16()
    k[4] = 0  # all zero: the 1e-4 floor
    cache = torch.full((3, 16, HEAD_DIM + 4), 0xAB, dtype=torch.uint8)
    slots = torch.tensor([0, 17, -1, 47, 5, 33])  # 47: the last row of the last page
    ops.indexer_k_quant_and_cache(k, cache, slots, 128, scale_fmt)
    assert collected(violations) == []
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        values, scale = cache_parts(cache, s // 16, s % 16)
        q, ref_scale = reference_quant(k[t], scale_fmt)
        assert torch.equal(values, q)
        if scale_fmt == "mxfp8":
            exponent = (ref_scale.view(torch.int32) >> 23) & 0xFF
            assert scale.tolist() == [int(exponent)] * 4
        else:
            assert scale.view(torch.float32).item() == ref_scale.item()
        if scale_fmt:
            m, _ = torch.frexp(scale.view(torch.float32) if scale_fmt == "ue8m0" else ref_scale.reshape(1))
            assert m.item() == 0.5  # a power of two
    untouched = torch.ones(3 * 16, dtype=torch.bool)
    untouched[[0, 17, 47, 5, 33]] = False
    for s in untouched.nonzero().flatten().tolist():  # the -1 slot wrote nothing
        values, scale = cache_parts(cache, s // 16, s % 16)
        assert values.eq(0xAB).all() and scale.eq(0xAB).all()


def test_write_out_of_range_slot_is_recorded_and_zero_tokens_fail(violations):
    cache = torch.zeros(2, 16, HEAD_DIM + 4, dtype=torch.uint8)
    ops.indexer_k_quant_and_cache(torch.ones(2, HEAD_DIM).bfloat16(), cache, torch.tensor([3, 32]), 128, "ue8m0")
    found = collected(violations)
    assert found and all(v.argument == "kv_cache" and v.op == "store" for v in found)
    assert not found[0].inside_allocation
    assert cache[0, 3].any() and cache[1].eq(0).all()
    with pytest.raises(EmptyLaunch):
        ops.indexer_k_quant_and_cache(torch.ones(0, HEAD_DIM).bfloat16(), cache, torch.zeros(0, dtype=torch.long),
                                      128, "ue8m0")
    with pytest.raises(RuntimeError, match="divisible"):
        ops.indexer_k_quant_and_cache(torch.ones(1, HEAD_DIM).bfloat16(), cache, torch.tensor([0]), 96, "ue8m0")


def filled_cache(num_blocks=4, block_size=16, seed=0):
    k = torch.randn(num_blocks * block_size, HEAD_DIM, generator=torch.Generator().manual_seed(seed)).bfloat16()
    cache = torch.zeros(num_blocks, block_size, HEAD_DIM + 4, dtype=torch.uint8)
    ops.indexer_k_quant_and_cache(k, cache, torch.arange(num_blocks * block_size), 128, "ue8m0")
    return cache


def reference_gather(cache, block_table, lens):
    rows_k, rows_s = [], []
    block_size = cache.shape[1]
    for b, n in enumerate(lens):
        for p in range(n):
            values, scale = cache_parts(cache, int(block_table[b, p // block_size]), p % block_size)
            rows_k.append(values)
            rows_s.append(scale)
    return torch.stack(rows_k), torch.stack(rows_s)


def test_gather_follows_each_request_s_table_to_the_last_partial_page(violations):
    cache = filled_cache()
    table = torch.tensor([[2, 0, 3], [1, -1, -1], [3, 1, 0]], dtype=torch.int32)
    lens = [37, 0, 20]  # 37: two full pages and a partial third; a zero-length request
    cu = torch.tensor([0, 37, 37, 57], dtype=torch.int32)
    dst_k = torch.full((60, HEAD_DIM), 0xEE, dtype=torch.uint8)  # 3 rows past cu[-1]: left alone
    dst_s = torch.full((60, 4), 0xEE, dtype=torch.uint8)
    ops.cp_gather_indexer_k_quant_cache(cache, dst_k, dst_s, table, cu)
    assert collected(violations) == []
    ref_k, ref_s = reference_gather(cache, table, lens)
    assert torch.equal(dst_k[:57], ref_k) and torch.equal(dst_s[:57], ref_s)
    assert dst_k[57:].eq(0xEE).all() and dst_s[57:].eq(0xEE).all()


def test_gather_through_a_minus_one_or_out_of_range_block_is_recorded(violations):
    cache = filled_cache(num_blocks=2)
    dst_k = torch.zeros(20, HEAD_DIM, dtype=torch.uint8)
    dst_s = torch.zeros(20, 4, dtype=torch.uint8)
    ops.cp_gather_indexer_k_quant_cache(cache, dst_k, dst_s, torch.tensor([[1, -1]], dtype=torch.int32),
                                        torch.tensor([0, 20], dtype=torch.int32))
    found = collected(violations)
    assert found and found[0].argument == "kv_cache" and found[0].op == "load" and found[0].byte_offset < 0
    assert dst_k[:16].any() and dst_k[16:].eq(0).all()
    before = len(SANITIZER.violations)
    ops.cp_gather_indexer_k_quant_cache(cache, dst_k, dst_s, torch.tensor([[0, 5]], dtype=torch.int32),
                                        torch.tensor([0, 20], dtype=torch.int32))
    found = collected(before)
    assert found and found[0].argument == "kv_cache" and found[0].byte_offset >= 2 * 16 * (HEAD_DIM + 4)


def reference_topk(scores: torch.Tensor, length: int, k: int) -> tuple[set, int]:
    """The set the kernels promise for a row of `length` positions: all of them when length <= k, else the k best
    (unique scores here, so no ties); and how many slots hold a position."""
    if length <= k:
        return set(range(max(length, 0))), max(length, 0)
    return set(scores[:length].topk(k).indices.tolist()), k


def check_rows(indices, logits, ends, k, starts=None):
    for r, end in enumerate(ends):
        start = 0 if starts is None else starts[r]
        expected, n = reference_topk(logits[r, start:], end - start, k)
        row = indices[r].tolist()
        assert set(row[:n]) == expected, r
        assert row[n:] == [-1] * (k - n), r
        if end - start <= k:
            assert row[:n] == list(range(n))  # a short row: its positions in order


def test_prefill_indices_are_relative_to_the_row_start(violations):
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(1))
    starts = torch.tensor([0, 5, 10, 3], dtype=torch.int32)
    ends = torch.tensor([30, 9, 40, 3], dtype=torch.int32)  # long, short, long, empty
    indices = torch.full((4, 8), 99, dtype=torch.int32)
    ops.top_k_per_row_prefill(logits, starts, ends, indices, 4, logits.stride(0), logits.stride(1), 8)
    assert collected(violations) == []
    check_rows(indices, logits, ends.tolist(), 8, starts.tolist())
    assert indices[3].tolist() == [-1] * 8


def test_prefill_row_end_before_its_start_writes_into_the_previous_row(violations):
    logits = torch.randn(2, 10)
    indices = torch.zeros(2, 4, dtype=torch.int32)
    ops.top_k_per_row_prefill(logits, torch.tensor([0, 6], dtype=torch.int32), torch.tensor([2, 4], dtype=torch.int32),
                              indices, 2, 10, 1, 4)
    found = collected(violations)
    assert found and found[0].argument == "indices" and found[0].op == "store"
    assert indices[0].tolist() == [0, 1, -1, -1] and indices[1].tolist() == [-1] * 4


@pytest.mark.parametrize("next_n", [1, 2, 4])
@pytest.mark.parametrize("two_d", [False, True])
def test_decode_rows_cover_their_causal_prefix(next_n, two_d, violations):
    batch, width, k = 3, 64, 16
    g = torch.Generator().manual_seed(next_n)
    seq_lens = torch.tensor([next_n + 2, 40, width], dtype=torch.int32)
    rows = batch * next_n
    ends = [max(0, int(seq_lens[r // next_n]) - next_n + r % next_n + 1) for r in range(rows)]
    logits = torch.randn(rows, width, generator=g)
    passed = torch.tensor(ends, dtype=torch.int32).reshape(batch, next_n) if two_d else seq_lens
    indices = torch.full((rows, k), 99, dtype=torch.int32)
    ops.top_k_per_row_decode(logits, next_n, passed, indices, rows, width, 1, k)
    assert collected(violations) == []
    check_rows(indices, logits, ends, k)


def test_decode_with_2d_lengths_takes_each_row_s_own():
    logits = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    indices = torch.zeros(4, 2, dtype=torch.int32)
    ops.top_k_per_row_decode(logits, 2, torch.tensor([[0, 1], [6, 3]], dtype=torch.int32), indices, 4, 6, 1, 2)
    assert indices.tolist() == [[-1, -1], [0, -1], [5, 4], [2, 1]]


def test_decode_length_past_the_width_reads_the_next_row_and_is_recorded(violations):
    logits = torch.zeros(2, 8)
    logits[1, 0] = 5.0  # the next row's first score, seen by row 0 at position 8
    indices = torch.zeros(2, 2, dtype=torch.int32)
    ops.top_k_per_row_decode(logits, 1, torch.tensor([9, 3], dtype=torch.int32), indices, 2, 8, 1, 2)
    found = collected(violations)
    assert found[0].argument == "logits" and found[0].op == "load" and found[0].inside_allocation
    assert indices[0, 0].item() == 8


def test_nan_and_minus_inf_rank_by_bits():
    logits = torch.tensor([[1.0, float("-inf"), 3.0, 2.0, float("inf"), -1.0]])
    logits[0, 1] = float("nan")  # +NaN: above +inf in the radix order
    indices = torch.zeros(1, 3, dtype=torch.int32)
    ops.top_k_per_row_decode(logits, 1, torch.tensor([6], dtype=torch.int32), indices, 1, 6, 1, 3)
    assert set(indices[0].tolist()) == {1, 4, 2}


@pytest.mark.parametrize("op", [ops.persistent_topk, ops.cooperative_topk])
def test_workspace_topk_takes_per_row_lengths(op, violations):
    k, width = 512, 1024
    logits = torch.randn(5, width, generator=torch.Generator().manual_seed(2))
    lengths = torch.tensor([0, 100, 512, 513, 1024], dtype=torch.int32)
    out = torch.full((5, k), 7, dtype=torch.int32)
    op(logits, lengths, out, torch.zeros(1 << 20, dtype=torch.uint8), k, width)
    assert collected(violations) == []
    check_rows(out, logits, lengths.tolist(), k)


def test_cooperative_topk_refusals():
    ws = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="supports <=64 rows; use persistent_topk for larger batches"):
        ops.cooperative_topk(torch.zeros(65, 16), torch.ones(65, dtype=torch.int32),
                             torch.zeros(65, 512, dtype=torch.int32), ws, 512, 16)
    with pytest.raises(RuntimeError, match="supports k=512, k=1024, or k=2048, got k=256"):
        ops.cooperative_topk(torch.zeros(2, 16), torch.ones(2, dtype=torch.int32),
                             torch.zeros(2, 256, dtype=torch.int32), ws, 256, 16)
    with pytest.raises(RuntimeError, match=r"stride must be multiple of 4 for TMA alignment, got stride "
                                           r"\(max_model_len\)=18"):
        ops.cooperative_topk(torch.zeros(2, 18), torch.ones(2, dtype=torch.int32),
                             torch.zeros(2, 512, dtype=torch.int32), ws, 512, 18)
    ops.persistent_topk(torch.zeros(65, 18), torch.ones(65, dtype=torch.int32),
                        torch.zeros(65, 512, dtype=torch.int32), ws, 512, 18)  # what cooperative refuses


def test_top_k_of_no_rows_is_an_empty_launch():
    with pytest.raises(EmptyLaunch):
        ops.top_k_per_row_decode(torch.zeros(0, 8), 1, torch.zeros(0, dtype=torch.int32),
                                 torch.zeros(0, 4, dtype=torch.int32), 0, 8, 1, 4)
