"""Is a Step5 DSA step right? (`vllm.step5_dsa`, Case.step5.) torch only.

Per step, from what the target saw (outputs `out.<j>`, `selected.<j>`, `summary.<j>`, `ring.<j>` for step j from 1,
and `mean`, the summary cache after the last step):

- `cache_write`: the summary of a region the step's token closes (position % 8 == 7) decodes to the reference
  summary (the online softmax over the region's eight indexer rows, strategies.step5_tensors.encode_summaries) within
  one e4m3 rounding step; an open-region token's tail-ring row holds its key and z exactly (bf16); after the last
  step every region slot of the summary cache holds its closed region's summary or its poison (0xFF), nothing else.
- `topk`: each (token, KV group) row's selection is the backend's contract (`select_regions`): its own region c =
  position // 8 and min(c, k) distinct closed regions of [0, c) (k = min(topk, the table's region capacity)), in
  the trailing slots the attention kernel reads, -1 before them; no closed region left out scoring above a selected
  one by more than fp32 rounding; where scores tie exactly at the cut, the lower region ids (the backend's stable
  order). Scores in fp64 from the fp8 queries and the reference summaries: sum over heads of w * relu(q . s).
- `output` (and `nan`): each row's output against an fp32 reference over the tokens of its selected regions up to
  its position (softmax(q k^T / sqrt(192)) v, the cache's K and V as stored: bf16, or e4m3 times the layer's scales),
  rounded to bf16 and multiplied by the headwise gate's sigmoid (rounded to bf16 first, as the kernel and the
  separate gate kernel round it). With a selection that breaks the contract, the reference's own top-k.
- `padded_rows`: a graph-padding row's output (slot -1: inactive) is exactly 0, as the attention kernels clear it.
- `cache`: the forward wrote no byte of the paged KV cache (the layer writes it before attention).
"""

from __future__ import annotations

import torch

from oracles.verdict import Verdict, passed
from strategies.case import Case
from strategies.step5_tensors import (
    HEAD_SIZE,
    REGION,
    materialize_step5,
    positions,
    request_summaries,
)
from strategies.tensors import to_e4m3

ATOL = RTOL = 0.02  # bf16 probabilities in the kernel's P.V (fp16 with an fp8 cache), bf16 output and gate
SCORE_RTOL = 5e-5  # fp32 sums of 256 exact fp8 products and of 8 weighted heads, against fp64 (worst case ~1.5e-5)


def fp8_values(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.float8_e4m3fn).double()


def region_scores(q8: torch.Tensor, w: torch.Tensor, summaries: torch.Tensor) -> torch.Tensor:
    """fp64 [regions]: sum over heads of w_h * relu(q_h . s_r), q8 [8, 256] fp8, w [8] fp32, summaries [R, 256] uint8."""
    dots = torch.relu(q8.double() @ fp8_values(summaries).T)  # [8, R]
    return (w.double()[:, None] * dots).sum(0)


