"""attnfuzz's stand-in of FlashInfer's trtllm_batch_decode_with_kv_cache_mla in the sparse forms vLLM's Blackwell
backends call: SM100 (trtllm-gen: a page table of flat cache rows bounded by seq_lens, bmm scales) and SM120 (the
"sparse" kernel: -1 entries masked, 656-byte fp8_ds_mla rows, pow2 vs arbitrary scale formats). At the edges: empty
rows, -1 entries, the last partial page, the scale layout; what FlashInfer refuses, and what the stand-in does not
model (could-not-test). No vLLM."""

import importlib.util
import math

import pytest
import torch

from fuzzer.support.errors import StandInRefused
from fuzzer.support.standins import flashinfer_trtllm_mla as fi
from tests.fuzzer.support.sanitized import violations_during as _violations

H, W, SCALE = 8, 16, 0.1
WS = torch.zeros(1 << 20, dtype=torch.int8)


def _sm100(q, cache, table, lens, **kw):
    """As vLLM's FlashInferMLASparseImpl._forward_mqa_kernel calls it: one query token a request."""
    kw = {**dict(bmm1_scale=SCALE, bmm2_scale=1.0, workspace_buffer=WS), **kw}
    return fi.SM100(query=q.unsqueeze(1), kv_cache=cache.unsqueeze(1), qk_nope_head_dim=128,
                    kv_lora_rank=512, qk_rope_head_dim=64, block_tables=table.unsqueeze(1), seq_lens=lens,
                    max_seq_len=table.shape[1], sparse_mla_top_k=table.shape[1], **kw)


def _reference(q, rows, table, counts, scale=SCALE):
    out = []
    for t, c in enumerate(counts):
        k = rows[table[t, :c].long()].float()
        out.append(torch.softmax((q[t].float() @ k.T) * scale, -1) @ k[:, :512])
    return torch.stack(out)


@pytest.fixture(autouse=True)
def _clear():
    fi.UNDOCUMENTED.clear()
    yield
    fi.UNDOCUMENTED.clear()


def test_sm100_attends_to_the_first_seq_lens_entries_of_each_row_as_flat_cache_rows():
    """Entries are rows of the cache viewed flat, whatever its page size (one token a page for sparse MLA); entries
    past seq_lens (vLLM's -1 padding) are never read. The last page's last row is inside the cache."""
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(3, 32, 576, generator=g).bfloat16()  # pages of 32 rows: 96 rows
    q = torch.randn(3, H, 576, generator=g).bfloat16()
    table = torch.full((3, W), -1, dtype=torch.int32)
    table[0, :4] = torch.tensor([0, 5, 40, 95])  # 95: the last row of the last page
    table[1, :1] = 33
    table[2, :W] = torch.arange(W) + 64
    lens = torch.tensor([4, 1, W], dtype=torch.int32)
    out, found = _violations(lambda: _sm100(q, cache, table, lens))
    assert not found and not fi.UNDOCUMENTED
    torch.testing.assert_close(out[:, 0].float(), _reference(q, cache.view(-1, 576), table, [4, 1, W]),
                               atol=1e-2, rtol=1e-2)


def test_sm100_fp8_takes_an_fp8_query_and_applies_the_bmm_scales():
    """vLLM folds q_scale * k_scale into bmm1_scale and k_scale into bmm2_scale; the kernel reads e4m3 q and cache."""
    g = torch.Generator().manual_seed(1)
    k_scale, q_scale = 0.05, 0.02
    values = torch.randn(64, 576, generator=g) * 0.5
    cache = (values / k_scale).to(torch.float8_e4m3fn).view(2, 32, 576)
    q = (torch.randn(2, H, 576, generator=g) * 0.25 / q_scale).to(torch.float8_e4m3fn)
    table = torch.tensor([[3, 9, 60, -1], [0, -1, -1, -1]], dtype=torch.int32)
    out = _sm100(q, cache, table, torch.tensor([3, 1], dtype=torch.int32), bmm1_scale=SCALE * q_scale * k_scale,
                 bmm2_scale=k_scale)
    rows = cache.view(-1, 576).float() * k_scale
    want = _reference(q.float() * q_scale, rows, table, [3, 1])
    torch.testing.assert_close(out[:, 0].float(), want, atol=2e-2, rtol=2e-2)
    with pytest.raises(RuntimeError, match="matching query and kv_cache dtypes"):  # bf16 q over an fp8 cache
        _sm100(q.float().bfloat16(), cache, table, torch.tensor([3, 1], dtype=torch.int32))


