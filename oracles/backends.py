"""Backends judged against each other: one step run through every sparse-MLA backend a host can run
(`vllm.sparse_mla.all`). Each backend's observation is judged as its own target's would be, against the fp32
reference, its verdicts naming it; and each pair of backends that gave an output is compared. Two outputs that
are each within the tolerance of the reference are within twice it of each other: a pair further apart means
at least one is wrong, and the backend that every failing pair names is the one out of line.

DeepSeek-V4's and V4.1's backends (`vllm.dsv4.all`, `vllm.dsv41.all`: `judge_dsv4_backends`) each store the step in
their own form (the 584-byte record, plain bf16 rows of the same values, V4.1's MXFP8 record; an emulated AMD arch;
the mega kernel's unroped q): each part is judged by the DeepSeek-V4 oracle on the case its notes name
(`case_fields`), and the pairs are compared in one frame, the RoPE that ROCm's and the mega layer take back out of
their output put back (`oracles.dsv4.roped_frame`), within the sum of the two parts' tolerances."""

from __future__ import annotations

import dataclasses
from itertools import combinations

from oracles.attention import error_margin
from oracles.attention_judge import attention_tolerance, judge_attention
from oracles.dsv4 import frame_tolerance, judge_dsv4, reference_for, roped_frame
from oracles.verdict import Verdict, passed
from strategies.dsv4_batches import dsv4_form
from strategies.tensors import materialize_attention_inputs


def judge_backends(case, obs) -> list[Verdict]:
    verdicts: list[Verdict] = []
    outs = {}
    for name, part in obs.parts.items():
        for v in judge_attention(case, part):
            if not v.ok:  # each failure names its backend, and the backend is part of its signature
                verdicts.append(dataclasses.replace(v, detail=f"{name}: {v.detail}", where=f"{name}:{v.where or v.check}"))
        if part.error_type is None and part.outputs.get("out") is not None:
            outs[name] = part.outputs["out"]
    if len(outs) >= 2:
        verdicts += _pairs(case, obs, outs)
    if not verdicts:
        verdicts.append(passed("output", f"{case.num_tokens} tokens within tolerance on {', '.join(obs.parts)}"))
    return verdicts


def judge_dsv4_backends(case, obs) -> list[Verdict]:
    """Each DeepSeek-V4 backend's part judged on its own form of the step, its verdicts named after it (the passing
    ones too where they carry a margin: a campaign's margins are each backend's worst); then each pair of outputs,
    the step's real tokens and heads in the RoPE'd frame, within the sum of their tolerances."""
    verdicts: list[Verdict] = []
    outs, tolerances = {}, {}
    for name, part in obs.parts.items():
        form = dsv4_form(case, part.notes.get("case_fields", {}))
        for v in judge_dsv4(form, part):
            if not v.ok or v.margin is not None:
                verdicts.append(dataclasses.replace(v, detail=f"{name}: {v.detail}", where=f"{name}:{v.where or v.check}"))
        out = part.outputs.get("out")
        if part.error_type is None and out is not None and out.shape[0] >= case.num_tokens and out.shape[1] >= case.heads:
            outs[name] = roped_frame(form, out[: case.num_tokens, : case.heads], obs.device)
            tolerances[name] = reference_for(form, part.outputs["swa_pages"], part.outputs.get("compressed_pages"),
                                             obs.device)[1:3]
    if len(outs) >= 2:
        verdicts += _apart(outs, tolerances, obs.device, _roped_margin) or [
            passed("backends", f"{', '.join(outs)} agree on {case.num_tokens} tokens",
                   margin=max(_roped_margin(outs[a], outs[b], tolerances[a], tolerances[b], obs.device)
                              for a, b in combinations(sorted(outs), 2)))]
    if all(v.ok for v in verdicts):
        verdicts.append(passed("output", f"{case.num_tokens} tokens within tolerance on {', '.join(obs.parts)}"))
    return verdicts


def _margin(x, y, tolerance_x: tuple, tolerance_y: tuple, device) -> float:
    """How far apart two outputs are, in the sum of their (atol, rtol) tolerances (<= 1: they agree)."""
    return error_margin(x.to(device).float(), y.to(device).float(), tolerance_x[0] + tolerance_y[0],
                        tolerance_x[1] + tolerance_y[1])


def _roped_margin(x, y, tolerance_x: tuple, tolerance_y: tuple, device) -> float:
    """`_margin` in the RoPE'd frame, where a pair of RoPE dims shares its errors (`oracles.dsv4.frame_tolerance`)."""
    y = y.to(device)
    tolerance = frame_tolerance(y, tolerance_x[0] + tolerance_y[0], tolerance_x[1] + tolerance_y[1])
    return error_margin(x.to(device), y, tolerance, 0.0)


def _pairs(case, obs, outs: dict) -> list[Verdict]:
    atol, rtol = attention_tolerance(case, materialize_attention_inputs(case, obs.device))
    return _apart(outs, dict.fromkeys(outs, (atol, rtol)), obs.device)


def _apart(outs: dict, tolerances: dict, device, margin=_margin) -> list[Verdict]:
    """A `backends` verdict where two outputs are further apart than the sum of their (atol, rtol) tolerances
    (`margin` says how far), naming the backend out of line where the others agree; none where every pair agrees."""
    apart = {}
    for a, b in combinations(sorted(outs), 2):
        x, y = outs[a].to(device).float(), outs[b].to(device).float()
        if x.shape != y.shape:
            apart[a, b] = f"outputs of shapes {tuple(x.shape)} and {tuple(y.shape)}"
            continue
        (atol_a, rtol_a), (atol_b, rtol_b) = tolerances[a], tolerances[b]
        m = margin(x, y, tolerances[a], tolerances[b], device)
        if m > 1:
            apart[a, b] = (f"{m:.3g}x twice the tolerance (atol {atol_a:.3g}, rtol {rtol_a}) apart"
                           if (atol_a, rtol_a) == (atol_b, rtol_b) else
                           f"{m:.3g}x the sum of their tolerances (atol {atol_a + atol_b:.3g}, rtol "
                           f"{rtol_a + rtol_b:.3g}) apart")
    if not apart:
        return []
    # The backend in every pair that is apart, where the others agree among themselves: the one out of line.
    # Where one pair alone is apart, either of the two may be: neither is named.
    odd = [n for n in outs if all(n in pair for pair in apart) and len(outs) > 2
           and not any(n not in pair and set(pair) <= set(outs) for pair in apart)]
    odd = odd if len(odd) == 1 else []
    who = f"{odd[0]} disagrees with {', '.join(n for n in sorted(outs) if n != odd[0])}, which agree" if odd else \
        "no backend agrees with all the others"
    return [Verdict("backends", False, f"{who}: " + "; ".join(f"{a} and {b}: {why}" for (a, b), why in apart.items()),
                    where=odd[0] if odd else "|".join(sorted({n for pair in apart for n in pair})))]
