"""The 656-byte fp8_ds_mla entry model: byte layout, scale conventions, round trip."""

import pytest
import torch

from oracles.fp8_ds_mla import (
    ENTRY_BYTES,
    FLT_MIN,
    NOPE_DIM,
    ROPE_DIM,
    SCALE_CONVENTIONS,
    TILE,
    dequantize,
    dequantize_flat_fp8,
    quantize,
    read_scales,
    split_entry,
    tile_scales,
)


def make_rows(n=5, seed=0, dtype=torch.float32):
    """Rows whose four tiles have very different magnitudes, plus one all-zero tile."""
    g = torch.Generator().manual_seed(seed)
    kv_c = torch.randn(n, NOPE_DIM, generator=g)
    kv_c *= torch.tensor([1e-3, 1.0, 37.0, 1e4]).repeat_interleave(TILE)
    kv_c[0, TILE:2 * TILE] = 0.0
    k_pe = torch.randn(n, ROPE_DIM, generator=g)
    return kv_c.to(dtype), k_pe.to(dtype)


def one_tile_rows(amaxes):
    """One row, tile i holds a ramp whose amax is amaxes[i]."""
    ramp = torch.linspace(-1.0, 1.0, TILE)
    kv_c = torch.cat([ramp * a for a in amaxes]).unsqueeze(0)
    return kv_c, torch.zeros(1, ROPE_DIM)


def test_constants():
    assert ENTRY_BYTES == NOPE_DIM + 4 * 4 + 2 * ROPE_DIM == 656
    assert SCALE_CONVENTIONS == ("arbitrary", "pow2", "e8m0_trunc")


@pytest.mark.parametrize("convention", ["arbitrary", "pow2"])
def test_byte_layout(convention):
    kv_c, k_pe = make_rows()
    e = quantize(kv_c, k_pe, convention)
    assert e.dtype == torch.uint8 and e.shape == (5, ENTRY_BYTES)
    scales = e[:, 512:528].contiguous().view(torch.float32)
    assert torch.equal(scales, tile_scales(kv_c, convention))
    assert torch.equal(e[:, 528:656].contiguous().view(torch.bfloat16), k_pe.bfloat16())
    nope = (kv_c.view(5, 4, TILE) / scales[..., None]).to(torch.float8_e4m3fn).view(5, NOPE_DIM)
    assert torch.equal(e[:, :512], nope.view(torch.uint8))
    n, s, r = split_entry(e)
    assert n.dtype == torch.uint8 and s.dtype == torch.float32 and r.dtype == torch.bfloat16
    assert torch.equal(n, e[:, :512]) and torch.equal(s, scales) and torch.equal(r, k_pe.bfloat16())


@pytest.mark.parametrize("convention", ["arbitrary", "pow2"])
def test_round_trip_within_fp8_step(convention):
    kv_c, k_pe = make_rows(n=16)
    e = quantize(kv_c, k_pe, convention)
    d = dequantize(e)
    assert d.dtype == torch.float32 and d.shape == (16, NOPE_DIM + ROPE_DIM)
    scale = split_entry(e)[1].repeat_interleave(TILE, dim=-1)
    # e4m3: 3 mantissa bits -> half-step 2**-4 relative for normals; subnormal step 2**-9
    bound = 2.0 ** -4 * kv_c.abs() + 2.0 ** -10 * scale
    assert ((d[:, :NOPE_DIM] - kv_c).abs() <= bound).all()
    assert torch.equal(d[:, NOPE_DIM:], k_pe.bfloat16().float())
    assert torch.equal(d[0, TILE:2 * TILE], torch.zeros(TILE))