def judge_step5(case: Case, obs) -> list[Verdict]:
    if obs.error_type:
        return [Verdict("error", False, f"{obs.error_type}: {obs.error}")]
    x = case.step5
    out: list[Verdict] = []
    if obs.memory:
        out.append(Verdict("memory", False, f"{len(obs.memory)} out-of-bounds access(es): {obs.memory[0]}",
                           bug_class="C", where=str(obs.memory[0]).split(" (")[0][:80]))
    if obs.notes.get("cache_changed"):
        out.append(Verdict("cache", False, obs.notes["cache_changed"], bug_class="H", where="kv_cache"))
    inp = materialize_step5(case)
    width_regions = len(case.block_table[0]) * case.block_size // REGION
    k = min(x.region_topk, width_regions)
    # every closed region's reference summary, per request
    summaries = [request_summaries(inp, i, r.seq_len // REGION) for i, r in enumerate(case.requests)]
    for j in range(x.steps):
        step = j + 1
        got = obs.outputs.get(f"out.{j}")
        sel = obs.outputs.get(f"selected.{j}")
        if got is None or sel is None:
            out.append(Verdict("shape", False, f"step {step}: no output or no selection returned", step=step))
            continue
        pos = positions(case, j)
        out += _cache_writes(case, inp, obs, j, pos, summaries)
        bad_sel: list[str] = []
        worst, worst_where = 0.0, ""
        for i, p in enumerate(pos):
            c = p // REGION
            for g in range(x.groups):
                row = sel[i * x.groups + g].tolist()
                problem = _selection_problem(row, c, k, region_scores(inp.proxy_q[j][g, i].float(),
                                                                      inp.proxy_w[j][g, i], summaries[i][:c]))
                if problem:
                    bad_sel.append(f"token {i} group {g} (position {p}): {problem}")
                    regions = _reference_selection(c, k, region_scores(inp.proxy_q[j][g, i].float(),
                                                                       inp.proxy_w[j][g, i], summaries[i][:c]))
                else:
                    regions = [r for r in row if r >= 0]
                ref = _reference_row(case, inp, j, i, g, p, regions)
                o = got[i, g * (case.heads // x.groups):(g + 1) * (case.heads // x.groups)].float()
                if torch.isnan(o).any() or torch.isinf(o).any():
                    out.append(Verdict("nan", False, f"step {step}: token {i} group {g}: NaN/Inf where the reference "
                                       "is finite", bug_class="I", where="output", step=step))
                    continue
                err = ((o - ref).abs() / (ATOL + RTOL * ref.abs())).max().item()
                if err > worst:
                    worst, worst_where = err, f"token {i} group {g} (position {p}, {len(regions)} regions)"
        pad = got[len(pos):]
        if pad.numel() and not bool((pad == 0).all()):
            rows = sorted({int(r) for r in (pad != 0).nonzero()[:, 0]})
            out.append(Verdict("padded_rows", False, f"step {step}: padding row(s) {rows} not cleared to 0 (inactive "
                               "rows: slot -1; the gated write clears them)", bug_class="H", where="padded_rows",
                               step=step))
        if bad_sel:
            out.append(Verdict("topk", False, f"step {step}: {len(bad_sel)} row(s) break the region selection: "
                               f"{bad_sel[0]}", bug_class="O", where="selected", step=step))
        else:
            out.append(passed("topk"))
        if worst > 1:
            out.append(Verdict("output", False, f"step {step}: {worst_where}: max error / tolerance {worst:.3g}",
                               margin=worst, where="output", step=step))
        else:
            out.append(passed("output", margin=worst))
    out += _final_summaries(case, obs, summaries)
    return out


def _selection_problem(row: list[int], c: int, k: int, scores: torch.Tensor) -> str:
    live = min(c + 1, k + 1)
    kept = [r for r in row if r >= 0]
    if len(row) != k + 1:
        return f"width {len(row)}, expected {k + 1}"
    if c not in kept:
        return f"its own region {c} missing: {row}"
    history = [r for r in kept if r != c]
    if any(r < 0 or r >= c for r in history) or len(set(history)) != len(history):
        return f"history regions outside [0, {c}) or repeated: {row}"
    if len(history) != min(c, k):
        return f"{len(history)} closed regions, expected min({c}, {k}) = {min(c, k)}: {row}"
    if row[len(row) - live:] != [r for r in row if r >= 0] or any(r >= 0 for r in row[:len(row) - live]):
        return f"the kept regions are not the trailing {live} slots the attention reads: {row}"
    if c > k:
        chosen = torch.tensor(history)
        left = torch.tensor(sorted(set(range(c)) - set(history)))
        lo, hi = scores[chosen].min().item(), scores[left].max().item()
        tol = SCORE_RTOL * (abs(lo) + abs(hi) + 1e-30)
        if hi > lo + tol:
            return f"region {int(left[scores[left].argmax()])} scores {hi:.6g} above selected region " \
                   f"{int(chosen[scores[chosen].argmin()])} ({lo:.6g})"
        tied_out = [int(r) for r in left if scores[r].item() == lo]
        tied_in = [int(r) for r in chosen if scores[r].item() == lo]
        if tied_out and tied_in and min(tied_out) < max(tied_in):
            return f"a tie at the cut ({lo:.6g}) kept region {max(tied_in)} over the lower region {min(tied_out)}"
    return ""


def _reference_selection(c: int, k: int, scores: torch.Tensor) -> list[int]:
    if c <= k:
        return list(range(c + 1))
    order = sorted(range(c), key=lambda r: (-scores[r].item(), r))
    return sorted(order[:k]) + [c]


def _reference_row(case: Case, inp, j: int, i: int, g: int, p: int, regions: list[int]) -> torch.Tensor:
    """fp32 reference of one (token, group) row's heads over its regions' tokens up to position p, gated."""
    x = case.step5
    heads = case.heads // x.groups
    tokens = [t for r in regions for t in range(r * REGION, r * REGION + REGION) if t <= p]
    kk, vv = inp.k[i][tokens, g].float(), inp.v[i][tokens, g].float()
    if case.kv_cache_dtype == "fp8":  # as stored: e4m3 of x / scale, read back times the scale
        kk = to_e4m3(kk / inp.k_scale).float() * inp.k_scale
        vv = to_e4m3(vv / inp.v_scale).float() * inp.v_scale
    q = inp.q[j][i, g * heads:(g + 1) * heads].float()
    att = torch.softmax(q @ kk.T * HEAD_SIZE ** -0.5, dim=-1) @ vv
    sig = torch.sigmoid(inp.gate[j][i, g * heads:(g + 1) * heads].float()).bfloat16().float()
    return (att.bfloat16().float() * sig[:, None]).bfloat16().float()


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two e4m3 summaries within one rounding step of each other (online-softmax exp and order differences)."""
    va, vb = fp8_values(a), fp8_values(b)
    return bool(((va - vb).abs() <= vb.abs() / 8 + 2.0 ** -9).all())


def _cache_writes(case: Case, inp, obs, j: int, pos: list[int], summaries) -> list[Verdict]:
    step, bad = j + 1, []
    summary, ring = obs.outputs.get(f"summary.{j}"), obs.outputs.get(f"ring.{j}")
    for i, p in enumerate(pos):
        if p % REGION == REGION - 1:
            if not _close(summary[i], summaries[i][p // REGION]):
                bad.append(f"token {i} closes region {p // REGION} (position {p}): its summary is not the region's")
        else:
            want = torch.cat([inp.index_key[i][p], inp.index_z[i][p]])
            if not torch.equal(ring[i].view(torch.int16), want.view(torch.int16)):
                bad.append(f"token {i} (position {p}): its tail-ring row is not its [key | z]")
    if bad:
        return [Verdict("cache_write", False, f"step {step}: {bad[0]}" + (f" (+{len(bad) - 1} more)" if len(bad) > 1
                                                                          else ""), bug_class="D",
                        where="summary" if "summary" in bad[0] else "ring", step=step)]
    return [passed("cache_write")]


def _final_summaries(case: Case, obs, summaries) -> list[Verdict]:
    """After the last step: each used block's region slots hold their closed region's summary or the poison."""
    mean = obs.outputs.get("mean")
    if mean is None:
        return []
    bs, per_block = case.block_size, case.block_size // REGION
    for i, r_ in enumerate(case.requests):
        closed = r_.seq_len // REGION
        blocks = list(case.block_table[i][: -(-r_.seq_len // bs)])
        slots = mean[blocks, 0].reshape(len(blocks) * per_block, -1).cpu()  # region r at slot r
        got, want = slots[:closed], summaries[i]
        va, vb = fp8_values(got), fp8_values(want)
        off = ((va - vb).abs() > vb.abs() / 8 + 2.0 ** -9).any(dim=1).nonzero()
        if len(off):
            region = int(off[0])
            return [Verdict("cache_write", False, f"request {i}'s closed region {region} (block "
                            f"{blocks[region // per_block]} slot {region % per_block}) does not hold its summary after "
                            "the last step", bug_class="D", where="summary")]
        early = (slots[closed:] != 0xFF).any(dim=1).nonzero()
        if len(early):
            region = closed + int(early[0])
            return [Verdict("cache_write", False, f"request {i}'s open region {region} (block "
                            f"{blocks[region // per_block]} slot {region % per_block}) was written before it closed",
                            bug_class="D", where="summary")]
    return [passed("cache_write")]
