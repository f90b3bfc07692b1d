"""The DeepGEMM stand-ins (fuzzer/support/standins/deep_gemm.py) against an fp64 reference written here, and at the
edges: empty rows, out-of-range block-table entries, the last partial page, the block-major scale layout, next_n 2
and 4, the SM90 schedule (metadata split, one-request-ahead Q prefetch) and the call forms DeepGEMM refuses."""

import pytest
import torch

from fuzzer.support.interp.sanitizer import SANITIZER
from fuzzer.support.standins import deep_gemm as dg

D = 128
E4M3 = torch.float8_e4m3fn


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def fp8(*shape, g):
    return torch.randn(*shape, generator=g).to(E4M3)


def paged_cache(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, 1, D + 4] uint8, block-major as DeepGEMM reads it: a block's block_size x D e4m3
    values, then its block_size fp32 scales."""
    nb, bs, d = values.shape
    raw = torch.cat([values.to(E4M3).view(torch.uint8).reshape(nb, -1),
                     scales.float().contiguous().view(torch.uint8).reshape(nb, -1)], 1)
    return raw.view(nb, bs, 1, d + 4)


def ref_logits(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp64: scale[j] * sum_h w[h] * relu(q[h] . k[j]); q [H, D], w [H], keys [P, D], scales [P] -> [P]."""
    s = (q.double() @ keys.double().T).clamp(min=0)
    return (s * w.double()[:, None]).sum(0) * scales.double()


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    scale = float(want.abs().max()) if want.numel() else 0.0
    return got.shape == want.shape and bool(((got.double() - want).abs() <= 1e-5 * (scale + 1)).all())


