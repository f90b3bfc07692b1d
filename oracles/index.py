"""Exact semantics of vLLM's sparse-MLA index remap (`sparse_mla_index_remap_kernel`), as documented in
`triton_convert_req_index_to_global_index` and `triton_filter_and_convert_dcp_index`.

For token t and top-k entry j with request-local position p = topk_indices[t, j]:
  * p < 0                                  -> -1
  * DCP: owner = (p // I) % N; p is remote  -> -1   (decode rows; I = interleave, N = DCP size)
          local = (p // (N*I)) * I + p % I, else local = p
  * block = local // B outside [0, width)   -> -1   (the guard: an index past the block table)
  * prefill row in workspace mode           -> workspace_starts[prefill_id] + local
  * otherwise                               -> block_table[row(t), block] * BLOCK_STRIDE_ROWS + local % B
    with row(t) = max(idx_mapping[req_id[t]], 0) when idx_mapping is given, else req_id[t].
With valid counts the count is the number of entries that are not -1. Releases that compact put the
valid entries in a prefix [0, count) in unspecified order and -1 after it: only the set is specified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oracles.verdict import Verdict, passed
from strategies.tensors import materialize_index_inputs


@dataclass(frozen=True)
class RemapArgs:
    """One call of the remap, in the kernel's own terms (all int32 tensors on one device)."""

    req_id: torch.Tensor
    block_table: torch.Tensor
    token_indices: torch.Tensor
    block_size: int
    block_stride_rows: int
    idx_mapping: torch.Tensor | None = None
    prefill_request_id: torch.Tensor | None = None  # workspace mode when given
    prefill_workspace_starts: torch.Tensor | None = None
    dcp_size: int = 1
    dcp_rank: int = 0
    dcp_interleave: int = 1


