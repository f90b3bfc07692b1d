"""The torch writer of DeepSeek-V4's 584-byte record (strategies.dsv4_tensors) against vLLM's own Triton writer,
`quantize_and_insert_k_cache`, byte for byte: every cache a DSv4 case runs on is written in torch, because the
interpreted Triton writer costs ~20 ms a token."""

import pytest
import torch

from strategies.dsv4_tensors import page_bytes, write_v4_records

pytestmark = pytest.mark.vllm


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
    blocks = len(k) // entries + 3
    slots = torch.randperm((blocks - 1) * entries, generator=torch.Generator().manual_seed(1))[: len(k)] + entries
    theirs = torch.full((blocks, page_bytes(entries)), 255, dtype=torch.uint8)
    ours = theirs.clone()
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
    blocks = len(k) // entries + 3
    slots = torch.randperm((blocks - 1) * entries, generator=torch.Generator().manual_seed(1))[: len(k)] + entries
    theirs = torch.full((blocks, page_bytes(entries, 528)), 255, dtype=torch.uint8)
    ours = theirs.clone()
    with SANITIZER.install().collect() as violations:
        quantize_and_insert_k_cache(k, theirs, slots, block_size=entries, bytes_per_token=528)
    assert not violations
    write_v41_records(ours, slots, k, entries)
    assert torch.equal(ours, theirs), (ours != theirs).nonzero()[:8].tolist()