def test_pow2_scales():
    kv_c, k_pe = one_tile_rows([336.0, 0.0, 448.0, 224.0])
    assert tile_scales(kv_c, "pow2").tolist() == [[1.0, 2.0 ** -13, 1.0, 0.5]]
    kv_c, _ = one_tile_rows([448.0 * (1 + 2 ** -20), 1e-6, 0.05, 3000.0])
    assert tile_scales(kv_c, "pow2").tolist() == [[2.0, 2.0 ** -13, 2.0 ** -13, 8.0]]
    e = quantize(*one_tile_rows([336.0, 0.0, 448.0, 224.0]), "pow2")
    assert split_entry(e)[1].tolist() == [[1.0, 2.0 ** -13, 1.0, 0.5]]


def test_arbitrary_scales_and_e8m0_reader():
    kv_c, k_pe = one_tile_rows([336.0, 0.0, 448.0, 300.0])
    e = quantize(kv_c, k_pe, "arbitrary")
    stored = split_entry(e)[1]
    assert stored[0, :3].tolist() == [0.75, FLT_MIN, 1.0]
    assert read_scales(torch.tensor([0.75, 1.0, 1.5, 3.0, 2.0 ** -13]), "e8m0_trunc").tolist() == \
        [0.5, 1.0, 1.0, 2.0, 2.0 ** -13]
    assert torch.equal(read_scales(stored, "as_stored"), stored)
    fp8 = split_entry(e)[0][0, :TILE].view(torch.float8_e4m3fn).float()
    assert torch.equal(dequantize(e)[0, :TILE], fp8 * 0.75)
    assert torch.equal(dequantize(e, reader="e8m0_trunc")[0, :TILE], fp8 * 0.5)
    pow2 = quantize(*make_rows(), "pow2")  # pow2 scales survive e8m0 truncation
    assert torch.equal(dequantize(pow2, reader="e8m0_trunc"), dequantize(pow2))


def test_quantize_rejects_reader_convention():
    with pytest.raises(ValueError):
        quantize(*make_rows(), "e8m0_trunc")


def test_round_to_nearest_even():
    kv_c, k_pe = one_tile_rows([336.0] * 4)  # pow2 scale 1.0 everywhere
    kv_c[0, :4] = torch.tensor([1.0625, 17.0, 19.0, -336.0])
    d = dequantize(quantize(kv_c, k_pe, "pow2"))
    assert d[0, :3].tolist() == [1.0, 16.0, 20.0]


def test_flat_fp8_reading_differs():
    e = quantize(*make_rows(), "arbitrary")
    assert not torch.allclose(dequantize_flat_fp8(e, 1.0)[:, :NOPE_DIM], dequantize(e)[:, :NOPE_DIM])
    # with unit tile scales the NoPE part agrees; the tail (scale + rope bytes) does not
    e = quantize(*one_tile_rows([300.0, 336.0, 400.0, 448.0]), "pow2")
    flat, good = dequantize_flat_fp8(e, 1.0), dequantize(e)
    assert torch.equal(flat[:, :NOPE_DIM], good[:, :NOPE_DIM])
    assert not torch.equal(flat[:, NOPE_DIM:], good[:, NOPE_DIM:])
    assert flat.shape == good.shape == (1, 576) and flat.dtype == torch.float32


def test_leading_shape_bf16_and_determinism():
    kv_c, k_pe = make_rows(n=6, dtype=torch.bfloat16)
    kv_c, k_pe = kv_c.view(2, 3, NOPE_DIM), k_pe.view(2, 3, ROPE_DIM)
    e = quantize(kv_c, k_pe, "pow2")
    assert e.shape == (2, 3, ENTRY_BYTES)
    assert torch.equal(e, quantize(kv_c, k_pe, "pow2"))
    assert torch.equal(e.view(6, ENTRY_BYTES), quantize(kv_c.view(6, -1), k_pe.view(6, -1), "pow2"))
    assert dequantize(e).shape == (2, 3, 576) and dequantize_flat_fp8(e, 2.0).shape == (2, 3, 576)
    assert torch.equal(dequantize(e).view(6, -1), dequantize(e.view(6, -1)))
    assert torch.equal(dequantize(e[:, 1]), dequantize(e)[:, 1])  # non-contiguous input
