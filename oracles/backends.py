"""Backends judged against each other: one step run through every sparse-MLA backend a host can run
(`vllm.sparse_mla.all`). Each backend's observation is judged as its own target's would be, against the fp32
reference, its verdicts naming it; and each pair of backends that gave an output is compared. Two outputs that
are each within the tolerance of the reference are within twice it of each other: a pair further apart means
at least one is wrong, and the backend that every failing pair names is the one out of line."""

from __future__ import annotations

import dataclasses
from itertools import combinations

from oracles.attention import error_margin
from oracles.attention_judge import attention_tolerance, judge_attention
from oracles.verdict import Verdict, passed
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


def _pairs(case, obs, outs: dict) -> list[Verdict]:
    atol, rtol = attention_tolerance(case, materialize_attention_inputs(case, obs.device))
    apart = {}
    for a, b in combinations(sorted(outs), 2):
        x, y = outs[a].to(obs.device).float(), outs[b].to(obs.device).float()
        if x.shape != y.shape:
            apart[a, b] = f"outputs of shapes {tuple(x.shape)} and {tuple(y.shape)}"
            continue
        margin = error_margin(x, y, 2 * atol, 2 * rtol)
        if margin > 1:
            apart[a, b] = f"{margin:.3g}x twice the tolerance (atol {atol:.3g}, rtol {rtol}) apart"
    if not apart:
        return []
    # The backend in every pair that is apart, where the others agree among themselves: the one out of line.
    odd = [n for n in outs if all(n in pair for pair in apart) and len(outs) > 2
           and not any(n not in pair and set(pair) <= set(outs) for pair in apart)]
    who = f"{odd[0]} disagrees with {', '.join(n for n in sorted(outs) if n != odd[0])}, which agree" if odd else \
        "no backend agrees with all the others"
    return [Verdict("backends", False, f"{who}: " + "; ".join(f"{a} and {b}: {why}" for (a, b), why in apart.items()),
                    where=odd[0] if odd else "|".join(sorted({n for pair in apart for n in pair})))]
