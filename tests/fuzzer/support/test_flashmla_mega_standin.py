"""FlashMLA's mega-attention stand-ins (fuzzer/support/standins/flashmla_mega.py) against what vLLM 0.33.0's call
sites and docstrings define (the kernels are not public): q in `fused_layout`'s layout, GPT-J RoPE of the last 64
dims, the sparse decode over the 528-byte SWA and 288-byte NVFP4 compressed records (-1 skipped, topk_length bounding
each row, an index outside the cache a fault), the prefill's entries outside [0, s_kv) skipped, a row with no key 0,
the sink, the inverse RoPE, and the MXFP8 output pair in `o_fused_permutation`'s layout with packed UE8M0 scales."""

import pytest
import torch

from fuzzer.support.dsv41_mega_runtime import read_mxfp8_output, rope_cos_sin
from fuzzer.support.errors import StandInRefused
from fuzzer.support.interp.sanitizer import SANITIZER
from fuzzer.support.standins import flashmla_mega as mega
from oracles import fp8_ds_mla_v41, nvfp4_ds_mla_v41
from strategies.dsv4_tensors import write_v41_nvfp4_records, write_v41_records

SCALE = 512**-0.5
H = 64  # 8 wo_a groups of 8 heads


def paged(values, entries, blocks, record, write):
    pages = torch.full((blocks, -(-entries * record // 512) * 512), 255, dtype=torch.uint8)
    slots = torch.arange(len(values))
    write(pages, slots, values, entries)
    fmt = fp8_ds_mla_v41 if record == 528 else nvfp4_ds_mla_v41
    view = torch.as_strided(pages, (blocks, entries, 1, record), (pages.shape[1], record, record, 1))
    return view, fmt.dequantize(fmt.read_records(pages, slots, entries))


def fused(q):
    from vllm.models.deepseek_v41.common.ops.fused_layout import permute_q_to_fused

    return permute_q_to_fused(q)


def out_pair(s_q):
    from vllm.models.deepseek_v41.nvidia.flash_mla_mega_attn import alloc_mega_attn_output

    out = alloc_mega_attn_output(s_q, H // 8, torch.device("cpu"))
    out.data.view(torch.uint8).fill_(0x7F)
    out.scale.fill_(-1)
    return out


def reference(q, keys, positions, cos_sin, sink=None):
    qr = mega.gptj_rope(q.float()[None], cos_sin, positions[:1])[0].double()
    s = (qr @ keys.double().T) * SCALE
    out = torch.softmax(s, dim=-1) @ keys.double()
    if sink is not None:
        out = out * torch.sigmoid(torch.logsumexp(s, dim=-1) - sink.double())[:, None]
    return mega.gptj_rope(out.float()[None], cos_sin, positions[:1], inverse=True)[0]


def decode(q, swa, indices, lens, extra=None, extra_idx=None, extra_lens=None, positions=None, sink=None, **kw):
    out = out_pair(q.shape[0])
    cos_sin = rope_cos_sin(4096)
    args = dict(enable_q_norm=False, is_neox=False, rope_dim=64, quant_group=32, tma_aligned=True,
                round_nearest=True, packed_ue8m0=True)
    args.update(kw)
    mega.fused_norm_rope_attn_rope_cast_decode(
        fused(q), swa, indices, SCALE, 512, sink, lens, extra, extra_idx, extra_lens, args["enable_q_norm"], 0.0,
        positions, args["is_neox"], args["rope_dim"], cos_sin, H // 8, args["quant_group"], args["tma_aligned"],
        args["round_nearest"], args["packed_ue8m0"], out.data, out.scale)
    return read_mxfp8_output(out.data, out.scale), cos_sin


@pytest.fixture
def setup():
    g = torch.Generator().manual_seed(0)
    swa, swa_values = paged(torch.randn(70, 512, generator=g).to(torch.bfloat16), 32, 3, 528, write_v41_records)
    extra, extra_values = paged(torch.randn(9, 512, generator=g).to(torch.bfloat16), 4, 3, 288,
                                write_v41_nvfp4_records)
    q = torch.randn(3, H, 512, generator=g).to(torch.bfloat16)
    return swa, swa_values, extra, extra_values, q


def close(got, want):
    return (got - want).abs().max() <= 2**-4 * want.abs().max() + 1e-3


def test_decode_swa_and_nvfp4_extra_rope_sink_and_empty_rows(setup):
    swa, swa_values, extra, extra_values, q = setup
    # token 0: SWA slots 3, -1, 69 and 5 past its length 3; extra 0, 8 (the last record of a partial page)
    # token 1: slot 40 only, extra none (length 0); token 2: nothing at all (a padding token)
    indices = torch.tensor([[3, -1, 69, 5], [40, -1, -1, -1], [-1, -1, -1, -1]], dtype=torch.int32)
    extra_idx = torch.tensor([[0, 8], [1, -1], [-1, -1]], dtype=torch.int32)
    positions = torch.tensor([700, 41, 0], dtype=torch.int32)
    sink = torch.randn(H)
    with SANITIZER.install().collect() as violations:
        got, cos_sin = decode(q, swa, indices, torch.tensor([3, 1, 0]), extra, extra_idx, torch.tensor([2, 0, 0]),
                              positions, sink)
    assert not violations
    for t, (own, more) in enumerate([([3, 69], [0, 8]), ([40], [])]):
        want = reference(q[t], torch.cat([swa_values[own], extra_values[more]]), positions[t:t + 1], cos_sin, sink)
        assert close(got[t], want), (t, (got[t] - want).abs().max())
    assert torch.equal(got[2], torch.zeros(H, 512))  # no key: 0


def test_decode_index_outside_the_cache_is_a_fault(setup):
    swa, _, _, _, q = setup
    with SANITIZER.install().collect() as violations:
        decode(q[:1], swa, torch.tensor([[3, 96]], dtype=torch.int32), torch.tensor([2]),
               positions=torch.tensor([5], dtype=torch.int32))
    assert violations and "fused_norm_rope_attn_rope_cast_decode" in violations[0].kernel


def test_prefill_skips_entries_outside_the_workspace(setup):
    _, _, _, _, q = setup
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(10, 1, 512, generator=g).to(torch.bfloat16)
    out = out_pair(2)
    cos_sin = rope_cos_sin(64)
    positions = torch.tensor([9, 30], dtype=torch.int32)
    indices = torch.tensor([[[0, 9, 10, -1]], [[2, 4, 7, 1]]], dtype=torch.int32)
    mega.fused_norm_rope_attn_rope_cast_fwd(fused(q[:2]), kv, indices, SCALE, 512, None, torch.tensor([4, 2]), False,
                                            0.0, positions, False, 64, cos_sin, H // 8, 32, True, True, True,
                                            out.data, out.scale)
    got = read_mxfp8_output(out.data, out.scale)
    for t, rows in enumerate([[0, 9], [2, 4]]):
        assert close(got[t], reference(q[t], kv[rows, 0].float(), positions[t:t + 1], cos_sin))


def test_output_layout_is_vllms_o_fused_permutation():
    """The pair written from a known standard-layout output reads back through vLLM's own permutations: data
    position p holds standard element o_fused_permutation[p] of its group; each scale int32 packs four chunks."""
    from vllm.models.deepseek_v41.common.ops.fused_layout import o_fused_permutation

    g = torch.Generator().manual_seed(4)
    out = torch.randn(2, H, 512, generator=g) * torch.exp2(torch.randint(-6, 6, (2, H, 1), generator=g).float())
    pair = out_pair(2)
    mega.write_mxfp8(out, H // 8, pair.data, pair.scale)
    std = out.reshape(2, H // 8, 8 * 512)
    data = pair.data.float()
    perm = o_fused_permutation()
    exps = torch.stack([(pair.scale.long() >> (8 * k)) & 0xFF for k in range(4)], -1).reshape(2, H // 8, 128)
    want = std[..., perm] / torch.exp2(exps.float() - 127).repeat_interleave(32, -1)
    assert ((data - want).abs() <= 2**-4 * want.abs() + 2**-9).all()
    step = torch.exp2(exps.float() - 127 - 9).repeat_interleave(32, -1)  # e4m3's subnormal step at each scale
    back = read_mxfp8_output(pair.data, pair.scale).reshape(2, H // 8, -1)
    assert ((back - std).abs() <= 2**-4 * std.abs() + step[..., torch.argsort(perm)]).all()


def test_fused_q_layout_is_vllms():
    q = torch.randn(2, H, 512)
    assert torch.equal(mega.from_fused_q(fused(q)), q)


@pytest.mark.parametrize("kw", [dict(enable_q_norm=True), dict(is_neox=True), dict(rope_dim=32),
                                dict(packed_ue8m0=False)])
def test_unmodelled_call_forms_are_refused(setup, kw):
    swa, _, _, _, q = setup
    with pytest.raises(StandInRefused):
        decode(q[:1], swa, torch.tensor([[3]], dtype=torch.int32), torch.tensor([1]),
               positions=torch.tensor([5], dtype=torch.int32), **kw)


def test_fewer_live_heads_than_the_kernels_is_refused(setup):
    swa, _, _, _, q = setup
    out = out_pair(1)
    with pytest.raises(StandInRefused):
        mega.fused_norm_rope_attn_rope_cast_decode(
            fused(q[:1, :32]), swa, torch.tensor([[3]], dtype=torch.int32), SCALE, 512, None, torch.tensor([1]), None,
            None, None, False, 0.0, torch.tensor([5], dtype=torch.int32), False, 64, rope_cos_sin(16), H // 8, 32,
            True, True, True, out.data, out.scale)
