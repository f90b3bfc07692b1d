"""attnfuzz's stand-in of FlashInfer's trtllm_batch_decode_sparse_mla_dsv4 (SM100, trtllm-gen) as vLLM's DeepSeek-V4
FlashInfer layers call it: a varlen query, one table whose first 128 columns index the SWA pool (the first
min(128, pos + 1) of them active, pos from seq_lens and cum_seq_lens_q) and the rest the compressed pool (active up to
sparse_topk_lens), entries as storage rows (the packed layout's page stride). At the edges: a query at position 0,
a row of no compressed entry, a -1 inside an active segment, the last row of the last page and one past it, a
packed page's other rows, fp8 rows, the sink; FlashInfer's own checks; what is refused. No vLLM."""

import math

import pytest
import torch

from fuzzer.support.errors import StandInRefused
from fuzzer.support.standins import flashinfer_dsv4_mla as fi
from fuzzer.support.standins import flashinfer_trtllm_mla
from tests.fuzzer.support.sanitized import violations_during as _violations

H, SCALE = 8, 0.05
WS = torch.zeros(1 << 10, dtype=torch.uint8)


@pytest.fixture(autouse=True)
def _clear():
    flashinfer_trtllm_mla.UNDOCUMENTED.clear()
    yield
    flashinfer_trtllm_mla.UNDOCUMENTED.clear()


