"""Verdicts for a whole sparse-MLA backend call: output and LSE against the fp32 reference, NaN/Inf,
rows with no valid index, and a KV cache that the call must leave byte-identical."""

from __future__ import annotations

import torch

from oracles.attention import error_margin, sparse_mla_reference, tolerance
from oracles.materialize import SM_SCALE, materialize_attention_inputs
from oracles.verdict import Verdict, passed


def reference_for(case, inputs=None, device: str = "cpu", slot_values=None):
    """(out [T, H, 512], lse [T, H], valid_rows [T]) on CPU, from request-local positions and the case's own
    block table: independent of vLLM's remap. Positions outside [0, seq_len) are not selected. Computed on
    `device` (in float64): a GPU host judges its large cases on the GPU. `slot_values` (slots, rows) replaces
    the K/V of those physical slots: a quantized cache is judged by what its bytes hold."""
    inp = inputs or materialize_attention_inputs(case, "cpu")
    kv = torch.cat([inp.kv_c, inp.k_pe], dim=-1).float()
    if slot_values is not None:
        kv = kv.clone()
        kv[slot_values[0].long().cpu()] = slot_values[1].float().cpu()
    kv = kv.to(device)
    topk = inp.index.topk_indices.long().to(device)
    rows, offsets, start = [], [], 0
    for r, req in enumerate(case.requests):
        rows.append(kv[inp.slot_of[r].to(device)])
        offsets.append(start)
        start += req.seq_len
    k_all = torch.cat(rows) if rows else torch.zeros(0, kv.shape[1], device=device)
    req_of = inp.index.req_id_per_token.long().to(device)
    offset = torch.tensor(offsets, dtype=torch.long, device=device)[req_of][:, None]
    seq_len = inp.index.seq_lens.long().to(device)[req_of][:, None]
    indices = torch.where((topk >= 0) & (topk < seq_len), topk + offset, torch.full_like(topk, -1))
    out, lse = sparse_mla_reference(inp.q.float().to(device), k_all, indices, SM_SCALE, 512)
    return out.cpu(), lse.cpu(), (indices >= 0).any(dim=1).cpu()


def judge_fp8_ds_mla_entries(case, inputs, slots, entries):
    """The 656-byte entries the cache writer produced, read back: (slots, dequantized rows) for the reference,
    and a verdict if they do not hold the values written (scale convention, layout; classes K and E).

    The kernels consume the entries' values, so the output is judged against attention over exactly those
    (rounded to bf16, as the kernels dequantize), with bf16's tolerance: the quantization error itself is
    judged here, once, at the fp8 bound."""
    from oracles.fp8_ds_mla import dequantize, split_entry

    values = dequantize(entries.cpu()).to(torch.bfloat16).float()
    want = torch.cat([inputs.kv_c, inputs.k_pe], dim=-1).float()[slots.long().cpu()]
    # e4m3 keeps 3 mantissa bits (2^-4 relative) down to its subnormal step, 2^-9 times the tile's scale;
    # the RoPE half is bf16 written as bf16.
    scale = split_entry(entries.cpu())[1].float().repeat_interleave(128, dim=-1)
    bound = torch.cat([2**-4 * want[:, :512].abs() + 2**-9 * scale, 2**-8 * want[:, 512:].abs()], dim=-1)
    bad = ~((values - want).abs() <= bound + 1e-30)
    verdict = None
    if bad.any():
        row, col = (int(x) for x in bad.nonzero()[0])
        verdict = Verdict("cache_write", False, f"fp8_ds_mla entry of slot {int(slots[row])} reads back {values[row, col]:.4g} "
                                                f"at element {col}, written {want[row, col]:.4g} ({int(bad.sum())} elements off)",
                          "K" if col < 512 else "E", where="cache_write")
    return (slots, values), verdict


def attention_tolerance(case, inputs) -> tuple[float, float]:
    """vLLM's test tolerances are for values of order 1: atol scales with the largest V the case holds, so
    tiny values are not waved through and large ones (bf16 P and output rounding) are not flagged."""
    # A quantized cache is judged through its read-back values (judge_fp8_ds_mla_entries): bf16 from there.
    atol, rtol = tolerance("bfloat16", "bfloat16")
    return atol * (max(float(inputs.kv_c.float().abs().max()), 1e-6) if inputs.kv_c.numel() else 1.0), rtol


def judge_attention(case, obs) -> list[Verdict]:
    verdicts: list[Verdict] = []
    for v in obs.memory:
        verdicts.append(Verdict("memory", False, v.describe(), "C", where=v.kernel))
    if obs.error_type is not None:
        return verdicts + [Verdict("error", False, f"{obs.error_type}: {obs.error}", where=obs.error_type)]
    if obs.notes.get("cache_changed"):
        verdicts.append(Verdict("cache", False, f"the KV cache changed during an attention call that must only read "
                                                f"it: {obs.notes['cache_changed']}", "H", where="cache"))
    inputs = materialize_attention_inputs(case, "cpu")
    slot_values = None
    if case.kv_cache_dtype == "fp8_ds_mla" and "cache_entries" in obs.outputs:
        slot_values, write_verdict = judge_fp8_ds_mla_entries(case, inputs, obs.outputs["cache_slots"],
                                                              obs.outputs["cache_entries"])
        verdicts += [write_verdict] if write_verdict else []
    out_ref, lse_ref, valid_rows = reference_for(case, inputs, device=obs.device, slot_values=slot_values)
    out = obs.outputs["out"].float()
    if out.shape != out_ref.shape:
        return verdicts + [Verdict("output", False, f"output shape {tuple(out.shape)}, expected {tuple(out_ref.shape)}",
                                   "J", where="shape")]
    bad = ~torch.isfinite(out)
    if bad.any():
        t, h, _ = (int(x) for x in bad.nonzero()[0])
        kind = "row with no valid index" if not valid_rows[t] else "valid row"
        verdicts.append(Verdict("nan", False, f"{int(bad.sum())} non-finite outputs; first token {t} head {h} "
                                              f"({kind}; reference is finite)", "I", where="nan"))
    atol, rtol = attention_tolerance(case, inputs)
    empty = ~valid_rows
    if empty.any() and torch.isfinite(out[empty]).all() and out[empty].abs().max() > 0:
        t = int(empty.nonzero()[0])
        verdicts.append(Verdict("empty_row", False, f"token {t} selects no valid index but its output is not 0 "
                                                    f"(max |out| {out[t].abs().max():.3g})", "B", where="empty_row"))
    finite = torch.isfinite(out)
    margin = error_margin(torch.where(finite, out, out_ref), out_ref, atol, rtol)
    if margin > 1:
        err = ((out - out_ref).abs() / (atol + rtol * out_ref.abs())).nan_to_num(0)
        t, h, d = (int(x) for x in (err == err.max()).nonzero()[0])
        verdicts.append(Verdict("output", False, f"output off by {margin:.2f}x the tolerance (atol {atol}, rtol {rtol}); "
                                                 f"worst at token {t} head {h} dim {d}: {out[t, h, d]:.4g} vs "
                                                 f"{out_ref[t, h, d]:.4g}", margin=margin, where="output"))
    lse = obs.outputs.get("lse")
    if lse is not None:
        lse_margin = error_margin(lse.float(), lse_ref, 1e-2, 1e-2)
        if lse_margin > 1:
            verdicts.append(Verdict("lse", False, f"LSE off by {lse_margin:.2f}x the tolerance", "G", margin=lse_margin,
                                    where="lse"))
    if not verdicts:
        verdicts.append(passed("output", f"{case.num_tokens} tokens within tolerance", margin=margin))
    return verdicts
