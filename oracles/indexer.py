"""The oracle of DeepSeek-V3.2 / GLM-5's lightning indexer (`vllm.indexer`), judged from the index cache's bytes.

The index cache of one layer is [num_blocks, block_size, 132] uint8, block-major: a block holds block_size keys of
128 fp8 (e4m3) values, then block_size fp32 scales, one per key (quant block 128; ue8m0: a power of two). A step:
  * cache_write: every key the step (and the engine before it) wrote decodes to the bf16 key within fp8's rounding
    at its scale, and the scale is the power of two ue8m0 makes of amax / 448; slots nothing wrote stay poisoned.
  * topk: for each real token of a request at position p, the row holds min(p + 1, topk) distinct ids in [0, p],
    then -1; its scores, in fp64 from the cache's bytes as written (sum over heads of relu(q . k) x weight), are the
    top ones: none below the k-th best by more than the tolerance (ties may go either way).
  * padded_rows: a CUDA-graph padding token's row is all -1 (the op clears the rows it is handed first).
  * buffer_rows: the persistent buffer's rows past the step's are as the step found them.
"""

from __future__ import annotations

import torch

from oracles.verdict import Verdict, passed
from strategies.case import Case
from strategies.indexer_tensors import INDEX_HEAD_DIM, key_pool, materialize_indexer_inputs
from strategies.tensors import FP8_MAX

SCALE_BYTES = 4
POISON_BYTE = 0xFF  # the cache before the first write: every value e4m3 NaN, every scale an fp32 NaN
BUG_CLASS_TOPK = "O"


def decode_index_cache(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values fp64 [slots, 128], scales fp64 [slots]) of a [num_blocks, block_size, 132] uint8 index cache."""
    num_blocks, block_size, entry = cache.shape
    flat = cache.reshape(num_blocks, block_size * entry)
    values = flat[:, : block_size * INDEX_HEAD_DIM].reshape(num_blocks * block_size, INDEX_HEAD_DIM)
    scales = flat[:, block_size * INDEX_HEAD_DIM:].contiguous().view(torch.float32).reshape(-1)
    return values.contiguous().view(torch.float8_e4m3fn).double(), scales.double()


def _ue8m0_scale(k: torch.Tensor) -> torch.Tensor:
    """The scale vLLM's writer makes of a key with scale_fmt "ue8m0": 2^ceil(log2(amax / 448))."""
    amax = k.double().abs().amax(dim=-1).clamp(min=1e-4)  # the kernel's floor (csrc cache_kernels: fmaxf(amax, 1e-4))
    return torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))


def judge_index_cache(cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, never_written: torch.Tensor) -> list[Verdict]:
    values, scales = decode_index_cache(cache)
    slots, keys = slots.to(cache.device), keys.to(cache.device).double()
    bad = []
    if slots.numel():
        want_scale = _ue8m0_scale(keys)
        got_scale = scales[slots]
        wrong_scale = ~torch.isclose(got_scale, want_scale, rtol=0, atol=0)
        deq = values[slots] * got_scale[:, None]
        # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of the value's binade; subnormals 2^-10 of the scale
        tol = keys.abs() / 16 + 2.0 ** -10 * want_scale[:, None] + 1e-12
        wrong_value = ((deq - keys).abs() > tol) | ~torch.isfinite(deq)
        rows = wrong_scale | wrong_value.any(dim=-1)
        for i in rows.nonzero().flatten()[:3].tolist():
            off = wrong_value[i]
            bad.append(f"slot {int(slots[i])}: scale {float(got_scale[i]):.6g} (ue8m0 of amax / 448: "
                       f"{float(want_scale[i]):.6g})" + (f", {int(off.sum())} of 128 values off (first: "
                       f"{float(deq[i][off][0]):.6g} for {float(keys[i][off][0]):.6g})" if off.any() else ""))
        if rows.any():
            bad.insert(0, f"{int(rows.sum())} of {slots.numel()} written keys decode wrong")
    if never_written.numel():
        num_blocks, block_size, _ = cache.shape
        flat = cache.reshape(num_blocks, -1)
        never_written = never_written.to(cache.device)
        b, p = never_written // block_size, never_written % block_size
        val = flat[b[:, None], p[:, None] * INDEX_HEAD_DIM + torch.arange(INDEX_HEAD_DIM, device=flat.device)]
        sc = flat[b[:, None], block_size * INDEX_HEAD_DIM + p[:, None] * SCALE_BYTES
                  + torch.arange(SCALE_BYTES, device=flat.device)]
        stray = ((val != POISON_BYTE).any(dim=-1) | (sc != POISON_BYTE).any(dim=-1)).nonzero().flatten()
        if stray.numel():
            bad.append(f"{stray.numel()} slots no token was written to changed (first slot "
                       f"{int(never_written[stray[0]])})")
    if bad:  # scales off while every value decodes right: the scale convention (K)
        klass = "K" if slots.numel() and bool(wrong_scale.any()) and not bool(wrong_value.any()) else ""
        return [Verdict("cache_write", False, "; ".join(bad), bug_class=klass, where="index_cache")]
    return [passed("cache_write", f"{slots.numel()} keys")]