def _pool(pages, rows, dtype=torch.bfloat16, pad=0, seed=0):
    """[pages, rows, 512] plain rows; `pad` rows of another component after each page's own (NaN: never read)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.full((pages, rows + pad, 512), float("nan"))
    raw[:, :rows] = torch.randn(pages, rows, 512, generator=g)
    raw = raw.to(dtype)
    return raw[:, :rows]


def _call(q, swa, comp, table, lens, seq_lens, cu, **kw):
    kw = {**dict(bmm1_scale=SCALE, bmm2_scale=1.0, sparse_indices_are_storage_offsets=True), **kw}
    return fi.trtllm_batch_decode_sparse_mla_dsv4(
        query=q, swa_kv_cache=swa, workspace_buffer=WS, sparse_indices=table, compressed_kv_cache=comp,
        sparse_topk_lens=lens, seq_lens=seq_lens, cum_seq_lens_q=cu, max_q_len=int((cu[1:] - cu[:-1]).max()), **kw)


def _flat(pool):
    """Storage rows of a pool: row e at e x its token stride from its base."""
    return fi._rows(pool.unsqueeze(1))


def _ref(q, keys, sink=None):
    s = (q.float() @ keys.float().T) * SCALE
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ keys.float()
    if sink is not None:
        out = out * torch.sigmoid(lse - sink)[:, None]
    return out


def _table(rows, width=132):
    t = torch.full((len(rows), width), -1, dtype=torch.int32)
    for i, (swa, comp) in enumerate(rows):
        t[i, : len(swa)] = torch.tensor(swa, dtype=torch.int32)
        t[i, 128: 128 + len(comp)] = torch.tensor(comp, dtype=torch.int32)
    return t


def test_swa_columns_follow_the_query_position_and_compressed_ones_the_length():
    """Request 0 (seq_len 3, 2 query tokens: positions 1 and 2) takes 2 then 3 SWA columns; a fourth SWA entry written
    in each row is not read. Its second token also takes two compressed entries (length 130)."""
    swa, comp = _pool(1, 64), _pool(1, 64, seed=1)
    q = torch.randn(2, H, 512).bfloat16()
    table = _table([([0, 1, 2, 7], [5, 6]), ([0, 1, 2, 7], [5, 6])])
    lens = torch.tensor([128, 130], dtype=torch.int32)
    out = _call(q, swa, comp, table, lens, torch.tensor([3], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32))
    rows_s, rows_c = _flat(swa), _flat(comp)
    torch.testing.assert_close(out[0].float(), _ref(q[0], rows_s[[0, 1]]), atol=2e-2, rtol=2e-2)
    keys = torch.cat([rows_s[[0, 1, 2]], rows_c[[5, 6]]])
    torch.testing.assert_close(out[1].float(), _ref(q[1], keys), atol=2e-2, rtol=2e-2)
    assert not flashinfer_trtllm_mla.UNDOCUMENTED


def test_storage_rows_cross_a_packed_page_and_its_other_rows_are_a_gap_read():
    """Under the packed layout (page stride 8 + 4 rows) entry 12 is page 1's row 0; entry 9 lies in page 0's other
    rows: recorded (GapRead, inside the allocation) and skipped, never read as a key."""
    swa = _pool(2, 8, pad=4)
    q = torch.randn(1, H, 512).bfloat16()
    good = _call(q, swa, swa, _table([([12], [])]), torch.tensor([128], dtype=torch.int32),
                 torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
    torch.testing.assert_close(good[0].float(), _ref(q[0], swa[1, :1]), atol=2e-2, rtol=2e-2)
    out, found = _violations(lambda: _call(q, swa, swa, _table([([12, 9], [])]), torch.tensor([128], dtype=torch.int32),
                                           torch.tensor([2], dtype=torch.int32),
                                           torch.tensor([0, 1], dtype=torch.int32)))
    assert len(found) == 1 and isinstance(found[0], fi.GapRead) and found[0].inside_allocation
    assert torch.isfinite(out.float()).all()


def test_the_last_row_is_read_and_one_past_the_allocation_is_a_violation():
    swa = _pool(2, 8)
    q = torch.randn(1, H, 512).bfloat16()
    args = (torch.tensor([128], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32))
    out, found = _violations(lambda: _call(q, swa, swa, _table([([15], [])]), *args))
    assert not found
    torch.testing.assert_close(out[0].float(), _ref(q[0], swa[1, 7:8]), atol=2e-2, rtol=2e-2)
    _, found = _violations(lambda: _call(q, swa, swa, _table([([16], [])]), *args))
    assert len(found) == 1 and not found[0].inside_allocation and found[0].argument == "swa_kv_cache"


def test_a_minus_one_inside_an_active_segment_is_not_public_and_reads_a_zero_row():
    swa = _pool(1, 8)
    q = torch.randn(1, H, 512).bfloat16()
    out = _call(q, swa, swa, _table([([3, -1], [])]), torch.tensor([128], dtype=torch.int32),
                torch.tensor([2], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
    keys = torch.cat([swa[0, 3:4].float(), torch.zeros(1, 512)])
    torch.testing.assert_close(out[0].float(), _ref(q[0], keys), atol=2e-2, rtol=2e-2)
    assert any("-1 entry" in what for what, _ in flashinfer_trtllm_mla.UNDOCUMENTED)


def test_tokens_past_the_last_request_are_not_written_and_the_sink_scales():
    """A CUDA-graph padding token (past cum_seq_lens_q[-1]) keeps its output row; the sink multiplies by
    sigmoid(lse - sink) per head (natural log)."""
    swa = _pool(1, 8)
    q = torch.randn(2, H, 512).bfloat16()
    sink = torch.randn(H)
    out = torch.full((2, H, 512), float("nan"), dtype=torch.bfloat16)
    _call(q, swa, swa, _table([([0], []), ([1], [])]), torch.tensor([128, 128], dtype=torch.int32),
          torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), out=out, sinks=sink)
    torch.testing.assert_close(out[0].float(), _ref(q[0], swa[0, :1], sink), atol=2e-2, rtol=2e-2)
    assert torch.isnan(out[1].float()).all()


def test_fp8_rows_and_query_attend_in_their_values():
    swa = _pool(1, 8, dtype=torch.float8_e4m3fn)
    q = torch.randn(1, H, 512).to(torch.float8_e4m3fn)
    out = _call(q, swa, swa, _table([([0, 1], [])]), torch.tensor([128], dtype=torch.int32),
                torch.tensor([2], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out[0].float(), _ref(q[0].float(), swa[0, :2].float()), atol=3e-2, rtol=3e-2)


def test_lengths_outside_the_validated_range_are_not_public():
    swa = _pool(1, 8)
    q = torch.randn(1, H, 512).bfloat16()
    _call(q, swa, swa, _table([([0], [])]), torch.tensor([100], dtype=torch.int32),
          torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
    assert any("sparse_topk_lens outside" in what for what, _ in flashinfer_trtllm_mla.UNDOCUMENTED)


@pytest.mark.parametrize("kw, message", [
    (dict(swa_topk_lens=torch.zeros(1, dtype=torch.int32)), "only supported on SM120"),
    (dict(hca_seq_lens=torch.zeros(1, dtype=torch.int32)), "does not accept hca_seq_lens"),
])
def test_flashinfer_s_own_checks_raise_value_error(kw, message):
    swa = _pool(1, 8)
    q = torch.randn(1, H, 512).bfloat16()
    with pytest.raises(ValueError, match=message):
        _call(q, swa, swa, _table([([0], [])]), torch.tensor([128], dtype=torch.int32),
              torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), **kw)


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "query": a["query"][:, :6]}, "8, 16, 32, 64, or 128 query heads"),
    (lambda a: {**a, "sparse_indices": a["sparse_indices"][:, :126]}, "fixed 128 SWA entries"),
    (lambda a: {**a, "sparse_indices": a["sparse_indices"][:, :130]}, "multiple of 4"),
    (lambda a: {**a, "compressed_kv_cache": a["compressed_kv_cache"].float()}, "dtype must match"),
    (lambda a: {**a, "kv_layout": "NHD"}, "only valid for kv_layout='HND'"),
    (lambda a: {**a, "sparse_topk_lens": a["sparse_topk_lens"].long()}, "torch.int32"),
])
def test_input_checks_in_flashinfer_s_order(change, message):
    swa = _pool(1, 8)
    args = dict(query=torch.randn(1, H, 512).bfloat16(), swa_kv_cache=swa, workspace_buffer=WS,
                sparse_indices=_table([([0], [])]), compressed_kv_cache=swa,
                sparse_topk_lens=torch.tensor([128], dtype=torch.int32), seq_lens=torch.tensor([1], dtype=torch.int32),
                cum_seq_lens_q=torch.tensor([0, 1], dtype=torch.int32), max_q_len=1, bmm1_scale=SCALE,
                sparse_indices_are_storage_offsets=True)
    with pytest.raises(ValueError, match=message):
        fi.trtllm_batch_decode_sparse_mla_dsv4(**change(args))


@pytest.mark.parametrize("kw", [dict(sparse_indices_are_storage_offsets=False), dict(backend="trtllm-gen"),
                                dict(bmm1_scale=torch.tensor([SCALE])),
                                dict(dsv4_output_scale=torch.zeros(1, dtype=torch.int32))])
def test_call_forms_vllm_never_makes_are_refused(kw):
    swa = _pool(1, 8)
    q = torch.randn(1, H, 512).bfloat16()
    with pytest.raises(StandInRefused):
        _call(q, swa, swa, _table([([0], [])]), torch.tensor([128], dtype=torch.int32),
              torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), **kw)


def test_a_token_with_no_key_is_zero():
    """seq_lens under the query length (position < 0): no SWA column, no compressed one; out 0 (the test's reference
    for a query with nothing to attend to), and said not public."""
    swa = _pool(1, 8)
    q = torch.randn(2, H, 512).bfloat16()
    out = _call(q, swa, swa, _table([([0], []), ([0], [])]), torch.tensor([128, 128], dtype=torch.int32),
                torch.tensor([1], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32))
    assert out[0].float().abs().max() == 0 and math.isfinite(out[1].float().abs().max())
    assert any("seq_lens under" in what for what, _ in flashinfer_trtllm_mla.UNDOCUMENTED)
