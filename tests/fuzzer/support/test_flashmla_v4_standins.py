"""FlashMLA's sparse decode stand-in on DeepSeek-V4's 584-byte layout (fuzzer/support/standins/flashmla_ops.py),
against what flash_mla_interface.py documents: indices are page * page_size + offset, -1 is skipped, only the
leftmost topk_length (extra_topk_length) indices are read, the extra cache is attended together with the first,
attn_sink scales the output by exp(lse) / (exp(lse) + exp(sink)) (+inf: 0) and leaves the LSE alone, a sched_meta
is reused only with the shapes it was made for; an index outside the cache is a memory fault (no vLLM here)."""

import pytest
import torch

from fuzzer.support.interp.sanitizer import SANITIZER
from fuzzer.support.standins import flashmla_ops as ops
from oracles import fp8_ds_mla_v4 as v4
from strategies.dsv4_tensors import write_v4_records

SCALE = 512**-0.5


def cache(values: torch.Tensor, entries: int, blocks: int):
    """(k_cache [blocks, entries, 1, 584] as the layer hands it, the dequantized value of each slot)."""
    pages = torch.full((blocks, v4.page_bytes(entries)), 255, dtype=torch.uint8)
    slots = torch.arange(len(values))
    write_v4_records(pages, slots, values, entries)
    view = torch.as_strided(pages, (blocks, entries, 1, 584), (pages.shape[1], 584, 584, 1))
    return view, v4.dequantize(v4.read_records(pages, slots, entries))


def attend(q, keys, sink=None):
    s = (q.double() @ keys.double().T) * SCALE
    lse = torch.logsumexp(s, dim=-1)
    out = torch.softmax(s, dim=-1) @ keys.double()
    if sink is not None:
        out = out * torch.sigmoid(lse - sink.double())[:, None]
    return out, lse


@pytest.fixture
def setup():
    g = torch.Generator().manual_seed(0)
    swa, swa_values = cache(torch.randn(100, 512, generator=g).to(torch.bfloat16), 64, 3)
    extra, extra_values = cache(torch.randn(7, 512, generator=g).to(torch.bfloat16), 2, 5)
    q = torch.randn(2, 1, 64, 512, generator=g).to(torch.bfloat16)
    return swa, swa_values, extra, extra_values, q


def decode(q, swa, indices, **kw):
    meta, _ = ops.get_mla_metadata()
    return ops.flash_mla_with_kvcache(q=q, k_cache=swa, block_table=None, cache_seqlens=None, head_dim_v=512,
                                      tile_scheduler_metadata=meta, softmax_scale=SCALE, is_fp8_kvcache=True,
                                      indices=indices, **kw)


def test_topk_length_minus_one_and_the_extra_cache(setup):
    swa, swa_values, extra, extra_values, q = setup
    # row 0: slots 3, -1, 70 then 5 past its length 3 (not read); row 1: slot 99 only
    indices = torch.tensor([[[3, -1, 70, 5]], [[99, -1, -1, -1]]], dtype=torch.int32)
    extra_indices = torch.tensor([[[0, 6]], [[1, 2]]], dtype=torch.int32)
    out, lse = decode(q, swa, indices, topk_length=torch.tensor([3, 1], dtype=torch.int32), extra_k_cache=extra,
                      extra_indices_in_kvcache=extra_indices, extra_topk_length=torch.tensor([2, 1], dtype=torch.int32))
    for b, (own, more) in enumerate([([3, 70], [0, 6]), ([99], [1])]):
        want, want_lse = attend(q[b, 0].float(), torch.cat([swa_values[own], extra_values[more]]))
        assert torch.allclose(out[b, 0].double(), want, atol=2e-2, rtol=1e-2)
        assert torch.allclose(lse[b, :, 0].double(), want_lse, atol=1e-4)


def test_attn_sink_scales_the_output_and_not_the_lse(setup):
    swa, swa_values, _, _, q = setup
    indices = torch.tensor([[[3, 4]], [[5, -1]]], dtype=torch.int32)
    sink = torch.randn(64)
    sink[0], sink[1] = float("inf"), float("-inf")
    out, lse = decode(q, swa, indices, attn_sink=sink)
    plain, plain_lse = decode(q, swa, indices)
    assert torch.equal(lse, plain_lse) and (out[:, :, 0] == 0).all() and torch.equal(out[:, :, 1], plain[:, :, 1])
    want, _ = attend(q[0, 0].float(), swa_values[[3, 4]], sink)
    assert torch.allclose(out[0, 0, 2:].double(), want[2:], atol=2e-2, rtol=1e-2)


def test_an_index_outside_the_cache_is_a_fault_and_a_reused_sched_meta_must_match(setup):
    swa, _, _, _, q = setup
    with SANITIZER.collect() as found:
        out, _ = decode(q, swa, torch.tensor([[[3, 3 * 64]], [[-7, 5]]], dtype=torch.int32))
    assert {v.argument for v in found} == {"k_cache"} and len(found) == 2 and torch.isfinite(out.float()).all()
    with SANITIZER.collect() as found:  # topk_length past the row: the kernel would read indices beyond it
        decode(q, swa, torch.tensor([[[3]], [[5]]], dtype=torch.int32), topk_length=torch.tensor([2, 1], dtype=torch.int32))
    assert [v.argument for v in found] == ["indices"]
    meta, _ = ops.get_mla_metadata()
    kw = dict(k_cache=swa, block_table=None, cache_seqlens=None, head_dim_v=512, tile_scheduler_metadata=meta,
              is_fp8_kvcache=True)
    ops.flash_mla_with_kvcache(q=q, indices=torch.zeros(2, 1, 4, dtype=torch.int32), **kw)
    with pytest.raises(AssertionError, match="sched_meta reused"):
        ops.flash_mla_with_kvcache(q=q, indices=torch.zeros(2, 1, 8, dtype=torch.int32), **kw)


def test_sparse_prefill_with_sink_and_topk_length():
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(10, 1, 512, generator=g).to(torch.bfloat16)
    q = torch.randn(2, 64, 512, generator=g).to(torch.bfloat16)
    indices = torch.tensor([[[1, 4, 9, 2]], [[0, -1, 7, 3]]], dtype=torch.int32)
    sink = torch.randn(64, generator=g)
    out, _, lse = ops.flash_mla_sparse_fwd(q, kv, indices, SCALE, attn_sink=sink, topk_length=torch.tensor([3, 3]))
    for t, rows in enumerate([[1, 4, 9], [0, 7]]):
        want, want_lse = attend(q[t].float(), kv[rows, 0].float(), sink)
        assert torch.allclose(out[t].double(), want, atol=2e-2, rtol=1e-2)
        assert torch.allclose(lse[t].double(), want_lse, atol=1e-4)
