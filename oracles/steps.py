"""A trace's verdicts: a step judge on every step that ran, and the last step run twice.

Each step is judged as a case of its own (`Case.steps` gives it its history, so its reference reads the K/V
its earlier steps wrote), with what the target observed of it (`Observation.steps`). An earlier step's
failures are reported with the step named; its passes are not repeated. The last step of a trace is run a
second time on the same metadata and buffers (`out_again`): FlashMLA's sparse kernels are deterministic, so
any other bits mean nondeterminism or state the first call left behind (what a CUDA-graph replay would read).
A step a full-graph engine replayed is also run eagerly on the same metadata (`out_eager`): the replay must
give the same bits (the same kernels on the same inputs), or it read tensors the step no longer fills. Where the
step's top-k indices are computed in it (an indexer, `topk_eager`: the eager run's rows), only tokens whose rows hold
the same ids in the same order in the two runs are compared: vLLM's decode top-k kernels write the k best in no promised
order (cooperative_topk scatters them through shared-memory atomics) and may break a tie at the k-th score either way,
and the attention's bits follow the ids and the order it reads them in. The replay's own top-k and output are judged
against the reference by the step's judge; the graph verdict names how many rows it left out, and why. An MTP draft step, run on the step before's metadata updated in place, is also run on metadata
built for it (`out_rebuilt`): the speculator's in-place update promises what a build gives.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from oracles.verdict import Verdict


def judge_steps(judge: Callable[..., list[Verdict]]) -> Callable[..., list[Verdict]]:
    def judged(case, obs) -> list[Verdict]:
        observed = [*obs.steps, obs]
        if len(observed) == 1 and not case.earlier:
            return judge(case, obs) + graph_verdicts(obs)
        steps = case.steps[: len(observed)]
        verdicts: list[Verdict] = []
        for k, (step, o) in enumerate(zip(steps, observed)):
            last = k == len(steps) - 1
            for v in judge(step, o) + graph_verdicts(o):
                if last or not v.ok:
                    verdicts.append(dataclasses.replace(v, detail=f"step {k + 1} of {len(case.steps)}: {v.detail}",
                                                        step=k + 1))
        return verdicts + rerun_verdicts(obs)

    judged.__doc__ = f"{judge.__name__} on every step of a trace, and the last step's rerun"
    judged.__name__ = judge.__name__
    return judged


def graph_verdicts(obs) -> list[Verdict]:
    """A replayed step against the same step run eagerly (`out_eager`), and an MTP draft step on metadata
    updated in place against the same step on metadata built for it (`out_rebuilt`): the same bits, or class M."""
    return [*_same_bits(obs, "out_eager", "graph", "the step replayed from its CUDA graph gave the bits of the step "
                        "run eagerly", "the step replayed from its captured CUDA graph differs from the same step run "
                        "eagerly on the same metadata", "the replay read tensors the step's metadata no longer fills",
                        rows=_same_topk_rows(obs)),
            *_same_bits(obs, "out_rebuilt", "draft", "the MTP draft step on metadata updated in place gave the bits of "
                        "the step on metadata built for it", "the MTP draft step on the step before's metadata, updated "
                        "in place (update_draft_decode_metadata), differs from the same step on metadata built for it",
                        "the in-place update left the metadata other than a build makes it")]


def _same_topk_rows(obs) -> tuple[torch.Tensor, str] | None:
    """(per output row, whether its bits are compared; why the others are not): compared where the replay
    (`topk_indices_buffer`) and the eager run (`topk_eager`) left the same ids in the same order; None where the step
    observed no eager top-k."""
    eager, replay, out = (obs.outputs.get(k) for k in ("topk_eager", "topk_indices_buffer", "out"))
    if eager is None or replay is None or out is None:
        return None
    n = out.shape[0]
    eager, replay = eager[:n], replay[:n]
    same = (eager == replay).all(dim=1)
    reordered = ~same & (eager.sort(dim=1).values == replay.sort(dim=1).values).all(dim=1)
    other = ~same & ~reordered
    why = [f"{int(m.sum())} with {what}" for m, what in ((reordered, "their top-k ids in another order"),
                                                          (other, "another top-k selection (a tie at the k-th score "
                                                           "may go either way; the replay's own is judged)"))
           if int(m.sum())]
    return same, "; ".join(why) + " (vLLM's top-k kernels promise no order)"


def _same_bits(obs, name: str, check: str, same: str, differs: str, why: str,
               rows: tuple[torch.Tensor, str] | None = None) -> list[Verdict]:
    """`name` against `out`, bit for bit, on every row or on the rows `rows` marks (the others are named in the
    detail as not compared, with rows' reason)."""
    other, out = obs.outputs.get(name), obs.outputs.get("out")
    if other is None or out is None:
        return []
    other = other[: out.shape[0]]
    n = out.shape[0]
    if other.shape != out.shape:
        return [Verdict(check, False, f"{differs}: shape {tuple(other.shape)}, not {tuple(out.shape)}: {why}", "M",
                        where=check)]
    compared = torch.ones(n, dtype=torch.bool, device=out.device) if rows is None else rows[0].to(out.device)
    skipped = n - int(compared.sum())
    note = f"; {skipped} of {n} rows not compared: {rows[1]}" if skipped else ""
    wrong = (_bits(other).view(n, -1) != _bits(out).view(n, -1)).any(dim=1) & compared if n else compared
    bad = wrong.nonzero().flatten()
    if not len(bad):
        return [Verdict(check, True, same + note)]
    return [Verdict(check, False, f"{differs} in {len(bad)} of {n - skipped} rows (first row {int(bad[0])}){note}: "
                    f"{why}", "M", where=check)]


def rerun_verdicts(obs) -> list[Verdict]:
    again, out = obs.outputs.get("out_again"), obs.outputs.get("out")
    if again is None or out is None:
        return []
    again = again[: out.shape[0]]
    same = again.shape == out.shape and torch.equal(_bits(again), _bits(out))
    if same:
        return [Verdict("rerun", True, "the last step run again gave the same bits")]
    rows = (_bits(again).view(out.shape[0], -1) != _bits(out).view(out.shape[0], -1)).any(dim=1).nonzero().flatten()
    return [Verdict("rerun", False, f"the last step run again on the same metadata gave other bits in {len(rows)} of "
                    f"{out.shape[0]} rows (first row {int(rows[0]) if len(rows) else '-'})", where="rerun",
                    step=len(obs.steps) + 1)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)
