"""DeepSeek-V4 steps (Case.dsv4): plain JSON data that names its wrong fields, strategies whose swarm knobs show in
the cases drawn, and the indexer rows and caches the tensors hold (no vLLM here)."""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from oracles import fp8_ds_mla_v4 as v4
from strategies.case import Case, CaseError, Dsv4, Request, TopkSpec
from strategies.dsv4_batches import Dsv4Features, dsv4_space
from strategies.dsv4_tensors import (
    compressed_pages,
    materialize_dsv4_inputs,
    num_blocks,
    swa_pages,
    v4_records,
    write_v4_records,
)
from strategies.profiles import PROFILES
from tests.strategies import drawn

P = PROFILES["cpu"]
SPACE = dsv4_space(P, Dsv4Features())


def dsv4_case(**kw) -> Case:
    """2 decodes (MTP k = 1, lengths 2 and 1; the first's old blocks freed) and a prefill of 5 with context, C4."""
    base = dict(requests=(Request(2, 300), Request(1, 40), Request(5, 7)), num_decodes=2, block_size=64,
                block_table=((0, 0, 1, 2, 3), (4, 0, 0, 0, 0), (5, 0, 0, 0, 0)), topk_width=128, topk=(),
                kv_cache_dtype="fp8_ds_mla", seed=5,
                dsv4=Dsv4(compress_ratio=4, window_size=128, compressed_block_table=((1, 2), (3, 0), (4, 0)),
                          num_speculative_tokens=1))
    base.update(kw)
    return Case(**base).validate()


def test_json_round_trip_and_old_cases_unchanged():
    c = dsv4_case()
    assert Case.from_json(c.to_json()) == c
    old = Case(requests=(Request(1, 3),), num_decodes=1, block_size=64, block_table=((1,),), topk_width=128,
               topk=(TopkSpec(3),)).validate()
    assert "dsv4" not in old.to_dict() and Case.from_json(old.to_json()) == old  # a DeepSeek-V3.2 case reads as before


@pytest.mark.parametrize("path, value, message", [
    (("dsv4", "compress_ratio"), 2, "case.dsv4.compress_ratio"),
    (("dsv4", "window_size"), 100, "case.dsv4.window_size"),
    (("dsv4", "c4_order"), "random", "case.dsv4.c4_order"),
    (("dsv4", "attn_sink"), "x", "case.dsv4.attn_sink"),
    (("dsv4", "num_speculative_tokens"), 0, "case.num_decodes"),  # threshold 1: the 2-token decode is a prefill
    (("dsv4", "compressed_block_table"), [[1, 0], [3, 0], [4, 0]], r"case.dsv4.compressed_block_table\[0\]: 302 tokens"),
    (("dsv4", "compressed_block_table"), [[1, "2"], [3, 0], [4, 0]], r"case.dsv4.compressed_block_table\[0\]\[1\]"),
    (("dsv4", "bogus"), 1, "case.dsv4.bogus: unknown field"),
    (("block_table",), [[0, 0, 0, 2, 3], [4, 0, 0, 0, 0], [5, 0, 0, 0, 0]], r"case.block_table\[0\]"),  # window's block freed
    (("topk",), [{"valid": 1}] * 3, "case.topk"),
    (("kv_cache_dtype",), "bfloat16", "case.kv_cache_dtype"),
])
def test_malformed_dsv4_case_names_the_field(path, value, message):
    data = json.loads(dsv4_case().to_json())
    where = data
    for key in path[:-1]:
        where = where[key]
    where[path[-1]] = value
    with pytest.raises(CaseError, match=message):
        Case.from_dict(data)


