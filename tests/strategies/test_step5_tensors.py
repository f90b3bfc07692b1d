"""Step5 cases (Case.step5) and the torch writers of what earlier steps leave in Step5's caches
(strategies.step5_tensors): the region summaries and tail-ring rows against vLLM's own Triton `_update_decode`, which
a case's history replaces (interpreted, one program a token)."""

import pytest
import torch

from strategies.case import Case, CaseError, Request, Step5
from strategies.step5_tensors import encode_summary, materialize_step5, ring_row, write_ring, write_summaries


def case(contexts=(20,), block=16, groups=1, kv="bfloat16", steps=1, regions="distinct", table=None):
    table = table or tuple((i * 10 + 1, i * 10 + 2, i * 10 + 3, 0) for i in range(len(contexts)))
    return Case(requests=tuple(Request(1, c) for c in contexts), num_decodes=len(contexts), block_size=block,
                block_table=table, topk_width=128, topk=(), heads=8 * groups, kv_cache_dtype=kv, seed=3,
                step5=Step5(groups=groups, steps=steps, regions=regions)).validate()


def test_a_step5_case_round_trips_and_is_checked():
    c = case(contexts=(20, 33), steps=3, regions="ties")
    assert Case.from_json(c.to_json()) == c
    assert "region_topk=8" in c.summary() and "step5" not in case(contexts=(20,)).to_dict()["dcp"]
    with pytest.raises(CaseError, match="step5.groups"):
        Case.from_dict({**c.to_dict(), "step5": {**c.to_dict()["step5"], "groups": 3}})
    with pytest.raises(CaseError, match="block_size"):  # an fp8 page of 16 tokens holds 6 ring rows, vLLM asks for 7
        case(kv="fp8")
    with pytest.raises(CaseError, match="requests"):  # 3 steps need 2 earlier tokens
        case(contexts=(1,), steps=3)
    with pytest.raises(CaseError, match="block_table"):  # 45 tokens of 16 need 3 blocks
        case(contexts=(44,), table=((1, 2, 0, 0),))


def test_tied_regions_repeat_region_zero():
    inp = materialize_step5(case(contexts=(45,), regions="ties"))
    assert torch.equal(inp.index_key[0][24:32], inp.index_key[0][:8])
    assert encode_summary(inp.index_key[0][24:32], inp.index_z[0][24:32]).equal(
        encode_summary(inp.index_key[0][:8], inp.index_z[0][:8]))


@pytest.mark.vllm
@pytest.mark.parametrize("block", [16, 64])
def test_torch_writers_equal_vllms_triton_update(block):
    """Two requests' tokens, one at a time through vLLM's `update_decode` (as the impl calls it: slots, positions,
    ring bases), against the torch writers: every closed region's summary byte for byte, every open-region row."""
    from fuzzer.support.interp.corrections import install_corrections
    from fuzzer.support.interp.sanitizer import SANITIZER
    from fuzzer.support.standins.cpu_shims import install_cpu_shims
    from fuzzer.support.step5_runtime import _interpreted_libdevice, import_moved, import_package

    import_package()  # vllm.models.step5's __init__ needs torchvision (the VL model): its ops imported without it
    update_decode = import_moved(("vllm.models.step5.nvidia.ops.summary_update",  # 0.34: common/ops
                                  "vllm.models.step5.common.ops.summary_update")).update_decode

    install_cpu_shims()
    install_corrections()
    _interpreted_libdevice()
    c = case(contexts=(21, 30), block=block, table=((3, 1, 0, 0), (2, 4, 0, 0)))
    inp = materialize_step5(c)
    blocks, capacity = 5, 12
    theirs = torch.full((blocks, 1, block // 8, 256), 0xFF, dtype=torch.uint8)
    ours = theirs.clone()
    ring_theirs = torch.full((blocks * capacity, 512), float("nan"), dtype=torch.bfloat16)
    ring_ours = ring_theirs.clone()
    with SANITIZER.install().collect() as violations:
        for i, r in enumerate(c.requests):
            base = torch.tensor([c.block_table[i][0] * capacity])
            for p in range(r.seq_len):
                s = c.block_table[i][p // block] * block + p % block
                update_decode(inp.index_key[i][p:p + 1], inp.index_z[i][p:p + 1], torch.tensor([s]),
                              torch.tensor([p]), base, theirs[:, 0], ring_theirs, capacity)
    assert not violations
    for i, r in enumerate(c.requests):
        write_summaries(ours, c, inp, i, range(r.seq_len // 8))
        write_ring(ring_ours, c, inp, i, range(r.seq_len // 8 * 8, r.seq_len), capacity, capacity)
        for p in range(r.seq_len // 8 * 8, r.seq_len):
            row = ring_row(c, i, p, capacity, capacity)
            assert torch.equal(ring_ours[row].view(torch.int16), ring_theirs[row].view(torch.int16)), (i, p)
    assert torch.equal(ours, theirs), (ours != theirs).nonzero()[:8].tolist()


def test_fp8_values_saturate_and_a_calibrated_scale_fits_the_values():
    """vLLM's writers saturate at +-448; torch's CUDA conversion gives NaN bytes there (its CPU one saturates), so
    the writers clamp first. A calibrated k_scale fits step5's N(0, 1) K/V: nothing reaches 448."""
    from strategies.step5_tensors import kv_scales, write_kv
    from strategies.tensors import to_e4m3

    assert to_e4m3(torch.tensor([500.0, -1e4, 1.0])).float().tolist() == [448.0, -448.0, 1.0]
    c = Case.from_dict({**case(contexts=(150,), block=64).to_dict(), "kv_cache_dtype": "fp8",
                        "fp8_scale": "arbitrary"})
    inp = materialize_step5(c)
    assert kv_scales(c)[0] == pytest.approx(8 / 448)
    cache = torch.zeros(12, 1, 64, 384, dtype=torch.uint8)
    write_kv(cache, c, inp, 0, range(151))
    values = cache.view(torch.float8_e4m3fn).float()
    assert values.isfinite().all() and values.abs().max() < 448
