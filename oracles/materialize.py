"""Case -> tensors, deterministically from the case's seed, on any device.

The tensors are what vLLM's metadata builder would hand a sparse-MLA backend for this step:
`req_id_per_token`, `block_table`, `topk_indices` (request-local positions, -1 = not selected), the
prefill-workspace rows, and (for DCP) the rank-local view. No vLLM import: oracles never call the target.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strategies.case import Case, TopkSpec

TILE = 16  # the attention kernels' softmax tile along top-k (bug class I: whole leading tiles of -1)


@dataclass(frozen=True)
class IndexInputs:
    req_id_per_token: torch.Tensor  # int32 [num_tokens]: batch row of each token
    block_table: torch.Tensor  # int32 [rows, width]
    topk_indices: torch.Tensor  # int32 [num_tokens, topk_width]
    idx_mapping: torch.Tensor | None  # int32 [num_reqs]
    prefill_request_id: torch.Tensor  # int32 [num_tokens]: -1 for decode tokens, else prefill index
    prefill_workspace_starts: torch.Tensor  # int32 [num_prefills]: workspace row of each prefill's token 0
    seq_lens: torch.Tensor  # int32 [num_reqs]
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]


def _topk_row(spec: TopkSpec, visible: int, seq_len: int, table_tokens: int, width: int, g: torch.Generator) -> list[int]:
    """One query row: `valid` distinct visible positions, plus out-of-range entries, the rest -1."""
    n_valid = min(spec.valid, visible, width)
    valid = torch.randperm(visible, generator=g)[:n_valid].tolist() if n_valid else []
    extra: list[int] = []
    if spec.past_seq and table_tokens > seq_len:  # past the sequence, inside the block table
        extra += [seq_len + int(x) for x in torch.randint(0, table_tokens - seq_len, (spec.past_seq,), generator=g)]
    if spec.past_table:  # just past the block table; the last one far past it (a wrapped/garbage index)
        extra += [table_tokens + int(x) for x in torch.randint(0, 4096, (spec.past_table,), generator=g)]
        if spec.past_table > 1:
            extra[-1] += 2**30
    entries = (valid + extra)[:width]
    n_invalid = width - len(entries)
    if spec.invalid_at == "tail":
        return entries + [-1] * n_invalid
    if spec.invalid_at == "head":
        return [-1] * n_invalid + entries
    if spec.invalid_at == "leading_tiles":
        lead = min(n_invalid, TILE * (1 + n_invalid // (4 * TILE)))
        return [-1] * lead + entries + [-1] * (n_invalid - lead)
    row = entries + [-1] * n_invalid  # scattered
    perm = torch.randperm(width, generator=g).tolist()
    return [row[p] for p in perm]


def materialize_index_inputs(case: Case, device: str | torch.device = "cpu") -> IndexInputs:
    g = torch.Generator().manual_seed(case.seed)
    d = case.dcp
    width = len(case.block_table[0])
    # Under DCP the block table is the rank's: it spans rank-local positions, which cover
    # dcp_size times as many global positions.
    table_tokens = width * case.block_size * d.size
    rows, req_ids, prefill_ids, starts = [], [], [], []
    workspace = 0
    for r, (req, spec) in enumerate(zip(case.requests, case.topk)):
        is_prefill = r >= case.num_decodes
        if is_prefill:
            starts.append(workspace)
            workspace += req.seq_len
        for i in range(req.query_len):
            visible = req.context_len + i + 1  # causal: query i sees its own position and all before
            rows.append(_topk_row(spec, visible, req.seq_len, table_tokens, case.topk_width, g))
            req_ids.append(r)
            prefill_ids.append(len(starts) - 1 if is_prefill else -1)
    qsl = [0]
    for req in case.requests:
        qsl.append(qsl[-1] + req.query_len)

    def i32(x, shape=None):
        t = torch.tensor(x, dtype=torch.int32)
        return (t.reshape(shape) if shape is not None else t).to(device)

    return IndexInputs(
        req_id_per_token=i32(req_ids, (-1,)),
        block_table=i32(case.block_table),
        topk_indices=i32(rows, (-1, case.topk_width)),
        idx_mapping=None if case.idx_mapping is None else i32(case.idx_mapping),
        prefill_request_id=i32(prefill_ids, (-1,)),
        prefill_workspace_starts=i32(starts, (-1,)),
        seq_lens=i32([q.seq_len for q in case.requests], (-1,)),
        query_start_loc=i32(qsl),
    )
