"""The DeepSeek-V4 oracle on hand-made steps: the reference from positions, window, compress ratio, top-k and block
tables; the attention sink; each metadata tensor's definition; the record model (no vLLM here)."""

import math
from types import SimpleNamespace

import torch

from oracles import dsv4 as oracle
from oracles import fp8_ds_mla_v4 as v4
from strategies.case import Case, Dsv4, Request
from strategies.dsv4_tensors import compressed_pages, materialize_dsv4_inputs, num_blocks, swa_pages


def case(requests, num_decodes, table, ratio=1, ctable=(), window=32, sink="none", k=0, heads=16, pad=0) -> Case:
    return Case(requests=tuple(requests), num_decodes=num_decodes, block_size=64, block_table=tuple(table),
                topk_width=128, topk=(), heads=heads, kv_cache_dtype="fp8_ds_mla", seed=3, padded_tokens=pad,
                dsv4=Dsv4(compress_ratio=ratio, window_size=window, compressed_block_table=tuple(ctable),
                          num_speculative_tokens=k, attn_sink=sink)).validate()


def outputs(c: Case) -> dict:
    inputs = materialize_dsv4_inputs(c)
    out = {"swa_pages": swa_pages(c, inputs, num_blocks(c.block_table), "cpu")}
    if c.dsv4.compress_ratio > 1:
        out["compressed_pages"] = compressed_pages(c, inputs, num_blocks(c.dsv4.compressed_block_table), "cpu")
    return out


def reference(c: Case):
    pages = outputs(c)
    records, verdicts = oracle._records(c, pages["swa_pages"], pages.get("compressed_pages"), "cpu")
    assert not verdicts
    return oracle.reference(c, records)[0], materialize_dsv4_inputs(c)


def test_a_single_key_row_is_that_keys_dequantized_value_exactly():
    c = case([Request(1, 0)], 1, [(1,)])  # one token at position 0: its window is itself
    out, inputs = reference(c)
    value = v4.dequantize(v4.quantize(inputs.swa_values[0][:1]))[0]
    assert torch.equal(out[0], value.expand(c.heads, -1))


def test_the_sink_only_adds_to_the_denominator():
    c = case([Request(1, 0)], 1, [(1,)], sink="finite")
    out, inputs = reference(c)
    key = v4.dequantize(v4.quantize(inputs.swa_values[0][:1]))[0].double()
    q, sink = inputs.q[0, : c.heads].double(), inputs.attn_sink[: c.heads].double()
    s = (q @ key) * 512**-0.5
    want = key[None] * (torch.exp(s) / (torch.exp(s) + torch.exp(sink)))[:, None]
    assert torch.allclose(out[0].double(), want, rtol=1e-6, atol=1e-7)
    none = case([Request(1, 0)], 1, [(1,)], sink="none")
    assert torch.equal(reference(none)[0][0], key.float().expand(c.heads, -1))  # -inf: no sink


def test_a_window_is_clipped_at_positions_before_it():
    c = case([Request(5, 0)], 0, [(1,)], window=32)
    md = oracle.expected_metadata(c)
    assert md["prefill_swa_lens"].tolist() == [1, 2, 3, 4, 5]
    assert md["prefill_swa_indices"][3, 0, :5].tolist() == [64, 65, 66, 67, -1]
    out, inputs = reference(c)
    keys = v4.dequantize(v4.quantize(inputs.swa_values[0][:4])).double()
    q = inputs.q[3, : c.heads].double()
    p = torch.softmax((q @ keys.T) * 512**-0.5, dim=-1)
    assert torch.allclose(out[3].double(), p @ keys, rtol=1e-6, atol=1e-6)


def test_metadata_definitions_on_a_mixed_c128_step():
    # An MTP decode (2 tokens, old blocks freed), a padding-free prefill of 3 after 254 cached tokens, C128.
    c = case([Request(2, 300), Request(3, 254)], 1, [(0, 0, 1, 2, 3), (4, 5, 6, 7, 8)], ratio=128,
             ctable=[(1, 2), (3, 4)], window=128, k=1)
    md = oracle.expected_metadata(c, c128a_width=128)
    assert md["split"].tolist() == [1, 1, 2, 3]
    # token at position 301: window 174..301, position 174 in block 2 (id 1), offset 46
    assert md["decode_swa_lens"].tolist() == [128, 128]
    assert md["decode_swa_indices"][1, 0, 0].item() == 1 * 64 + 46
    assert md["prefill_gather_lens"].tolist() == [3 + 127]
    # the compressed slot of entry i: table[i // 2] * 2 + i % 2; position 255 completes entry 1 (slot 2 * 1 + 1)
    assert md["compressed_slot_mapping"].tolist() == [-1, -1, -1, 3 * 2 + 1, -1]
    assert md["c128a_decode_lens"].tolist() == [2, 2] and md["c128a_decode_indices"][0, 0, :3].tolist() == [2, 3, -1]
    assert md["c128a_prefill_indices"][:, :3].tolist() == [[0, -1, -1], [0, 1, -1], [0, 1, -1]]


def test_padding_tokens_go_with_the_decodes_of_a_decode_only_batch():
    c = case([Request(1, 9), Request(0, 0)], 2, [(1,), (0,)], pad=2, k=0)
    md = oracle.expected_metadata(c)
    assert md["split"].tolist() == [2, 0, 3, 0] and md["token_to_req_indices"].tolist() == [0, 0, 0]
    assert md["decode_swa_lens"].tolist() == [10, 0, 0] and (md["decode_swa_indices"][1:] == -1).all()