def test_padding_rows_only_after_the_decodes_of_a_decode_only_batch():
    with pytest.raises(CaseError, match="case.requests"):
        dsv4_case(requests=(Request(2, 300), Request(0, 0), Request(5, 7)), num_decodes=2)
    c = dsv4_case(requests=(Request(2, 300), Request(1, 40), Request(0, 0)), num_decodes=3, padded_tokens=3,
                  block_table=((0, 0, 1, 2, 3), (4, 0, 0, 0, 0), (0, 0, 0, 0, 0)),
                  dsv4=Dsv4(compressed_block_table=((1, 2), (3, 0), (0, 0)), num_speculative_tokens=1))
    assert c.num_actual_tokens == 6


def draw_cases(swarm, n=12):
    return drawn.draw_cases(SPACE, swarm, n, 11)


# Categories the strategy steers one request toward, which another knob's request or the profile's caps may undo.
LOOSE = {"window_edge", "state_fill", "c4_valid", "table_last_column", "table_layout", "prefills", "padding_rows",
         "window_context", "prefill_context", "swa_freed"}


def test_a_pinned_category_shows_in_the_cases():
    for name, value, features in drawn.pinned_features(SPACE, draw_cases, P.max_context):
        share = drawn.share(value, [f[name] for f in features if name in f])
        assert share >= (0.2 if name in LOOSE else 0.9), (name, value, share)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(SPACE.strategy(None))
def test_drawn_cases_are_valid_and_their_indexer_rows_hold_the_contract(case):
    assert Case.from_json(case.to_json()) == case
    inputs = materialize_dsv4_inputs(case)
    assert inputs.q.shape[0] == case.num_actual_tokens and inputs.q.shape[1] in (64, 128)
    assert (inputs.q[:, case.heads:] == 0).all() and torch.isneginf(inputs.attn_sink[case.heads:]).all()
    if case.dsv4.compress_ratio != 4:
        return
    for t, p in enumerate(inputs.positions.tolist()):  # min(n, topk) distinct valid ids < n first, -1 after
        row = inputs.topk_indices[t]
        n = (p + 1) // 4 if inputs.token_request[t] >= 0 else 0
        k = min(n, case.topk_width)
        assert (row[k:] == -1).all() and len(set(row[:k].tolist())) == k and ((row[:k] >= 0) & (row[:k] < n)).all()


