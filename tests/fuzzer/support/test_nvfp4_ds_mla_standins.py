"""DeepSeek-V3.2's 352-byte nvfp4_ds_mla entry (SM100): the cache-writer stand-in (`concat_and_cache_mla` for
nvfp4_ds_mla, fuzzer/support/standins/flashmla_ops.py) against vLLM's Triton writer of the entry
(`fused_norm_rope`'s MLA_CACHE_NVFP4 branch, deepseek_v32/common/kernels.py, "in lockstep with
concat_and_cache_nvfp4_ds_mla (CUDA)") byte for byte; the format's decoder (oracles/nvfp4_ds_mla.py) on what it writes
(the permuted scale bytes, the unscaled e4m3 RoPE, the last entry of a partial page); FlashMLA's sparse decode
stand-in and the upconverting gather on the entry (-1 entries, a row with none, an index past the cache)."""

import pytest
import torch

from fuzzer.support.interp.sanitizer import SANITIZER
from fuzzer.support.standins import flashmla_ops as ops
from oracles import nvfp4_ds_mla as fmt


def latents(n=12):
    g = torch.Generator().manual_seed(0)
    kv_c = torch.randn(n, 512, generator=g)
    kv_c[0] = 0  # every block at the 2^-9 scale floor
    kv_c[1, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)  # amax 6: e2m1 ties at scale 1
    kv_c[1, 16:32] = -1e-30  # rounds to 0 from below: code 8
    kv_c[2] *= 1e4  # past 448 x 6: scales saturate at 448
    kv_c[3] *= 1e-3
    k_pe = torch.randn(n, 64, generator=g) * 8
    k_pe[4, 0] = 1000.0  # past e4m3's 448
    return kv_c, k_pe


def test_standin_writer_equals_vllms_triton_writer():
    """The Triton writer normalizes kv_c (RMS norm) and ropes k_pe first: its normed fp32 kv_c and roped fp32 k_pe
    (kv_c_out / k_pe_out, fp32 so nothing is rounded) are what the stand-in is given. Its PTX e2m1 conversion runs
    as the interpreter correction emulates it."""
    from fuzzer.support.interp.corrections import install_corrections
    from fuzzer.support.standins.cpu_shims import install_cpu_shims
    from vllm.models.deepseek_v32.common.kernels import fused_norm_rope

    install_cpu_shims()
    install_corrections()
    kv_c, k_pe = latents()
    n, blocks, block = len(kv_c), 3, 8
    slots = torch.randperm(blocks * block, generator=torch.Generator().manual_seed(1))[:n]
    theirs = torch.full((blocks, block, 352), 255, dtype=torch.uint8)
    ours = theirs.clone()
    cos_sin = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    kv_out, pe_out = torch.empty(n, 512), torch.empty(n, 64)
    with SANITIZER.install().collect() as violations:
        fused_norm_rope(torch.arange(n), torch.randn(n, 16), torch.ones(16), 1e-6, kv_c.to(torch.bfloat16),
                        torch.rand(512) + 0.5, 1e-6, k_pe.to(torch.bfloat16), cos_sin, None, None, None, 1e-6, None,
                        torch.zeros(n, 4, dtype=torch.int32), slot_mapping=slots, mla_kv_cache=theirs,
                        mla_kv_cache_dtype="nvfp4_ds_mla", has_indexer=False, kv_c_out=kv_out, k_pe_out=pe_out)
    assert not violations
    ops.concat_and_cache_mla(kv_out, pe_out, ours, slots, "nvfp4_ds_mla", None)
    assert torch.equal(ours, theirs), (ours != theirs).nonzero()[:8].tolist()