def test_sm100_an_empty_row_and_a_minus_one_inside_seq_lens_are_named_not_public():
    """A row of length 0: its output is not public (left NaN, said so). A -1 inside a row's length: read as a zero row
    (the TMA descriptor's out-of-bounds fill), said so; an entry past the cache: a memory violation, skipped."""
    g = torch.Generator().manual_seed(2)
    cache = torch.randn(2, 64, 576, generator=g).bfloat16()
    q = torch.randn(3, H, 576, generator=g).bfloat16()
    table = torch.tensor([[1, 2, -1, -1], [-1, -1, -1, -1], [4, 128, 5, -1]], dtype=torch.int32)  # 128: past 2 pages
    lens = torch.tensor([3, 0, 3], dtype=torch.int32)
    out, found = _violations(lambda: _sm100(q, cache, table, lens))
    notes = dict(fi.UNDOCUMENTED)
    assert any("seq_lens 0" in w for w in notes) and any("-1 entry inside seq_lens" in w for w in notes)
    assert [rows for w, rows in fi.UNDOCUMENTED if "seq_lens 0" in w] == [[1]]
    assert torch.isnan(out[1].float()).all() and torch.isfinite(out[[0, 2]].float()).all()
    assert [(v.argument, v.byte_offset // (576 * 2)) for v in found] == [("kv_cache", 128)]
    rows = cache.view(-1, 576).float()
    s = (q[0].float() @ rows[[1, 2]].T) * SCALE  # the -1 entry: a zero key and value with score 0
    p = torch.softmax(torch.cat([s, torch.zeros(H, 1)], -1), -1)
    torch.testing.assert_close(out[0, 0].float(), p[:, :2] @ rows[[1, 2], :512], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out[2, 0].float(), _reference(q[2:], rows, torch.tensor([[4, 5]]), [2])[0],
                               atol=1e-2, rtol=1e-2)


def test_sm100_misuse_raises_as_flashinfer_does_and_unmodelled_forms_are_refused():
    cache = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    q = torch.zeros(1, H, 576, dtype=torch.bfloat16)
    table = torch.zeros(1, 8, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="trtllm-gen requires block_size in \\(32, 64\\)"):
        _sm100(q, cache.view(1, 128, 576), table, lens)
    with pytest.raises(ValueError, match="64 < num_heads_q < 128"):
        _sm100(torch.zeros(1, 96, 576, dtype=torch.bfloat16), cache, table, lens)
    with pytest.raises(ValueError, match="seq_lens is required"):
        _sm100(q, cache, table, None)
    with pytest.raises(ValueError, match="Expected page_table.shape"):
        fi.SM100(q.unsqueeze(1), cache.unsqueeze(1), WS, 128, 512, 64, table.unsqueeze(1), lens, 8,
                 sparse_mla_top_k=16)
    with pytest.raises(RuntimeError, match="multiple of 4"):
        _sm100(q, cache, torch.zeros(1, 6, dtype=torch.int32), lens)
    with pytest.raises(StandInRefused):
        _sm100(q, cache, table, lens, enable_dcp=True)
    with pytest.raises(StandInRefused):
        fi.SM100(q.unsqueeze(1), cache.unsqueeze(1), WS, 128, 512, 64, table.unsqueeze(1), lens, 8)  # dense MLA
    assert StandInRefused.attnfuzz_refused and issubclass(StandInRefused, NotImplementedError)


def test_sm100_lse_is_base_2_unless_asked_and_the_softmax_stats_slab_must_fit_the_workspace():
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(1, 32, 576, generator=g).bfloat16()
    q = torch.randn(1, H, 576, generator=g).bfloat16()
    table = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    lens = torch.tensor([4], dtype=torch.int32)
    (out, lse2), found = _violations(lambda: _sm100(q, cache, table, lens, return_lse=True))
    assert [v.argument for v in found] == ["workspace_buffer"]  # 1 MiB: no room for the slab and its 1 MiB guard
    s = (q[0].float() @ cache[0, :4].float().T) * SCALE
    torch.testing.assert_close(lse2, (torch.logsumexp(s, -1) / math.log(2))[None], atol=1e-3, rtol=1e-3)
    big = torch.zeros(4 << 20, dtype=torch.int8)
    (_, lse_e), found = _violations(lambda: _sm100(q, cache, table, lens, return_lse=True, return_lse_base="basee",
                                                   workspace_buffer=big))
    assert not found
    torch.testing.assert_close(lse_e, torch.logsumexp(s, -1)[None], atol=1e-3, rtol=1e-3)


def _entries(values: torch.Tensor, convention: str) -> torch.Tensor:
    """656-byte fp8_ds_mla entries (vLLM's layout): 512 e4m3, four fp32 tile scales, 64 bf16 RoPE."""
    tiles = values[:, :512].unflatten(-1, (4, 128))
    scale = (tiles.abs().amax(-1) / 448).clamp_min(1e-4)
    if convention == "pow2":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    nope = (tiles / scale[..., None]).to(torch.float8_e4m3fn).flatten(-2).view(torch.uint8)
    return torch.cat([nope, scale.view(torch.uint8), values[:, 512:].bfloat16().view(torch.uint8)], -1)


def _sm120(q, cache, table, kv_scale_format="pow2_fp32", **kw):
    """As vLLM's FlashInferMLASparseSM120Impl._run_mqa_kernel calls it: 64-row pages, seq_lens None."""
    out = torch.empty(q.shape[0], q.shape[1], 512, dtype=torch.bfloat16)
    return fi.SM120(query=q.unsqueeze(1), kv_cache=cache.unsqueeze(1), workspace_buffer=WS, qk_nope_head_dim=128,
                    kv_lora_rank=512, qk_rope_head_dim=64, block_tables=table.unsqueeze(1), seq_lens=None,
                    max_seq_len=table.shape[1], out=out.unsqueeze(1), bmm1_scale=SCALE,
                    bmm2_scale=1.0, sparse_mla_top_k=table.shape[1], kv_scale_format=kv_scale_format, **kw)


def _dequant(entries, qk_pow2: bool):
    nope = entries[:, :512].contiguous().view(torch.float8_e4m3fn).float().unflatten(-1, (4, 128))
    scale = entries[:, 512:528].contiguous().view(torch.float32)
    k_scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32) if qk_pow2 else scale
    rope = entries[:, 528:].contiguous().view(torch.bfloat16).float()
    return torch.cat([(nope * k_scale[..., None]).flatten(-2), rope], -1), (nope * scale[..., None]).flatten(-2)


@pytest.mark.parametrize("convention,fmt", [("pow2", "pow2_fp32"), ("arbitrary", "arbitrary_fp32"),
                                            ("arbitrary", "pow2_fp32")])
def test_sm120_reads_the_656_byte_entry_with_its_scale_format_and_masks_minus_one_anywhere(convention, fmt):
    """-1 entries may sit anywhere in a row (no lengths): masked, never read. pow2_fp32 feeds the QK product the
    exponent of each tile scale (a stored 0.75 reads 0.5 there) and the PV product the scale as stored; arbitrary_fp32
    the stored scale in both. Row r of page p is entry p * 64 + r; the last page's last row is in the cache."""
    g = torch.Generator().manual_seed(4)
    values = torch.randn(128, 576, generator=g) * 0.3
    entries = _entries(values, convention)
    cache = entries.view(2, 64, 656)
    q = torch.randn(2, H, 576, generator=g).bfloat16()
    table = torch.tensor([[-1, 7, -1, 127, 3, -1, -1, -1], [64, -1, -1, -1, -1, -1, -1, 65]], dtype=torch.int32)
    out, found = _violations(lambda: _sm120(q, cache, table, fmt))
    assert not found
    keys, vals = _dequant(entries, fmt == "pow2_fp32")
    want = []
    for t, picks in enumerate(([7, 127, 3], [64, 65])):
        s = (q[t].float() @ keys[picks].T) * SCALE
        want.append(torch.softmax(s, -1) @ vals[picks])
    torch.testing.assert_close(out[:, 0].float(), torch.stack(want), atol=1e-2, rtol=1e-2)
    if convention == "arbitrary" and fmt == "pow2_fp32":  # truncated QK scales move the scores
        exact, _ = _dequant(entries, False)
        s = (q[0].float() @ exact[[7, 127, 3]].T) * SCALE
        assert not torch.allclose(out[0, 0].float(), torch.softmax(s, -1) @ vals[[7, 127, 3]], atol=1e-3, rtol=1e-3)


def test_sm120_a_row_of_no_candidate_gives_0_and_lse_minus_inf_and_an_entry_past_the_cache_is_a_violation():
    g = torch.Generator().manual_seed(5)
    cache = _entries(torch.randn(64, 576, generator=g), "pow2").view(1, 64, 656)
    q = torch.randn(2, H, 576, generator=g).bfloat16()
    table = torch.tensor([[-1, -1, -1, -1], [2, 64, -1, 1]], dtype=torch.int32)  # 64: one past the last row
    (out, lse), found = _violations(lambda: _sm120(q, cache, table, return_lse=True))
    assert (out[0].float() == 0).all() and (lse[0] == -math.inf).all() and torch.isfinite(out[1].float()).all()
    assert [(v.argument, v.byte_offset // 656) for v in found] == [("kv_cache", 64)]
    assert not fi.UNDOCUMENTED


def test_sm120_misuse_raises_as_flashinfer_does_and_unmodelled_forms_are_refused():
    cache = torch.zeros(1, 64, 656, dtype=torch.uint8)
    q = torch.zeros(1, H, 576, dtype=torch.bfloat16)
    table = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="expects BF16 query"):
        _sm120(q.float(), cache, table)
    with pytest.raises(ValueError, match="does not support bmm2_scale"):
        fi.SM120(q.unsqueeze(1), cache.unsqueeze(1), WS, 128, 512, 64, table.unsqueeze(1), None, 4,
                 sparse_mla_top_k=4, bmm2_scale=2.0)
    with pytest.raises(ValueError, match="packed uint8 kv_cache"):
        _sm120(q, cache.view(torch.float8_e4m3fn), table)
    with pytest.raises(ValueError, match="block_tables must have dtype torch.int32"):
        _sm120(q, cache, table.long())
    with pytest.raises(ValueError, match="sparse block_tables shape"):
        fi.SM120(q.unsqueeze(1), cache.unsqueeze(1), WS, 128, 512, 64, table.unsqueeze(1), None, 4,
                 sparse_mla_top_k=8)
    with pytest.raises(ValueError, match="kv_scale_format must be one of"):
        _sm120(q, cache, table, "fp16")
    with pytest.raises(StandInRefused):
        _sm120(q, cache, table, "ue8m0_g32")


def test_the_entry_points_are_importable_as_flashinfer_decode_only_inside_the_block():
    assert importlib.util.find_spec("flashinfer") is None
    with fi.importable(10):
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla

        assert trtllm_batch_decode_with_kv_cache_mla is fi.SM100
    assert importlib.util.find_spec("flashinfer") is None
