"""The torch writer of DeepSeek-V4's 584-byte record (strategies.dsv4_tensors) against vLLM's own Triton writer,
`quantize_and_insert_k_cache`, byte for byte: every cache a DSv4 case runs on is written in torch, because the
interpreted Triton writer costs ~20 ms a token."""

import pytest
import torch

from strategies.dsv4_tensors import page_bytes, write_v4_records

pytestmark = pytest.mark.vllm


def pages(k: torch.Tensor, entries: int, record: int = 584):
    """Cache pages for k's rows at random slots past block 0 (block count, slots, vLLM's pages and ours, both poisoned
    with 255)."""
    blocks = len(k) // entries + 3
    slots = torch.randperm((blocks - 1) * entries, generator=torch.Generator().manual_seed(1))[: len(k)] + entries
    theirs = torch.full((blocks, page_bytes(entries, record)), 255, dtype=torch.uint8)
    return blocks, slots, theirs, theirs.clone()


def latents() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(24, 512, generator=g)
    k[0] = 0  # every block at the 1e-4 floor
    k[1, :64] *= 1e-6
    for i, base in enumerate([448.0, 7.0, 0.4375, 448 * 2**-10]):  # amax at 7 * 2^j, just above, just below
        for j, f in enumerate([1.0, 1.0 + 2**-6, 1.0 - 2**-7]):
            k[2 + 3 * i + j, :64] = torch.linspace(-base, base * f, 64)
    k[20] *= 1e3
    k[21] *= 1e-3
    return k.to(torch.bfloat16)


@pytest.mark.parametrize("entries", [64, 2])  # an SWA (or C4) page of 64 records, a C128 page of 2
def test_torch_writer_equals_vllms_triton_writer(entries):
    from fuzzer.support.interp.corrections import install_corrections
    from fuzzer.support.interp.sanitizer import SANITIZER
    from fuzzer.support.standins.cpu_shims import install_cpu_shims
    from vllm.models.deepseek_v4.common.ops.cache_utils import quantize_and_insert_k_cache

    install_cpu_shims()
    install_corrections()
    k = latents()
    blocks, slots, theirs, ours = pages(k, entries)
    with SANITIZER.install().collect() as violations:
        quantize_and_insert_k_cache(k, theirs, slots, block_size=entries)
    assert not violations
    write_v4_records(ours, slots, k, entries)
    assert torch.equal(ours, theirs), (ours != theirs).nonzero()[:8].tolist()


@pytest.mark.parametrize("entries", [32, 64])  # V4.1 pages: an SWA page of 32 records, a C2 page of 64 // 2
def test_torch_writer_equals_vllms_triton_writer_of_the_v41_record(entries):
    """V4.1's 528-byte MXFP8 record (SM100): the torch writer against vLLM's `_quantize_and_insert_k_mxfp8_kernel`
    (deepseek_v41's `quantize_and_insert_k_cache` with bytes_per_token=528), byte for byte."""
    from fuzzer.support.interp.corrections import install_corrections
    from fuzzer.support.interp.sanitizer import SANITIZER
    from fuzzer.support.standins.cpu_shims import install_cpu_shims
    from strategies.dsv4_tensors import write_v41_records
    from vllm.models.deepseek_v41.common.ops.cache_utils import quantize_and_insert_k_cache

    install_cpu_shims()
    install_corrections()
    k = latents()
    blocks, slots, theirs, ours = pages(k, entries, 528)
    with SANITIZER.install().collect() as violations:
        quantize_and_insert_k_cache(k, theirs, slots, block_size=entries, bytes_per_token=528)
    assert not violations
    write_v41_records(ours, slots, k, entries)
    assert torch.equal(ours, theirs), (ours != theirs).nonzero()[:8].tolist()