def test_decoder_reads_the_writers_entries_within_its_bound():
    kv_c, k_pe = latents()
    entries = ops.quantize_nvfp4_ds_mla(kv_c, k_pe)
    values = fmt.dequantize(entries)
    want = torch.cat([kv_c, k_pe], dim=-1)
    assert ((values - want).abs() <= fmt.error_bound(want, entries) + 1e-30).all()
    assert torch.equal(values[1, :8], torch.tensor([0.0, 1, 1, 2, 2, 4, 4, 6]))  # ties to the even code
    assert (entries[1, 8:16] == 0x88).all()  # the sign of a negative value rounded to 0
    # scale layout: block s's at byte 320 + 8 * (s & 3) + (s >> 2); block 0 of row 1 has amax 6 -> scale 1.0
    assert entries[1, 320].view(torch.float8_e4m3fn).item() == 1.0
    assert torch.equal(fmt.scales(entries)[1, :2], torch.tensor([1.0, 2.0**-9]))
    assert entries[1, 320 + 8].view(torch.float8_e4m3fn).item() == 2.0**-9  # block 1 -> byte 328
    assert float(fmt.scales(entries)[2].max()) == 448.0
    assert values[4, 512] == 448.0  # RoPE saturates, unscaled
    assert torch.equal(ops.dequantize_nvfp4_ds_mla(entries).float(), values)


def test_decode_standin_on_the_entry_minus_one_empty_rows_and_the_cache_end():
    kv_c, k_pe = latents(10)
    cache = torch.full((2, 8, 352), 255, dtype=torch.uint8)  # slot 10 is the last entry written, in a partial page
    ops.concat_and_cache_mla(kv_c, k_pe, cache, torch.arange(10), "nvfp4_ds_mla", None)
    values = fmt.dequantize(cache.view(-1, 352)[:10])
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 64, 576, generator=g).to(torch.bfloat16)
    indices = torch.tensor([[[9, -1, 3, -1], [-1, -1, -1, -1]]], dtype=torch.int32)
    meta, _ = ops.get_mla_metadata()
    out, lse = ops.flash_mla_with_kvcache(q, cache.unsqueeze(-2), None, None, 512, meta, softmax_scale=576**-0.5,
                                          is_fp8_kvcache=True, indices=indices)
    s = q[0, 0].double() @ values[[9, 3]].double().T * 576**-0.5
    want = torch.softmax(s, -1) @ values[[9, 3], :512].double()
    assert torch.allclose(out[0, 0].double(), want, atol=2e-2, rtol=2e-2)
    assert torch.equal(out[0, 1].float(), torch.zeros(64, 512)) and torch.isinf(lse[0, :, 1]).all()
    meta, _ = ops.get_mla_metadata()
    with SANITIZER.install().collect() as violations:
        ops.flash_mla_with_kvcache(q[:, :1], cache.unsqueeze(-2), None, None, 512, meta, softmax_scale=576**-0.5,
                                   is_fp8_kvcache=True, indices=torch.tensor([[[16, 2]]], dtype=torch.int32))
    assert violations and violations[0].argument == "k_cache"


def test_upconverting_gather():
    kv_c, k_pe = latents(10)
    cache = torch.full((3, 4, 352), 255, dtype=torch.uint8)
    table = torch.tensor([[2, 0, 1], [1, 0, 0]], dtype=torch.int32)
    slots = torch.cat([table[0].long()[torch.arange(6) // 4] * 4 + torch.arange(6) % 4])
    ops.concat_and_cache_mla(kv_c[:6], k_pe[:6], cache, slots, "nvfp4_ds_mla", None)
    dst = torch.full((9, 576), float("nan"), dtype=torch.bfloat16)
    ops.cp_gather_and_upconvert_nvfp4_kv_cache(cache, dst[:6], table, torch.tensor([0, 6], dtype=torch.int32), 1)
    assert torch.equal(dst[:6].float(), fmt.dequantize(ops.quantize_nvfp4_ds_mla(kv_c[:6], k_pe[:6])))
    assert torch.isnan(dst[6:].float()).all()
    with pytest.raises(ops.StandInRefused):
        ops.cp_gather_and_upconvert_nvfp4_kv_cache(cache, torch.empty(4, 512), table, torch.tensor([0]), 1)