def test_the_torch_writer_encodes_the_format_the_oracle_models():
    """The writer (a twin of vLLM's Triton writer, tests/strategies/test_dsv4_writer.py) and the oracle's own model of
    the record agree byte for byte, including zero blocks, the 1e-4 floor and amax next to a power of two."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(40, 512, generator=g)
    k[0] = 0
    k[1, :64] *= 1e-6
    k[2, :64] = torch.linspace(-448, 448 * (1 + 2**-6), 64)
    k[3] *= 1e4
    k = k.to(torch.bfloat16)
    data, scales = v4_records(k)
    assert torch.equal(torch.cat([data, scales], dim=-1), v4.quantize(k))
    pages = torch.full((3, v4.page_bytes(64)), 255, dtype=torch.uint8)
    slots = torch.tensor([5, 64, 191] + list(range(100, 137)))
    write_v4_records(pages, slots, k, 64)
    assert torch.equal(v4.read_records(pages, slots, 64), v4.quantize(k))
    assert (pages[0, 64 * 576 + 5 * 8 + 7] == 0) and (pages[0, 64 * 584:] == 255).all()  # pad byte, page padding


def test_caches_hold_what_the_model_wrote():
    c = dsv4_case()
    inputs = materialize_dsv4_inputs(c)
    swa = swa_pages(c, inputs, num_blocks(c.block_table), "cpu")
    assert (swa[0] == 255).all()  # the null block is never written
    r0 = v4.read_records(swa, torch.tensor([3 * 64 + 45]), 64)  # request 0, position 301: block 4 of its row (id 3)
    assert torch.equal(r0, v4.quantize(inputs.swa_values[0][301:302]))
    comp = compressed_pages(c, inputs, num_blocks(c.dsv4.compressed_block_table), "cpu")
    assert len(inputs.compressed_values[0]) == 302 // 4  # entries 0..74 complete; 75 is partly filled
    last = v4.read_records(comp, torch.tensor([2 * 64 + 10]), 64)  # entry 74: its row's block 1 (id 2), slot 10
    assert torch.equal(last, v4.quantize(inputs.compressed_values[0][74:75]))
    assert (v4.read_records(comp, torch.tensor([2 * 64 + 11]), 64) == 255).all()  # entry 75: not written


@pytest.mark.parametrize("features, archs", [("ROCM_FEATURES", ("gfx950", "gfx1201", "gfx1250")),
                                             ("ROCM_V41_FEATURES", ("gfx950", "gfx1201"))])
def test_the_rocm_layers_draw_their_archs_and_a_pinned_one_shows(features, archs):
    """The ROCm layers' `rocm_arch` knob (a swarm knob like the others): V4 on gfx950, gfx1201 and gfx1250, V4.1 on
    gfx950 and gfx1201 (its layer reads no gfx1250 flag); a swarm pinning one draws only it."""
    import strategies.dsv4_batches as batches
    from strategies.swarm import Swarm

    space = dsv4_space(P, getattr(batches, features))
    assert space.knobs["rocm_arch"] == archs
    for arch in archs:
        cases = drawn.draw_cases(space, Swarm((("rocm_arch", arch),)), 6, 7)
        assert {c.dsv4.rocm_arch for c in cases} == {arch}


@pytest.mark.parametrize("record", [584, 528])
def test_latents_on_a_records_values_are_what_the_record_and_a_plain_bf16_row_hold(record):
    """`Dsv4.latent_grid`: each latent rounded to what the record decodes to (exact in bf16) is a fixed point of the
    record's writer, so the record and a plain bf16 row of the same step hold the same values; the drawn latents
    move by at most the record's rounding."""
    from oracles import fp8_ds_mla_v41 as v41
    from strategies.dsv4_tensors import record_values, v41_records

    g = torch.Generator().manual_seed(4)
    k = (torch.randn(64, 512, generator=g) * torch.logspace(-6, 2, 64)[:, None]).to(torch.bfloat16)
    k[0] = 0
    values = record_values(k, record)
    assert torch.equal(record_values(values, record), values)
    model = v4 if record == 584 else v41
    records = torch.cat(v4_records(values), dim=-1) if record == 584 else v41_records(values)
    assert torch.equal(model.dequantize(records), values.float())
    assert ((values.float() - k.float()).abs() <= model.error_bound(k, model.quantize(k))).all()


def test_a_side_by_side_space_draws_latents_on_the_record_and_no_arch_on_v41s_528_byte_one():
    from dataclasses import replace

    from strategies.dsv4_batches import V41_FEATURES, dsv4_form

    space = dsv4_space(P, replace(V41_FEATURES, rocm_archs=("gfx950", "gfx1201"), latent_grid=True))
    cases = drawn.draw_cases(space, None, 30, 2)
    assert {c.dsv4.kv_record for c in cases} == {584, 528}
    assert all(c.dsv4.latent_grid == c.dsv4.kv_record and bool(c.dsv4.rocm_arch) == (c.dsv4.kv_record == 584)
               for c in cases)
    c = next(c for c in cases if c.dsv4.rocm_arch)
    plain = dsv4_form(c, {"kv_cache_dtype": "bfloat16", "cache_dtype": "bfloat16", "kv_record": 1024, "rocm_arch": ""})
    assert plain.kv_cache_dtype == "bfloat16" and plain.dsv4.latent_grid == c.dsv4.latent_grid
    a, b = materialize_dsv4_inputs(c), materialize_dsv4_inputs(plain)
    assert all(torch.equal(x, y) for x, y in zip(a.swa_values + a.compressed_values, b.swa_values + b.compressed_values))
    assert torch.equal(a.q, b.q) and torch.equal(a.topk_indices, b.topk_indices)
    with pytest.raises(CaseError, match="dsv4.q_rope_removed"):
        dsv4_form(c, {"q_rope_removed": True})
