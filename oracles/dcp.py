"""Decode context parallelism: how a case's KV cache is split over ranks, and the verdicts on a DCP call.

With N ranks and interleave I, token position t of a request is held by rank (t // I) % N, at rank-local
position (t // (N*I)) * I + t % I, addressed through the request's block table: one block id names a block
on every rank, so it covers a "virtual" block of block_size * N positions. The whole, undivided context is
therefore the same case with block_size * N (same block table, heads gathered over ranks, no DCP): one
undivided slot b * (B*N) + o is rank (o // I) % N's slot b * B + local(o). The oracle judges the merged
output against that undivided case, and each rank on its own share.

Under prefill context parallelism (PCP) the ranks split the step's query tokens too; their outputs, put back in
batch order as vLLM's runner restores them, are judged as the same undivided step (`judge_layer_pcp`).
"""

from __future__ import annotations

import dataclasses

import torch

from oracles.attention import error_margin
from oracles.attention_judge import (
    attention_judgement,
    attention_tolerance,
    judge_layer,
    layer_judgement,
    reference_for,
)
from oracles.index import RemapArgs, compare_remap, expected_remap
from oracles.verdict import Verdict
from strategies.case import Case, Dcp

# A rank's LSE (over the read-back fp8 values, scores from bf16 q and K) against the float64 reference. The
# real FlashMLA fp8 kernel comes within about 1.04x of 1e-2 (docs/benchmarks.md); the merged output has its
# own, tighter check where it matters.
RANK_LSE_TOLERANCE = (2e-2, 2e-2)  # (atol, rtol)


def undivided(case: Case) -> Case:
    """The case as one rank holding the whole context: virtual blocks, every TP rank's heads (DCP alone reuses
    its ranks as TP ranks; under PCP the TP ranks are Dcp.tp)."""
    return dataclasses.replace(case, block_size=case.block_size * case.dcp.size, block_stride_rows=0,
                               heads=case.heads * case.dcp.tp_ranks, dcp=Dcp())


def owner_and_local(case: Case, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank, rank-local position) of request positions (or of offsets within a virtual block)."""
    n, inter = case.dcp.size, case.dcp.interleave
    return (position // inter) % n, (position // (n * inter)) * inter + position % inter


def local_length(length: int, dcp: Dcp, rank: int) -> int:
    """Of a request's first `length` tokens, how many DCP rank `rank` holds (vLLM's get_dcp_local_seq_lens)."""
    whole, rest = divmod(length, dcp.size * dcp.interleave)
    return whole * dcp.interleave + min(max(rest - rank * dcp.interleave, 0), dcp.interleave)


# SM90's paged MQA logits take 1, 2 or 4 query rows per request; vLLM flattens other MTP widths to a row per token
# (vllm.utils.deep_gemm.native_next_n_supported).
SM90_NATIVE_NEXT_N = (1, 2, 4)


def paged_logits_entries(case: Case) -> tuple[list[int], list[int]]:
    """The entries the indexer hands DeepGEMM's paged logits for the step's decodes: each entry's causal length (a
    request's, its last token's, where SM90 takes the request's rows natively; a token's where vLLM flattens MTP),
    and each decode token row's entry."""
    next_n = 1 + (case.indexer.num_speculative_tokens if case.indexer else 0)
    lengths: list[int] = []
    entry_of_row: list[int] = []
    for r in case.requests[: case.num_decodes]:
        for t in range(r.query_len):
            if next_n not in SM90_NATIVE_NEXT_N:
                lengths.append(r.context_len + t + 1)
            elif t == 0:
                lengths.append(r.seq_len)
            entry_of_row.append(len(lengths) - 1)
    return lengths, entry_of_row