def nvfp4_latents() -> torch.Tensor:
    """Latents at NVFP4's edges: blocks at the 2^-9 scale floor, blocks whose amax / 6 rounds to an e4m3 value below
    it (so values saturate at 6 x scale), e2m1 ties (0.25, 0.75, ..., 5 times the scale), negative values that round
    to zero (code 8: the sign kept), a block past e4m3's 448 x 6. No -0.0 itself: the kernel's RoPE, the identity on
    the NoPE pairs, computes e * 1 - o * 0, which is +0.0 for e = -0.0 and a negative o (IEEE), so vLLM's record of a
    -0.0 depends on its pair partner, a detail of its RoPE and not of the format."""
    k = latents().float()
    g = torch.Generator().manual_seed(2)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0])
    k[22, :16] = ties  # amax 6: scale 1.0 exactly, every tie on the grid's midpoints
    k[22, 16:32] = -1e-30
    k[22, 32:48] = ties * 2.0**-3
    k[23, :16] = torch.randn(16, generator=g) * 1e4  # past 448 x 6: the scale saturates at 448
    return k.to(torch.bfloat16)


@pytest.mark.parametrize("entries", [64, 128])  # V4.1 compressed pages: C2 of 128-token blocks, C1 of 64 or 128
def test_torch_writer_equals_vllms_triton_writer_of_the_v41_nvfp4_record(entries):
    """V4.1's 288-byte NVFP4 compressed record (nvfp4_ds_mla, SM100): the torch writer against vLLM's
    `_rope_quant_insert_nvfp4_kernel` (deepseek_v41's `rope_quant_insert` on a 288-byte cache), byte for byte. The
    kernel applies RoPE first: with cos 1 and sin 0 it is the identity, so it quantizes the value as given. Its PTX
    e2m1 conversion runs as the interpreter correction emulates it (test_interp_corrections)."""
    from fuzzer.support.interp.corrections import install_corrections
    from fuzzer.support.interp.sanitizer import SANITIZER
    from fuzzer.support.standins.cpu_shims import install_cpu_shims
    from strategies.dsv4_tensors import write_v41_nvfp4_records
    from vllm.models.deepseek_v41.common.ops.fused_compress_quant_cache import rope_quant_insert

    install_cpu_shims()
    install_corrections()
    k = nvfp4_latents()
    blocks, slots, theirs, ours = pages(k, entries, 288)
    cos_sin = torch.cat([torch.ones(len(k), 32), torch.zeros(len(k), 32)], dim=-1)
    cache = torch.as_strided(theirs, (blocks, entries, 288), (theirs.shape[1], 288, 1))
    with SANITIZER.install().collect() as violations:
        rope_quant_insert(k.contiguous(), torch.arange(len(k)), cos_sin, cache, slots, compress_ratio=1)
    assert not violations
    write_v41_nvfp4_records(ours, slots, k, entries)
    assert torch.equal(ours, theirs), (ours != theirs).nonzero()[:8].tolist()


def test_v41_nvfp4_decoder_reads_the_writers_records_within_its_bound():
    """oracles.nvfp4_ds_mla_v41 (the format's definition) reads back what the writer wrote within its error bound, the
    scales in natural order, ties to even, saturation at 6 x scale, the last entry of a partial page."""
    from oracles import nvfp4_ds_mla_v41 as fmt
    from strategies.dsv4_tensors import v41_nvfp4_records, write_v41_nvfp4_records

    k = nvfp4_latents()
    rec = v41_nvfp4_records(k)
    values = fmt.dequantize(rec)
    assert ((values - k.float()).abs() <= fmt.error_bound(k, rec) + 1e-30).all()
    assert torch.equal(values[22, :16], torch.tensor([0, 1, 1, 2, 2, 4, 4, 6, -0.0, -1, -1, -2, -2, -4, -4, -6.0]))
    assert torch.equal(fmt.scales(rec)[22, :3], torch.tensor([1.0, 2.0**-9, 2.0**-3]))
    assert (rec[22, 8:16] == 0x88).all()  # a negative value that rounds to 0 keeps its sign: code 8 in both nibbles
    assert float(fmt.scales(rec)[23, 0]) == 448.0
    entries = 5  # a page of 5 records: 1440 bytes, padded to 1536; the last record ends 96 bytes before the page end
    pages = torch.full((2, fmt.page_bytes(entries)), 255, dtype=torch.uint8)
    write_v41_nvfp4_records(pages, torch.tensor([9]), k[:1], entries)
    assert torch.equal(fmt.read_records(pages, torch.tensor([9]), entries), rec[:1])
    assert (pages[1, 4 * 288 + 288:] == 255).all() and (pages[1, : 4 * 288] == 255).all()