def test_a_metadata_tensor_off_by_one_is_named():
    c = case([Request(1, 200)], 1, [(1, 2, 3, 4)], window=64)
    md = {f"md.{k}": v.clone() for k, v in oracle.expected_metadata(c).items()}
    assert all(v.ok for v in oracle.judge_metadata(c, md))
    md["md.decode_swa_lens"][0] -= 1
    bad = [v for v in oracle.judge_metadata(c, md) if not v.ok]
    assert [(v.check, v.bug_class, v.where) for v in bad] == [("metadata", "N", "metadata:decode_swa_lens")]


def test_judge_sees_a_wrong_output_and_a_cache_that_changed():
    c = case([Request(1, 40), Request(4, 0)], 1, [(1,), (2,)], ratio=4, ctable=[(1,), (2,)])
    out, inputs = reference(c)
    full = torch.zeros(c.num_actual_tokens, 64, 512)
    full[:, : c.heads] = out
    obs = SimpleNamespace(memory=[], notes={}, error_type=None, device="cpu",
                          outputs={**outputs(c), **{f"md.{k}": v for k, v in oracle.expected_metadata(c).items()},
                                   "out": full.to(torch.bfloat16)})
    assert [v.check for v in oracle.judge_dsv4(c, obs)] == ["output"] and oracle.judge_dsv4(c, obs)[0].ok
    obs.outputs["out"] = full.clone()
    obs.outputs["out"][2, 0, 5] += 1.0
    obs.notes["cache_changed"] = "SWA cache: 1 of 3 pages"
    bad = {(v.check, v.bug_class) for v in oracle.judge_dsv4(c, obs) if not v.ok}
    assert bad == {("output", "N"), ("cache", "H")}


def test_rows_left_in_rope_coordinates_have_their_own_signature():
    """On a ROCm step, decode rows handed on without the inverse RoPE (the reference before it) are `output` at
    `output:rope_not_inverted`; rows rotated by the wrong angle, or wrong elsewhere, stay plain `output`."""
    from dataclasses import replace

    plain_case = case([Request(1, 40), Request(1, 300)], 2, [(1, 0, 0, 0, 0), (2, 3, 4, 5, 6)])
    c = replace(plain_case, dsv4=replace(plain_case.dsv4, rocm_arch="gfx1201")).validate()
    plain, rotated = reference(plain_case)[0], reference(c)[0]

    def where(out):
        full = torch.zeros(c.num_actual_tokens, c.heads, 512)
        full[:, : c.heads] = out
        obs = SimpleNamespace(memory=[], notes={}, error_type=None, device="cpu",
                              outputs={**outputs(c), **{f"md.{k}": v for k, v in oracle.expected_metadata(c).items()},
                                       "out": full})
        return [(v.check, v.bug_class, v.where) for v in oracle.judge_dsv4(c, obs) if not v.ok]

    assert where(rotated) == []
    assert where(torch.cat([rotated[:1], plain[1:]])) == [("output", "N", "output:rope_not_inverted")]
    assert where(plain) == [("output", "N", "output:rope_not_inverted")]
    wrong_angle = oracle.gptj_rope(plain.double(), torch.tensor([7, 300]), inverse=True).float()
    assert where(wrong_angle) == [("output", "N", "output")]
    nope_off = plain.clone()
    nope_off[1, 0, 5] += 1.0
    assert where(nope_off) == [("output", "N", "output")]


def test_record_model_round_trip_and_bound():
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(16, 512, generator=g) * torch.logspace(-6, 3, 16)[:, None]).to(torch.bfloat16)
    records = v4.quantize(x)
    assert records.shape == (16, 584) and (records[:, 583] == 0).all()
    back = v4.dequantize(records)
    assert torch.equal(back[:, 448:], x[:, 448:].float())  # RoPE stored as is
    assert ((back - x.float()).abs() <= v4.error_bound(x, records)).all()
    assert torch.equal(back.to(torch.bfloat16).float(), back)  # exact in bf16, as the kernels read it
    assert v4.page_bytes(64) == 37440 and v4.page_bytes(2) == 1728 and not math.isnan(float(back.sum()))


def test_the_rocm_layers_output_is_the_reference_with_its_rope_taken_out():
    """A ROCm step (Dsv4.rocm_arch): the NoPE dims as without, each RoPE pair of the token at position p rotated by
    -p theta^(-2k/64) (theta 10000 for a sliding-window layer), norms kept; position 0 unrotated."""
    from dataclasses import replace

    c = case([Request(1, 0), Request(1, 40)], 2, [(1,), (2,)])
    rocm = replace(c, dsv4=replace(c.dsv4, rocm_arch="gfx950")).validate()
    plain, rotated = reference(c)[0].double(), reference(rocm)[0].double()
    assert torch.equal(plain[:, :, :448], rotated[:, :, :448]) and torch.allclose(plain[0], rotated[0])
    a, b = plain[1, :, 448::2], plain[1, :, 449::2]
    angle = 40 * 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    assert torch.allclose(rotated[1, :, 448::2], (a * angle.cos() + b * angle.sin()).float().double(), atol=1e-6)
    assert torch.allclose(rotated[1, :, 449::2], (b * angle.cos() - a * angle.sin()).float().double(), atol=1e-6)
    assert oracle.rope_theta(replace(rocm, dsv4=replace(rocm.dsv4, compress_ratio=4))) == 160000.0