def scores(q_fp8: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 [rows, keys]: tokens' index scores, sum over heads of relu(q_h . k) x w_h; and each score's magnitude
    (sum over heads of |w_h| x (|q_h| . |k|)), which bounds a kernel's fp32 rounding of it."""
    q, k, w = q_fp8.double(), keys.double(), weights.double()[:, :, None]
    dots = torch.einsum("rhd,kd->rhk", q, k)
    size = (torch.einsum("rhd,kd->rhk", q.abs(), k.abs()) * w.abs()).sum(dim=1)
    return (dots.clamp(min=0) * w).sum(dim=1), size


# Of a score's magnitude: DeepGEMM's SM90 logits run Q.K on FP8 tensor cores, whose accumulation keeps about 14
# mantissa bits; on an H100 they differed from the stand-in's fp32 by up to 4.2e-3 of a row's largest logit
# (bench/deep_gemm_check.py, docs/benchmarks.md "Indexer"). A selection wrong by less is a near-tie, either way right.
KERNEL_ROUNDING = 5e-3


ROWS_AT_ONCE = 32  # fp64 [rows, heads, keys] per batch: 32 x 64 x 8,000 keys is 131 MB


def _row_problem(got: torch.Tensor, pos: int, want: int, s: torch.Tensor | None,
                 tol: float) -> tuple[str, bool, float]:
    """(what is wrong with one token's row, whether its window looks short, the score margin) for a row the vectorised
    checks flagged (or '' when the row is right)."""
    valid = got[got >= 0]
    if bool((got[:want] < 0).any()) or bool((got[want:] != -1).any()):
        short = bool(valid.numel() < want and (int(valid.max()) < pos if valid.numel() else True))
        return (f"{int((got >= 0).sum())} ids where min(window {pos + 1}, topk {got.numel()}) = {want} come first, then "
                f"-1 (first entries {got[:8].tolist()})", short, 0.0)
    if bool((valid > pos).any()):
        return f"ids outside the causal window [0, {pos}] ({valid[valid > pos][:4].tolist()})", False, 0.0
    if valid.unique().numel() != valid.numel():
        return "a repeated id", False, 0.0
    if s is None or want == pos + 1:
        return "", False, 0.0
    if not bool(torch.isfinite(s).all()):
        return "the cache holds non-finite keys in the window (a slot never written?)", False, 0.0
    kth = s.topk(want).values[-1]
    gap = float(kth - s[valid].min())
    if gap <= tol:
        return "", False, gap / tol
    j = int(valid[s[valid].argmin()])
    chosen = torch.zeros(pos + 1, dtype=torch.bool, device=s.device)
    chosen[valid] = True
    missed = (~chosen & (s > kth + tol)).nonzero().flatten()
    short = bool(missed.numel()) and int(missed.min()) > int(valid.max())
    return (f"selected position {j} scores {float(s[j]):.6g}, below the {want}-th best {float(kth):.6g} by {gap:.3g} "
            f"(tolerance {tol:.3g})", short, gap / tol)


def judge_topk_rows(step_case: Case, buffer: torch.Tensor, cache: torch.Tensor, q_fp8: torch.Tensor,
                    weights: torch.Tensor, wrong_rows: list[int] | None = None) -> list[Verdict]:
    """Every real token's row, a request's rows at a time on the tensors' device: counts, -1 placement, the causal
    window and repeats for every row at once; the scores (fp64) of the selected ids against the k-th best.
    `wrong_rows`, where given, gets the rows found wrong (for a caller that diagnoses them)."""
    dev = buffer.device
    values, scales = decode_index_cache(cache)
    keys = values * scales[:, None]
    width = step_case.topk_width
    problems, worst, classes, row0 = [], 0.0, set(), 0
    for r, req in enumerate(step_case.requests):
        if not req.query_len:
            continue
        table = torch.tensor(step_case.block_table[step_case.table_row(r)], dtype=torch.int64, device=dev)
        window = torch.arange(req.seq_len, device=dev)
        slots = table[window // step_case.block_size] * step_case.block_size + window % step_case.block_size
        for lo in range(0, req.query_len, ROWS_AT_ONCE):
            hi = min(lo + ROWS_AT_ONCE, req.query_len)
            rows = torch.arange(row0 + lo, row0 + hi, device=dev)
            pos = req.context_len + torch.arange(lo, hi, device=dev)
            got = buffer[rows, :width].long()
            want = torch.clamp(pos + 1, max=width)
            col = torch.arange(width, device=dev)
            in_prefix = col[None, :] < want[:, None]
            bad = ((got < 0) & in_prefix).any(1) | ((got != -1) & ~in_prefix).any(1) | (got > pos[:, None]).any(1)
            ordered = got.sort(dim=1).values
            bad |= ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(1)
            s = None
            if bool((want < pos + 1).any()):  # a real selection in some row: judge the scores
                s, size = scores(q_fp8[rows], weights[rows], keys[slots])
                s = s.masked_fill(window[None, :] > pos[:, None], float("-inf"))
                kth = s.sort(dim=1, descending=True).values.gather(1, (want - 1)[:, None]).squeeze(1)
                picked = s.gather(1, got.clamp(min=0, max=req.seq_len - 1)).masked_fill(~in_prefix, float("inf"))
                tol = KERNEL_ROUNDING * size.masked_fill(~torch.isfinite(size), 0).amax(1) + 1e-30
                selecting = want < pos + 1
                gap = torch.where(selecting, kth - picked.min(1).values, torch.zeros_like(kth))
                worst = max(worst, float(torch.nan_to_num(gap / tol, nan=0.0, posinf=0.0).max()))
                bad |= selecting & ((gap > tol) | ~torch.isfinite(gap))
            for i in bad.nonzero().flatten().tolist():
                p = int(pos[i])
                issue, short, margin = _row_problem(got[i], p, int(want[i]), None if s is None else s[i, : p + 1],
                                                    0.0 if s is None else float(tol[i]))
                if not issue:
                    continue
                if wrong_rows is not None:
                    wrong_rows.append(row0 + lo + i)
                kind = "decode" if r < step_case.num_decodes else "prefill"
                problems.append(f"request {r} ({kind}) position {p}, row {row0 + lo + i}: {issue}"
                                + (" (the row's window ends early: a length short)" if short else ""))
                classes.add("D" if short else BUG_CLASS_TOPK)
                if len(problems) > 20:
                    break
        row0 += req.query_len
    if problems:
        return [Verdict("topk", False, f"{len(problems)}{'+' if len(problems) > 20 else ''} token rows wrong; first: "
                        f"{problems[0]}", bug_class="D" if classes == {"D"} else BUG_CLASS_TOPK,
                        margin=worst or None, where="topk")]
    return [passed("topk", f"{row0} rows", margin=worst)]


def judge_padding_and_buffer(step_case: Case, buffer: torch.Tensor, before: torch.Tensor) -> list[Verdict]:
    out = []
    t, n = step_case.num_tokens, step_case.num_actual_tokens
    pad = buffer[t:n]
    if pad.numel() and bool((pad != -1).any()):
        out.append(Verdict("padded_rows", False, f"{int((pad != -1).any(dim=1).sum())} of {n - t} padding tokens' "
                           f"rows hold ids (first row {t}: {pad[(pad != -1).any(dim=1)][0][:8].tolist()}); vLLM "
                           "clears every row it is handed", bug_class="H", where="padded_rows"))
    else:
        out.append(passed("padded_rows", f"{n - t} rows"))
    changed = (buffer[n:] != before[n:]).any(dim=1).nonzero().flatten()
    if changed.numel():
        out.append(Verdict("buffer_rows", False, f"{changed.numel()} rows of the persistent top-k buffer past the "
                           f"step's {n} changed (first row {n + int(changed[0])})", bug_class="A",
                           where="buffer_rows"))
    else:
        out.append(passed("buffer_rows"))
    return out


def judge_indexer(case: Case, obs, rows_scored: bool = True, wrong_rows: list[int] | None = None) -> list[Verdict]:
    """One step (with its history: `case.steps`), from what `vllm.indexer` recorded of it: the top-k buffer after
    and before the call, and the index cache after it. `rows_scored` False: the op was entitled to leave the step's
    rows as it found them (DeepSeek-V3.2's attention module, every token on dense MHA), so they are not judged."""
    if obs.error_type:
        return [Verdict("error", False, f"{obs.error_type}: {obs.error}", where=obs.error_type)]
    o = obs.outputs
    if "topk_indices_buffer" not in o:
        return [Verdict("shape", False, f"no top-k buffer recorded (outputs: {sorted(o)})", where="outputs")]
    pool = key_pool(case, o["index_cache"].device)  # judged where the step ran (fp64 scores of 8,000-key windows)
    written = torch.zeros(pool.shape[0], dtype=torch.bool, device=pool.device)
    for s in case.steps:  # what the engine's steps so far wrote: every request's context, every new token
        inp = materialize_indexer_inputs(s, pool)
        written[inp.context_slots] = True
        written[inp.slots[inp.slots >= 0]] = True
    slots = written.nonzero().flatten()
    cache = o["index_cache"][: pool.shape[0] // case.block_size]  # the trace's blocks (its pool may be larger)
    rows = (judge_topk_rows(case, o["topk_indices_buffer"], cache, inp.q_fp8, inp.weights, wrong_rows) if rows_scored else
            [passed("topk", "not judged: every token took dense MHA, whose rows the indexer leaves unscored")])
    return (judge_index_cache(cache, slots, pool[slots], (~written).nonzero().flatten()) + rows
            + judge_padding_and_buffer(case, o["topk_indices_buffer"], o["topk_before"]))
