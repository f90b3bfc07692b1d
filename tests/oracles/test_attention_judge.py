"""The backend judge's read-back of fp8_ds_mla entries: right bytes pass, wrong scale or layout do not."""

import torch

from oracles.attention_judge import judge_fp8_ds_mla_entries
from oracles.fp8_ds_mla import quantize
from strategies.tensors import materialize_attention_inputs
from tests.strategies.test_case import small_case


def _entries(case, convention="pow2"):
    inputs = materialize_attention_inputs(case)
    slots = torch.unique(torch.cat(inputs.slot_of))
    return inputs, slots, quantize(inputs.kv_c[slots].float(), inputs.k_pe[slots].float(), convention)


def test_entries_written_by_either_convention_read_back():
    for values in ("normal", "large", "tiny", "zero_tiles"):
        case = small_case(kv_cache_dtype="fp8_ds_mla", values=values)
        for convention in ("pow2", "arbitrary"):
            inputs, slots, entries = _entries(case, convention)
            (got_slots, rows), verdict = judge_fp8_ds_mla_entries(case, inputs, slots, entries)
            assert verdict is None, (values, convention, verdict)
            assert torch.equal(got_slots, slots) and rows.shape == (len(slots), 576)


def test_wrong_scale_and_flat_layout_are_seen():
    case = small_case(kv_cache_dtype="fp8_ds_mla")
    inputs, slots, entries = _entries(case)
    halved = entries.clone()
    scales = halved[:, 512:528].contiguous().view(torch.float32) / 2  # a reader/writer scale mismatch
    halved[:, 512:528] = scales.view(torch.uint8)
    assert judge_fp8_ds_mla_entries(case, inputs, slots, halved)[1].bug_class == "K"
    flat = entries.clone()
    flat[:, :576] = (torch.cat([inputs.kv_c, inputs.k_pe], -1)[slots].float().clamp(-448, 448)
                     .to(torch.float8_e4m3fn).view(torch.uint8))  # flat fp8 with no tile scales (class E)
    assert not judge_fp8_ds_mla_entries(case, inputs, slots, flat)[1].ok