def expected_remap(a: RemapArgs, any_owner: bool = False) -> torch.Tensor:
    """Expected out[t, j] (int64 [T, K]) for a call whose req_id and token_indices cover the same tokens.

    any_owner keeps other DCP ranks' tokens, at the local slots the kernel computes for them."""
    tok = a.token_indices.long()
    n, inter = a.dcp_size, a.dcp_interleave
    invalid = tok < 0
    t = tok.clamp(min=0)
    owner = (t // inter) % n
    local = (t // (n * inter)) * inter + t % inter
    block, offset = local // a.block_size, local % a.block_size
    width = a.block_table.shape[1]
    invalid |= block >= width
    is_prefill = torch.zeros_like(tok, dtype=torch.bool)
    if a.prefill_request_id is not None:
        is_prefill = (a.prefill_request_id.long() >= 0)[:, None].expand_as(tok)
    if not any_owner:
        invalid |= (owner != a.dcp_rank) & ~is_prefill
    row = a.req_id.long()
    if a.idx_mapping is not None:
        row = a.idx_mapping.long()[row].clamp(min=0)
    bt = a.block_table.long()[row]  # [T, width]
    base = torch.gather(bt, 1, block.clamp(max=width - 1))
    out = base * a.block_stride_rows + offset
    if a.prefill_request_id is not None:
        pid = a.prefill_request_id.long().clamp(min=0)
        starts = a.prefill_workspace_starts.long()
        ws = starts[pid.clamp(max=max(len(starts) - 1, 0))] if len(starts) else torch.zeros_like(pid)
        out = torch.where(is_prefill, ws[:, None] + local, out)
    return torch.where(invalid, torch.full_like(out, -1), out)


@dataclass(frozen=True)
class RemapMismatch:
    row: int
    what: str  # "values", "count", "set", "slot", "layout", "owner"
    detail: str


def _foreign(out_row: torch.Tensor, want: list[int], blind_row: torch.Tensor | None) -> list[int]:
    """Entries of a wrong row that are another DCP rank's tokens: what the row would hold had ownership been
    ignored, and not what it should hold. Naming them points the mismatch at the DCP filter (class G)."""
    if blind_row is None:
        return []
    foreign = set(blind_row[blind_row >= 0].tolist()) - set(want)
    return sorted(foreign & set(out_row[out_row >= 0].tolist()))


def compare_remap(
    out: torch.Tensor, counts: torch.Tensor | None, expected: torch.Tensor, compacted: bool, limit: int = 5,
    owner_blind: torch.Tensor | None = None,
) -> list[RemapMismatch]:
    """Row-wise comparison of a remap result with `expected_remap`; empty when correct.

    `owner_blind` (expected_remap of the same call on every rank's tokens) lets a compacted row's mismatch be
    named "owner" when the row holds tokens another DCP rank owns."""
    out, expected = out.long().cpu(), expected.long().cpu()
    owner_blind = None if owner_blind is None else owner_blind.long().cpu()
    exp_counts = (expected >= 0).sum(1)
    bad: list[RemapMismatch] = []
    if out.shape != expected.shape:
        return [RemapMismatch(-1, "shape", f"out has shape {tuple(out.shape)}, expected {tuple(expected.shape)}")]
    for r in range(expected.shape[0]):
        if len(bad) >= limit:
            break
        e_row, o_row = expected[r], out[r]
        blind = None if owner_blind is None else owner_blind[r]
        if counts is not None and int(counts[r]) != int(exp_counts[r]):
            foreign = _foreign(o_row[:max(int(counts[r]), 0)], e_row[e_row >= 0].tolist(), blind)
            bad.append(RemapMismatch(r, "owner" if foreign else "count",
                                     f"valid count {int(counts[r])}, expected {int(exp_counts[r])}"
                                     + (f"; holds other ranks' tokens as slots {foreign[:4]}" if foreign else "")))
            continue
        if not compacted:
            diff = (e_row != o_row).nonzero().flatten()
            if len(diff):
                j = int(diff[0])
                bad.append(RemapMismatch(r, "values", f"{len(diff)} entries differ; first [{r},{j}] = {int(o_row[j])}, expected {int(e_row[j])} (topk entry {j})"))
            continue
        n = int(exp_counts[r])
        want = sorted(e_row[e_row >= 0].tolist())
        got = sorted(o_row[:n].tolist())
        if got != want:
            missing = sorted(set(want) - set(got))[:4]
            extra = sorted(set(got) - set(want))[:4]
            foreign = _foreign(o_row[:n], want, blind)
            # A hole (-1) in the prefix is the compaction's fault; a slot no entry maps to, the address's.
            what = "owner" if foreign else "slot" if any(x >= 0 for x in extra) else "set"
            bad.append(RemapMismatch(r, what, f"valid prefix of {n} differs: missing {missing}, unexpected {extra}"
                                     + (" (other ranks' tokens)" if foreign else "")))
        elif (o_row[n:] != -1).any():
            j = n + int((o_row[n:] != -1).nonzero()[0])
            bad.append(RemapMismatch(r, "layout", f"entry {j} past the valid prefix is {int(o_row[j])}, expected -1"))
    return bad


def remap_args_for(case, inputs) -> RemapArgs:
    """The call a vLLM call site makes for this case (case.call says how it slices the batch).

    token_rows="decodes" passes only the MQA subset of topk_indices (the decode rows), as the dense-MHA
    split does; req_id_rows="full_batch" then leaves req_id_per_token unsliced, as the call site of vLLM
    PR 47327 did (issue 48611).
    """
    rows = case.num_decode_tokens if case.call.token_rows == "decodes" else case.num_tokens
    req_rows = case.num_tokens if case.call.req_id_rows == "full_batch" else rows
    workspace = case.call.prefill_workspace
    return RemapArgs(
        req_id=inputs.req_id_per_token[:req_rows],
        block_table=inputs.block_table,
        token_indices=inputs.topk_indices[:rows],
        block_size=case.block_size,
        block_stride_rows=case.stride_rows,
        idx_mapping=inputs.idx_mapping,
        prefill_request_id=inputs.prefill_request_id[:rows] if workspace else None,
        prefill_workspace_starts=inputs.prefill_workspace_starts if workspace else None,
        dcp_size=case.dcp.size,
        dcp_rank=case.dcp.rank,
        dcp_interleave=case.dcp.interleave,
    )


def judge_remap(case, obs) -> list:
    """Verdicts for one call of the remap (either entry point), from the case alone plus what was seen."""

    verdicts = []
    args = remap_args_for(case, materialize_index_inputs(case, "cpu"))
    groups: dict[str, list] = {}
    for v in obs.memory:  # one verdict per (kernel, op, argument): the first access names it
        groups.setdefault(f"{v.kernel}:{v.op}:{v.argument}", []).append(v)
    # Writes first, then accesses outside every allocation: they are what corrupts memory.
    for vs in sorted(groups.values(), key=lambda vs: (vs[0].op == "load", vs[0].inside_allocation)):
        lanes = sum(v.lanes for v in vs)
        detail = vs[0].describe() + (f"; {len(vs)} accesses, {lanes} lanes in all" if len(vs) > 1 else "")
        verdicts.append(Verdict("memory", False, detail, "A" if case.call.breaks_row_contract else "C",
                                where=vs[0].kernel))
    n_req, n_tok = args.req_id.shape[0], args.token_indices.shape[0]
    if n_req != n_tok:
        # The only correct answer is a clear error before any memory is touched.
        if obs.error_type is None:
            verdicts.append(Verdict(
                "contract", False,
                f"accepted req_id_per_token of {n_req} rows with topk_indices of {n_tok} rows: the grid follows "
                f"req_id, the output follows topk_indices", "A", where="row_contract"))
        else:
            verdicts.append(passed("contract", f"refused: {obs.error_type}: {obs.error}"))
        return verdicts
    if obs.error_type is not None:
        verdicts.append(Verdict("error", False, f"{obs.error_type}: {obs.error}", where=obs.error_type))
        return verdicts
    expected = expected_remap(args)
    counts = obs.outputs.get("valid_counts")
    # Under DCP, every rank's tokens at this rank's local slots: a wrong row holding some names the filter.
    blind = expected_remap(args, any_owner=True) if args.dcp_size > 1 else None
    for m in compare_remap(obs.outputs["out"], counts, expected, obs.notes.get("compacted", False), owner_blind=blind):
        kind = "token" if m.row < 0 else ("decode" if m.row < case.num_decode_tokens else "prefill")
        # Counts, holes and what lies past the prefix are the valid-count contract's (B); wrong slots, as wrong
        # values, the address's: the block table (C) or, under DCP, the rank's share (G).
        bug = {"count": "B", "set": "B", "layout": "B", "owner": "G"}.get(m.what, "C" if case.dcp.size == 1 else "G")
        verdicts.append(Verdict(m.what, False, f"row {m.row} ({kind}): {m.detail}", bug))
    if not verdicts:
        verdicts.append(passed("values", f"{n_tok} rows exact"))
    return verdicts