def after_zero_length_entry(case: Case, row: int) -> bool:
    """Whether decode token row `row` is scored in the indexer's paged logits right after an entry that holds no keys
    on a DCP rank where this row's entry holds some: the pattern of DeepGEMM's SM90 paged logits scoring the entry
    after a zero-length one with that one's query
    (docs/bug-reports/vllm-0.33.0-deepgemm-sm90-paged-logits-zero-length-request.md)."""
    if case.dcp.size < 2 or row >= case.num_decode_tokens:
        return False
    lengths, entry_of_row = paged_logits_entries(case)
    entry = entry_of_row[row]
    return entry > 0 and any(
        local_length(lengths[entry - 1], case.dcp, k) == 0 < local_length(lengths[entry], case.dcp, k)
        for k in range(case.dcp.size))


def rank_slots(case: Case, undivided_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank, the slot on that rank's cache) of each undivided slot."""
    virtual = case.block_size * case.dcp.size
    rank, local = owner_and_local(case, undivided_slots % virtual)
    return rank, (undivided_slots // virtual) * case.block_size + local


def rank_slot_mapping(case: Case, undivided_slots: torch.Tensor, rank: int) -> torch.Tensor:
    """vLLM's slot_mapping on `rank` for tokens at `undivided_slots`: -1 where another rank holds the token."""
    owner, slot = rank_slots(case, undivided_slots)
    return torch.where(owner == rank, slot, torch.full_like(slot, -1))


def outside_envelope(case: Case, dcp_cache_dtypes: tuple[str, ...] = ("fp8_ds_mla",)) -> str | None:
    """Why vLLM must refuse this DCP configuration for FlashMLA sparse (None: it must run it): a cache the release
    does not run under DCP (`dcp_cache_dtypes`: 0.34 adds bf16, whose kernel pads the gathered heads itself); on
    fp8_ds_mla, DCP only on the fp8 mixed-batch path (fewer than 32 heads per rank), and local and gathered heads
    padded to one fp8 kernel envelope (64 or 128 heads)."""
    if case.dcp.size == 1:
        return None
    if case.kv_cache_dtype not in dcp_cache_dtypes:
        return f"this release runs FlashMLA sparse under DCP on {' and '.join(dcp_cache_dtypes)} caches only"
    if case.kv_cache_dtype != "fp8_ds_mla":
        return None
    if case.heads >= 32:
        return f"{case.heads} heads per rank take the fp8 separate path, which has no DCP"

    def pad(h: int) -> int:
        return 64 if h <= 64 else 128

    gathered = case.heads * case.dcp.size
    if pad(case.heads) != pad(gathered):
        return f"{case.heads} local heads pad to {pad(case.heads)}, {gathered} gathered heads to {pad(gathered)}"
    return None


def _fp8_envelope(heads: int) -> int:
    return 64 if heads <= 64 else 128


def pcp_outside_envelope(case: Case) -> str | None:
    """Why vLLM must refuse this PCP + DCP configuration of FlashMLA sparse at start-up (None: it must run it).
    Under PCP + DCP every token takes the fp8 separate prefill/decode path, whose decode rows attend through the
    fp8 kernel on the heads the layer gathers over TP when DCP spans more ranks than PCP: the local and those
    heads must pad to one fp8 kernel envelope (64 or 128), as the builder checks."""
    d = case.dcp
    gathered = case.heads * d.tp if d.size > d.pcp else case.heads
    if _fp8_envelope(case.heads) != _fp8_envelope(gathered):
        return (f"{case.heads} local heads pad to {_fp8_envelope(case.heads)}, {gathered} TP-gathered heads to "
                f"{_fp8_envelope(gathered)}")
    if gathered > 128:
        return f"{gathered} gathered heads: past the fp8 decode kernel's 128"
    return None


def judge_dcp(case: Case, obs) -> list[Verdict]:
    """A DCP step run on every rank: the merged output (heads of rank r at [r*H, (r+1)*H)) against attention
    over the undivided context; each rank's filtered top-k exactly; each rank's LSE against attention over its
    share, and -inf (the merge's identity) where it owns none of a row's tokens. Outside FlashMLA's DCP
    envelope vLLM must refuse with NotImplementedError; it may also run the case, and is then judged."""
    why = outside_envelope(case, tuple(obs.notes.get("dcp_cache_dtypes", ("fp8_ds_mla",))))
    if why and "NotImplementedError" in f"{obs.error_type} {obs.error}":
        return [Verdict("contract", True, f"refused ({why}): {obs.error_type}: {obs.error}")]
    whole = undivided(case)
    verdicts, judged = attention_judgement(whole, obs)
    failed_output = [v for v in verdicts if not v.ok and v.check in ("output", "nan", "empty_row")]
    if judged is None or any(not v.ok and v.check in ("memory", "error") for v in verdicts) or case.dcp.size == 1:
        return verdicts
    inputs, slot_values, out_ref = judged  # the fp8 read-back and the reference, computed once
    verdicts += _rank_verdicts(case, whole, inputs, slot_values, obs)
    if failed_output:  # name the ranks whose heads came out wrong
        ranks = _ranks_off(case, whole, inputs, out_ref, obs)
        verdicts = [dataclasses.replace(v, detail=f"{v.detail}; heads of rank(s) {ranks} differ", bug_class=v.bug_class or "G")
                    if v in failed_output else v for v in verdicts]
    return verdicts


def judge_layer_dcp(case, obs):
    """The ranks' heads, in rank order, as the layer's output over the undivided context; as `judge_dcp` does,
    a wrong merged output under DCP (size > 1) points at the split and merge (class G) unless it names another, and
    outside FlashMLA's DCP envelope (a cache this release does not run under DCP) vLLM must refuse."""
    why = outside_envelope(case, tuple(obs.notes.get("dcp_cache_dtypes", ("fp8_ds_mla",))))
    if why and "NotImplementedError" in f"{obs.error_type} {obs.error}":
        return [Verdict("contract", True, f"refused ({why}): {obs.error_type}: {obs.error}")]
    verdicts = judge_layer(undivided(case), obs)
    if case.dcp.size == 1:
        return verdicts
    return [dataclasses.replace(v, bug_class=v.bug_class or "G")
            if not v.ok and v.check in ("output", "nan", "empty_row") else v for v in verdicts]


def judge_layer_pcp(case, obs):
    """A step under PCP + DCP, every rank's layer: the output in batch order (each token from the rank vLLM's
    runner restores it from, the TP ranks' heads side by side) as the layer's output over the undivided context;
    and every rank's own rows (`rank_rows`: a prefill too short to split runs whole on every PCP rank, and the
    runner keeps one copy) against the same reference. Outside FlashMLA's PCP + DCP envelope vLLM must refuse
    with NotImplementedError; it may also run the case, and is then judged."""
    why = pcp_outside_envelope(case)
    if why and "NotImplementedError" in f"{obs.error_type} {obs.error}":
        return [Verdict("contract", True, f"refused ({why}): {obs.error_type}: {obs.error}")]
    verdicts, judged = layer_judgement(undivided(case), obs)
    # Ranks that size one collective differently (the emulated groups refuse; NCCL would hang) disagree on the split.
    verdicts = [dataclasses.replace(v, bug_class=v.bug_class or "G")
                if not v.ok and (v.check in ("output", "nan", "empty_row")
                                 or v.check == "error" and "hand in tensors of different shapes" in v.detail)
                else v for v in verdicts]
    rows = obs.outputs.get("rank_rows")
    if judged is None or rows is None or not len(rows):
        return verdicts
    out_ref, _, atol, rtol = judged
    h = case.heads  # a rank's rows hold its TP rank's heads
    tokens, tp = obs.outputs["rank_row_tokens"].long().cpu(), obs.outputs["rank_row_tp"].long().cpu()
    want = torch.stack([out_ref[t, r * h:(r + 1) * h] for t, r in zip(tokens.tolist(), tp.tolist())])
    got = rows.to(out_ref.device).float().view(want.shape)
    err = ((got - want).abs() / (atol + rtol * want.abs())).nan_to_num(float("inf")).amax(dim=(1, 2))
    if err.numel() and float(err.max()) > 1:
        i = int(err.argmax())
        rank = int(obs.outputs["rank_row_ranks"][i])
        verdicts.append(Verdict("pcp_rank_rows", False, f"rank {rank}'s own row of token {int(tokens[i])} off by "
                                                        f"{float(err.max()):.2f}x the tolerance ({int((err > 1).sum())} "
                                                        f"rows of every rank's {len(err)} are)", "G",
                                margin=float(err.max()), where="pcp_rank_rows"))
    return verdicts


def _rank_verdicts(case: Case, whole: Case, inputs, slot_values, obs) -> list[Verdict]:
    verdicts = []
    index = inputs.index
    owner, _ = owner_and_local(case, index.topk_indices.long().clamp(min=0))
    # The filter is judged on its own contract, for the block stride its call site passed (None: block_size).
    stride = obs.notes.get("dcp_filter_call", {}).get("block_stride_rows") or case.block_size
    compacted = obs.notes.get("dcp_filter_call", {}).get("compacted", False)  # valid entries to the front (any order)
    for r in range(case.dcp.size):
        filtered = obs.outputs.get(f"rank{r}.topk")
        if filtered is not None:
            expected = expected_remap(RemapArgs(
                req_id=index.req_id_per_token, block_table=index.block_table, token_indices=index.topk_indices,
                block_size=case.block_size, block_stride_rows=stride, dcp_size=case.dcp.size, dcp_rank=r,
                dcp_interleave=case.dcp.interleave))
            for m in compare_remap(filtered, None, expected, compacted=compacted, limit=2):
                verdicts.append(Verdict("dcp_filter", False, f"rank {r}: top-k filtered to local slots, row {m.row}: "
                                                             f"{m.detail}", "G", where="dcp_filter"))
        lse = obs.outputs.get(f"rank{r}.lse")
        if lse is None:
            continue
        lse = lse.to(obs.device).float()
        out_ref, lse_ref, _ = reference_for(whole, inputs, obs.device, slot_values, keep=(owner == r).to(obs.device))
        empty = torch.isneginf(lse_ref).all(dim=1)  # rows where the rank holds none of the selected tokens
        if empty.any() and not torch.isneginf(lse[empty]).all():
            t = int(empty.nonzero()[(~torch.isneginf(lse[empty])).any(dim=1)][0])
            verdicts.append(Verdict("dcp_empty_shard", False, f"rank {r} holds none of token {t}'s selected tokens but "
                                                              f"returns LSE {lse[t].max():.4g}, not -inf (the merge's "
                                                              f"identity)", "G", where="dcp_empty_shard"))
        margin = error_margin(lse, lse_ref, *RANK_LSE_TOLERANCE)
        if margin > 1 and not (empty.any() and not torch.isneginf(lse[empty]).all()):
            verdicts.append(Verdict("dcp_rank_lse", False, f"rank {r}: partial LSE over its share off by {margin:.2f}x "
                                                           f"the tolerance", "G", margin=margin, where="dcp_rank_lse"))
        partial = obs.outputs.get(f"rank{r}.partial")
        if partial is not None and (~empty).any():  # rows the rank holds nothing of are the merge's to drop
            partial = partial.to(obs.device).float()[:, :out_ref.shape[1]]  # FlashMLA may pad the heads
            margin = error_margin(partial[~empty].nan_to_num(1e30), out_ref[~empty], *attention_tolerance(whole, inputs))
            if margin > 1:
                verdicts.append(Verdict("dcp_rank_out", False, f"rank {r}: partial output over its share (before the "
                                                               f"combine) off by {margin:.2f}x the tolerance", "G",
                                        margin=margin, where="dcp_rank_out"))
    return verdicts


def _ranks_off(case: Case, whole: Case, inputs, out_ref, obs) -> list[int]:
    """The ranks whose slice of the merged heads exceeds the tolerance."""
    out = obs.outputs["out"].to(obs.device).float()
    atol, rtol = attention_tolerance(whole, inputs)
    h = case.heads
    return [r for r in range(case.dcp.size)
            if error_margin(out[:, r * h:(r + 1) * h].nan_to_num(1e30), out_ref[:, r * h:(r + 1) * h], atol, rtol) > 1]
