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


def test_a_kernel_refusing_a_per_token_argument_s_shape_is_class_a():
    """FA3 refuses one seqused_k count per token of another batch before it launches (the seed bug at
    FLASH_ATTN_MLA_SPARSE's call site, seen with the real kernel on the H200): the same row contract as an access past
    the remap's per-token arrays. Other errors keep no class."""
    from types import SimpleNamespace

    from oracles.attention_judge import _call_verdicts

    def obs(error):
        return SimpleNamespace(memory=[], notes={}, error_type="RuntimeError", error=error)

    refused = _call_verdicts(obs("mha_fwd, hopper/flash_api.cpp:910, seqused_k must have shape (batch_size)"))[0]
    assert [v.bug_class for v in refused] == ["A"] and not refused[0].ok
    assert [v.bug_class for v in _call_verdicts(obs("CUDA error: an illegal memory access"))[0]] == [""]