def paged_setup(next_n, lens, *, heads=32, block_size=64, num_blocks=40, width=None, seed=0):
    g = _gen(seed)
    b = len(lens)
    values, scales = fp8(num_blocks, block_size, D, g=g), torch.rand(num_blocks, block_size, generator=g) + 0.5
    width = width or max(1, max(-(-max(row) // block_size) for row in lens))
    table = (torch.randperm(num_blocks - 1, generator=g)[: b * width] + 1).view(b, width).int()
    q = fp8(b, next_n, heads, D, g=g)
    w = torch.randn(b * next_n, heads, generator=g)
    ctx = torch.tensor(lens, dtype=torch.int32)
    return q, paged_cache(values, scales), values, scales, w, ctx, table


def paged(q, cache, w, ctx, table, max_len=1024):
    meta = dg.get_paged_mqa_logits_metadata(ctx, cache.shape[1], dg.NUM_SMS // (2 if ctx.shape[1] == 4 else 1))
    return dg.fp8_fp4_paged_mqa_logits((q, None), cache, w, ctx, table, meta, max_len)


def paged_ref_row(q, values, scales, w, table, b, n, length, next_n):
    pos = torch.arange(length)
    blk = table[b, pos // values.shape[1]].long()
    return ref_logits(q[b, n].float(), w[b * next_n + n], values[blk, pos % values.shape[1]].float(),
                      scales[blk, pos % values.shape[1]])


# -- fp8_fp4_mqa_logits --------------------------------------------------------------------------------------------

def test_mqa_logits_are_compressed_rows_over_ks_ke_with_poisoned_tails():
    g = _gen(1)
    m, n, heads = 6, 300, 64
    q, kv, w = fp8(m, heads, D, g=g), fp8(n, D, g=g), torch.randn(m, heads, generator=g)
    sf = torch.rand(n, generator=g) + 0.25
    ks = torch.tensor([0, 5, 17, 100, 299, 40], dtype=torch.int32)
    ke = torch.tensor([1, 5, 250, 300, 300, 41], dtype=torch.int32)  # row 1 empty (ks == ke)
    out = dg.fp8_fp4_mqa_logits((q, None), (kv, sf), w, ks, ke, 233)
    assert out.shape == (m, 233) and out.dtype == torch.float32 and out.stride(0) == 256
    for i in range(m):
        length = int(ke[i] - ks[i])
        want = ref_logits(q[i].float(), w[i], kv[ks[i]:ke[i]].float(), sf[ks[i]:ke[i]])
        assert close(out[i, :length], want), i
        assert (out[i, length:] == dg.POISON).all(), i


def test_mqa_logits_reading_past_kv_scores_zeros_and_a_row_wider_than_its_stride_spills_into_the_next():
    g = _gen(2)
    q, kv, w, sf = fp8(2, 32, D, g=g), fp8(40, D, g=g), torch.randn(2, 32, generator=g), torch.ones(40)
    ks, ke = torch.tensor([30, 0], dtype=torch.int32), torch.tensor([50, 10], dtype=torch.int32)  # ke 50 > N 40
    with SANITIZER.collect() as found:
        out = dg.fp8_fp4_mqa_logits((q, None), (kv, sf), w, ks, ke, 20)
    assert [(v.argument, v.op, v.lanes) for v in found] == [("kv", "load", 10)]
    assert (out[0, 10:20] == 0).all()
    assert close(out[0, :10], ref_logits(q[0].float(), w[0], kv[30:40].float(), sf[30:40]))
    ks, ke = torch.tensor([0, 0], dtype=torch.int32), torch.tensor([300, 10], dtype=torch.int32)
    with SANITIZER.collect() as found:  # 300 keys into rows of 256: 44 land in row 1's storage (row 1 rewrites them)
        out = dg.fp8_fp4_mqa_logits((q[:1].repeat(2, 1, 1), None), (kv.repeat(8, 1), sf.repeat(8)), w, ks, ke, 20)
    assert any(v.argument == "logits" and v.op == "store" and v.inside_allocation and v.lanes == 44 for v in found)


# -- get_paged_mqa_logits_metadata -----------------------------------------------------------------------------------

def test_metadata_splits_256_token_segments_over_sms_last_ones_one_more():
    # segments ceil(L / 256) of the last column: 2, 0, 4, 1 -> 7 over 4 SMs: 1, 2, 2, 2
    ctx = torch.tensor([[5, 300], [0, 0], [990, 1000], [1, 1]], dtype=torch.int32)
    meta = dg.get_paged_mqa_logits_metadata(ctx, 64, 4)
    assert meta.dtype == torch.int32 and meta.tolist() == [[0, 0], [0, 1], [2, 1], [2, 3], [4, 0]]
    assert dg.get_paged_mqa_logits_metadata(torch.zeros(3, 1, dtype=torch.int32), 32, 2).tolist() == [[3, 0]] * 3
    # fewer segments than SMs: the first SMs are empty (start == next start)
    assert dg.get_paged_mqa_logits_metadata(torch.tensor([[1], [1]], dtype=torch.int32), 64, 4).tolist() == \
        [[0, 0], [0, 0], [0, 0], [1, 0], [2, 0]]


# -- fp8_fp4_paged_mqa_logits ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("next_n,block_size", [(1, 64), (2, 64), (4, 64), (2, 32)])
def test_paged_rows_hold_every_position_below_the_last_length_then_poison(next_n, block_size):
    lens = [[max(0, length - next_n + 1 + j) for j in range(next_n)] for length in (70, 1, 300, 129)]
    q, cache, values, scales, w, ctx, table = paged_setup(next_n, lens, block_size=block_size, num_blocks=48)
    with SANITIZER.collect() as found:
        out = paged(q, cache, w, ctx, table, max_len=700)
    assert not found and out.shape == (4 * next_n, 700) and out.stride(0) == 768
    for b, row_lens in enumerate(lens):
        last = row_lens[-1]  # the kernel's length for all next_n rows: no per-row mask
        for n in range(next_n):
            got = out[b * next_n + n]
            assert close(got[:last], paged_ref_row(q, values, scales, w, table, b, n, last, next_n)), (b, n)
            assert (got[-(-last // 256) * 256:] == dg.POISON).all(), (b, n)


def test_past_the_length_the_split_holds_the_last_page_s_stale_tokens_then_block_zero():
    q, cache, values, scales, w, ctx, table = paged_setup(1, [[70]], block_size=32)
    out = paged(q, cache, w, ctx, table, max_len=256)[0]
    pos = torch.arange(256)
    page = pos // 32
    used = (pos // 64 < 2) & (page < 3)  # compute blocks < ceil(70 / 64), pages < ceil(70 / 32)
    blk = torch.where(used, table[0, page.clamp(max=table.shape[1] - 1)].long(), 0)
    want = ref_logits(q[0, 0].float(), w[0], values[blk, pos % 32].float(), scales[blk, pos % 32])
    assert close(out, want)


def test_the_cache_is_block_major_values_then_one_fp32_scale_per_token():
    bs, nb = 64, 3
    scales = torch.exp2(torch.arange(nb * bs, dtype=torch.float32).view(nb, bs) % 7 - 3)
    cache = paged_cache(torch.ones(nb, bs, D), scales)
    q, w = torch.ones(1, 1, 32, D).to(E4M3), torch.full((1, 32), 1 / (32 * D))
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    out = paged(q, cache, w, torch.tensor([[100]], dtype=torch.int32), table, max_len=128)[0]
    assert torch.equal(out[:64], scales[2]) and torch.equal(out[64:100], scales[0, :36])
    assert cache[2].reshape(-1)[bs * D:].view(torch.float32).equal(scales[2])


def test_a_request_without_context_gets_nothing():
    q, cache, values, scales, w, ctx, table = paged_setup(2, [[0, 0], [10, 11]])
    out = paged(q, cache, w, ctx, table, max_len=256)
    assert (out[:2] == dg.POISON).all() and close(out[2, :11], paged_ref_row(q, values, scales, w, table, 1, 0, 11, 2))


@pytest.fixture(autouse=True)
def _deep_gemm_2_8(monkeypatch):
    """The DeepGEMM the stand-in models (2.8.1: skip and q + 1 prefetch), whatever vLLM this host has installed."""
    monkeypatch.setattr(dg, "q_prefetch", lambda: "q+1")


def test_a_skipped_request_between_two_on_one_sm_hands_its_q_to_the_next(monkeypatch):
    """The TMA warp prefetches request q + 1's Q and weights when it starts q; the scheduler skips requests without
    KV, so the next request a cluster processes after a skipped one is scored with the skipped one's Q."""
    monkeypatch.setattr(dg, "NUM_SMS", 1)  # one cluster walks every request
    q, cache, values, scales, w, ctx, table = paged_setup(1, [[50], [0], [60]])
    out = paged(q, cache, w, ctx, table, max_len=256)
    assert close(out[0, :50], paged_ref_row(q, values, scales, w, table, 0, 0, 50, 1))
    assert (out[1] == dg.POISON).all()
    wrong_q = ref_logits(q[1, 0].float(), w[1], *[t[table[2, 0].long(), :60].float() for t in (values, scales)])
    assert close(out[2, :60], wrong_q)
    monkeypatch.setattr(dg, "NUM_SMS", 132)  # one request per SM: each loads its own Q
    assert close(paged(q, cache, w, ctx, table, max_len=256)[2, :60],
                 paged_ref_row(q, values, scales, w, table, 2, 0, 60, 1))


@pytest.mark.parametrize("prefetch", ["next task", "no skip"])
def test_releases_whose_prefetch_follows_the_scheduler_score_each_request_with_its_own_q(monkeypatch, prefetch):
    """vLLM 0.28.0-0.29.0 prefetch the scheduler's next task; up to 0.27 a request without KV is a task of its own."""
    monkeypatch.setattr(dg, "NUM_SMS", 1)
    monkeypatch.setattr(dg, "q_prefetch", lambda: prefetch)
    q, cache, values, scales, w, ctx, table = paged_setup(1, [[50], [0], [60]])
    out = paged(q, cache, w, ctx, table, max_len=256)
    assert close(out[2, :60], paged_ref_row(q, values, scales, w, table, 2, 0, 60, 1))
    assert (out[1] == dg.POISON).all() == (prefetch == "next task")  # a task of its own writes its row (block 0)


@pytest.mark.parametrize("scheduler, kernel, want", [
    (None, None, "q+1"),  # no headers (a Python-only vLLM): the DeepGEMM modelled
    ("fetch_next_task() { ... }", "issue_tma_q(q_stage_idx, q_idx + 1);", "no skip"),  # 0.23.0-0.27.0
    ("while (current_num_kv == 0 and", "issue_tma_q(q_stage_idx, next_q_idx);", "next task"),  # 0.28.0, 0.29.0
    ("while (current_num_kv == 0 and", "issue_tma_q(q_stage_idx, q_idx + 1);", "q+1"),  # 0.30.0 on
])
def test_the_prefetch_is_read_from_the_vendored_headers(tmp_path, scheduler, kernel, want):
    if kernel is not None:
        (tmp_path / "scheduler").mkdir()
        (tmp_path / "impls").mkdir()
        (tmp_path / "scheduler" / "sm90_paged_mqa_logits.cuh").write_text(scheduler)
        (tmp_path / "impls" / "sm90_fp8_paged_mqa_logits.cuh").write_text(kernel)
    assert dg.q_prefetch_of(tmp_path) == want


def test_out_of_range_block_table_entries_are_recorded_and_read_as_zeros():
    q, cache, values, scales, w, ctx, table = paged_setup(1, [[200]], num_blocks=8)
    table[0, 1], table[0, 2] = -1, 8  # pages 1 and 2: before and past the cache
    with SANITIZER.collect() as found:
        out = paged(q, cache, w, ctx, table, max_len=256)[0]
    assert [(v.argument, v.op, v.lanes) for v in found] == [("kv_cache", "load", 2)]
    assert (out[64:192] == 0).all() and close(out[:64], paged_ref_row(q, values, scales, w, table, 0, 0, 64, 1))


def test_pages_past_the_table_s_width_read_the_next_row_and_lengths_past_the_row_write_into_the_next():
    q, cache, values, scales, w, ctx, table = paged_setup(1, [[200], [64]], width=2)
    with SANITIZER.collect() as found:  # request 0 needs 4 pages of a 2-wide table: pages 2, 3 are row 1's entries
        out = paged(q, cache, w, ctx, table, max_len=256)
    assert [(v.argument, v.inside_allocation, v.lanes) for v in found] == [("block_table", True, 2)]
    keys = values[table.reshape(-1)[2].long()].float()
    assert close(out[0, 128:192], ref_logits(q[0, 0].float(), w[0], keys, scales[table.reshape(-1)[2].long()]))
    q, cache, values, scales, w, ctx, table = paged_setup(1, [[300], [10]])
    with SANITIZER.collect() as found:  # 300 positions into rows of 256: row 1's first 44 columns, then row 1's own
        paged(q, cache, w, ctx, table, max_len=256)
    assert [(v.argument, v.op, v.inside_allocation, v.lanes) for v in found] == [("logits", "store", True, 256)]
    with SANITIZER.collect() as found:  # the last row: past the allocation
        paged(q, cache, w, torch.tensor([[10], [300]], dtype=torch.int32), table, max_len=256)
    assert [(v.argument, v.inside_allocation, v.lanes) for v in found] == [("logits", False, 256)]


def test_a_schedule_for_other_lengths_hangs_when_they_were_longer_and_only_rebalances_when_shorter():
    q, cache, _values, _scales, w, ctx, table = paged_setup(1, [[600], [100]])
    fresh = paged(q, cache, w, ctx, table, max_len=768)
    shorter = dg.get_paged_mqa_logits_metadata(torch.tensor([[100], [100]], dtype=torch.int32), 64, dg.NUM_SMS)
    out = dg.fp8_fp4_paged_mqa_logits((q, None), cache, w, ctx, table, shorter, 768)
    assert close(out[:, :600], fresh[:, :600].double()) and (out[1, 256:] == dg.POISON).all()
    longer = dg.get_paged_mqa_logits_metadata(torch.tensor([[600], [100]], dtype=torch.int32), 64, dg.NUM_SMS)
    with pytest.raises(RuntimeError, match="hangs"):  # a cluster's range ends inside request 0's splits it lacks
        dg.fp8_fp4_paged_mqa_logits((q, None), cache, w, torch.tensor([[100], [100]], dtype=torch.int32), table,
                                    longer, 768)
    bad = shorter.clone()
    bad[0] = torch.tensor([5, 0])  # a start past its end
    with pytest.raises(RuntimeError, match="hangs"):
        dg.fp8_fp4_paged_mqa_logits((q, None), cache, w, ctx, table, bad, 768)


@pytest.mark.parametrize("change,match", [
    ({"ctx1d": True}, r"context_lens.dim\(\) == 2"),
    ({"next_n": 3}, "next_n == 1 or next_n == 2 or next_n == 4"),
    ({"q_dtype": torch.bfloat16}, "q_fp.scalar_type"),
    ({"q_sf": True}, "FP4 / MX scales not modelled|is_mx_sf"),
    ({"fp4": True}, "FP4 Q is not modelled"),
    ({"indices": True}, "is_varlen"),
    ({"block_size": 16}, "block_kv == 32 or block_kv == 64"),
    ({"heads": 16}, "num_heads == 32 or num_heads == 64"),
    ({"meta_rows": 10}, "_schedule_meta_size"),
])
def test_refused_call_forms(change, match):
    next_n = change.get("next_n", 1)
    q, cache, _values, _scales, w, ctx, table = paged_setup(next_n, [[10] * next_n], heads=change.get("heads", 32),
                                                          block_size=change.get("block_size", 64))
    meta = torch.zeros(change.get("meta_rows", dg.NUM_SMS + 1), 2, dtype=torch.int32)
    q_sf = torch.zeros(q.shape[:-1], dtype=torch.int32) if change.get("q_sf") else None
    if change.get("q_dtype"):
        q = q.to(change["q_dtype"])
    if change.get("fp4"):
        q = q.view(torch.int8)[..., : D // 2].contiguous()
    with pytest.raises(RuntimeError, match=match):
        dg.fp8_fp4_paged_mqa_logits((q, q_sf), cache, w, ctx.view(-1) if change.get("ctx1d") else ctx, table, meta,
                                    256, indices=torch.zeros(1, dtype=torch.int32) if change.get("indices") else None)
    with pytest.raises(RuntimeError, match=r"context_lens.dim\(\) == 2"):
        dg.get_paged_mqa_logits_metadata(torch.ones(3, dtype=torch.int32), 64, 132)
    with pytest.raises(RuntimeError, match="not schedule_meta.has_value"):
        g = _gen()
        dg.fp8_fp4_mqa_logits((fp8(2, 32, D, g=g), None), (fp8(4, D, g=g), torch.ones(4)), torch.ones(2, 32),
                              torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32), 4,
                              schedule_meta=torch.zeros(1))


def test_logits_dtype_other_than_fp32_is_refused_not_computed():
    """0.34's wrappers pass logits_dtype; SM90's kernels store fp32 only, and vLLM asks bf16 only of SM100's."""
    from fuzzer.support.errors import StandInRefused

    q, cache, _values, _scales, w, ctx, table = paged_setup(1, [[10]], heads=32, block_size=64)
    meta = dg.get_paged_mqa_logits_metadata(ctx, 64, dg.NUM_SMS)
    fp32 = dg.fp8_fp4_paged_mqa_logits((q, None), cache, w, ctx, table, meta, 256, logits_dtype=torch.float32)
    assert torch.equal(fp32, dg.fp8_fp4_paged_mqa_logits((q, None), cache, w, ctx, table, meta, 256))
    with pytest.raises(StandInRefused, match="logits_dtype=torch.bfloat16"):
        dg.fp8_fp4_paged_mqa_logits((q, None), cache, w, ctx, table, meta, 256, logits_dtype=torch.bfloat16)
    g = _gen()
    with pytest.raises(StandInRefused, match="logits_dtype"):
        dg.fp8_fp4_mqa_logits((fp8(2, 32, D, g=g), None), (fp8(4, D, g=g), torch.ones(4)), torch.ones(2, 32),
                              torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32), 4,
                              logits_dtype=torch.bfloat16)


def test_standin_module_names_the_three_functions_as_deep_gemm_does():
    ns = dg.standin_module()
    assert (ns.fp8_fp4_mqa_logits, ns.fp8_fp4_paged_mqa_logits, ns.get_paged_mqa_logits_metadata) == \
        (dg.fp8_fp4_mqa_logits, dg.fp8_fp4_paged_mqa_logits, dg.get_paged_mqa_logits_metadata)
    assert "2.8.1" in dg.DEEP_GEMM_SOURCE and "sm90_fp8_paged_mqa_logits.cuh" in dg.DEEP_GEMM_SOURCE
