"""Stand-ins for the two kernels of the indexer's DCP top-k merge (`_merge_dcp_topk_global` in vLLM's
model_executor/layers/sparse_attn_indexer.py), which vLLM keeps in
`vllm.model_executor.kernels.attention.dsa.dcp_indexer_cutedsl`: a module that imports CuTe-DSL (`cutlass`,
`cuda.bindings`, `quack`) at its top, so on a host without them it cannot be imported at all, Triton pack kernel
included. `standin_module()` is a module of the same name holding the two entry points the merge imports.

  * `pack_dcp_topk_candidates_cutedsl` (vLLM's Triton `PackDCPTopkCandidatesKernel`, grid (rows, cdiv(topk, 512))):
    for each row and column < topk of `topk_indices` (this rank's local top-k: positions in its shard, -1 none), the
    candidate (score, global id) into `packed[row, col, 0/1]` (fp32 both): the score is
    logits[row, min(local + row_start, max(num_cols - 1, 0))] (row_start: row_starts[row], or 0), read only for a
    valid entry (-inf otherwise); the global id (local // I) * (N * I) + rank * I + local % I as fp32, -1 for an
    invalid entry. Every access through the strides vLLM passes, bounds-checked.
  * `stable_topk_from_gathered_candidates_cutedsl` (vLLM's CuTe `StableTopKFromGatheredCandidatesKernel`, one CTA
    of 512 threads a row, requiring a candidate count that is a multiple of 512): `out` [rows, topk] first all -1,
    then the topk largest 64-bit keys of the row's candidates, key = (score bits made monotone: sign set -> all bits
    flipped, else the sign bit flipped) << 32 | ~uint32(id), and 0 for an id < 0; each selected key written as
    ~low32(key) (its id; a 0 key: -1). So a higher score wins, and among equal scores the smaller id. The kernel
    writes the selected ids in the order its atomics arrive (none promised); the stand-in writes them by key,
    highest first. 0.34 reads the candidates rank-major in place ([world_size, rows, topk, 2]) and keys only the
    score's high `score_bits` (16 for bf16 logits) above the id's low `id_bits` (enough for max_model_len's
    positions): the selected id is decoded from the key (~field & mask), so an id past `id_bits` would alias.

Plain torch; CPU and CUDA tensors. Source: vLLM 0.33.0's and 0.34.0's wheels, model_executor/kernels/attention/dsa/
dcp_indexer_cutedsl.py (the kernels above, read in full) and sparse_attn_indexer.py (the call site). 0.34's key
widths (`dcp_topk_score_bits`, `dcp_topk_id_bits`) are vLLM's functions, compiled from the installed file.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import types
from pathlib import Path

import torch

from fuzzer.support.standins.indexer_ops import _Flat, _need

MODULE = "vllm.model_executor.kernels.attention.dsa.dcp_indexer_cutedsl"
PACK_BLOCK = 512  # the pack kernel's BLOCK_SIZE (its columns per program)
TB_SIZE = 512  # the stable top-k's threads per row: the candidate count must be a multiple of it
KEY_WIDTHS = ("dcp_topk_score_bits", "dcp_topk_id_bits")  # 0.34's key widths: vLLM's functions, run as they are


def pack_dcp_topk_candidates_cutedsl(logits: torch.Tensor, topk_indices: torch.Tensor, packed: torch.Tensor,
                                     dcp_rank: int, dcp_world_size: int, cp_interleave: int,
                                     row_starts: torch.Tensor | None) -> None:
    op = "pack_dcp_topk_candidates (Triton PackDCPTopkCandidatesKernel)"
    rows, topk = topk_indices.shape[0], topk_indices.shape[1]
    num_cols = logits.shape[1]
    if rows == 0 or topk == 0:
        return
    r = torch.arange(rows)[:, None].expand(rows, topk).reshape(-1)
    c = torch.arange(topk)[None, :].expand(rows, topk).reshape(-1)
    local = _Flat(op, "topk_indices", topk_indices).load(r * topk_indices.stride(0) + c * topk_indices.stride(1),
                                                        -1).long().cpu()
    valid = local >= 0
    safe = local.clamp(min=0)
    start = torch.zeros_like(r)
    if row_starts is not None:
        start = _Flat(op, "row_starts", row_starts).load(torch.arange(rows), 0).long().cpu()[r]
    col = torch.minimum(safe + start, torch.full_like(safe, max(num_cols - 1, 0)))
    score = torch.full((r.numel(),), float("-inf"), dtype=torch.float32)
    if bool(valid.any()):  # the load is masked by validity: an invalid entry touches no memory
        score[valid] = _Flat(op, "logits", logits).load(
            r[valid] * logits.stride(0) + col[valid] * logits.stride(1), float("nan")).float().cpu()
    n, i = dcp_world_size, cp_interleave
    gid = torch.where(valid, (safe // i) * (n * i) + dcp_rank * i + safe % i, torch.full_like(safe, -1))
    out = _Flat(op, "packed", packed)
    base = r * packed.stride(0) + c * packed.stride(1)
    out.store(base, score)
    out.store(base + packed.stride(2), gid.to(torch.float32))


def _keys(score: torch.Tensor, ids: torch.Tensor, score_bits: int = 32, id_bits: int = 32
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's 64-bit stable key as its two fields (score field, id field), each an int64: the score's bits
    made monotone (sign set -> all bits flipped, else the sign bit flipped), their high `score_bits`; then
    ~uint32(id), its low `id_bits` (0.34 keys only these; 0.33 all 32 of each). 0 for an id < 0 (padding)."""
    bits = score.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    high = torch.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits ^ 0x80000000) >> (32 - score_bits)
    low = (~ids.long()) & ((1 << id_bits) - 1)
    invalid = ids < 0
    return high.masked_fill(invalid, 0), low.masked_fill(invalid, 0)


def stable_topk_from_gathered_candidates_cutedsl(gathered: torch.Tensor, topk: int, out: torch.Tensor | None = None,
                                                 score_bits: int = 32, id_bits: int = 32) -> torch.Tensor:
    op = "stable_topk_from_gathered_candidates (CuTe StableTopKFromGatheredCandidatesKernel)"
    rank_major = gathered.dim() == 4  # 0.34: [world_size, rows, topk, 2] read in place; 0.33: [rows, candidates, 2]
    if rank_major:  # the wrapper's own asserts (0.34)
        assert gathered.shape[2:] == (topk, 2), (f"Expected [world_size, rows, {topk}, 2] candidates, "
                                                 f"got {tuple(gathered.shape)}")
        assert gathered.stride(-1) == 1 and gathered.stride(-2) == 2, (
            f"Candidate pairs must be contiguous, got strides {gathered.stride()}")
        assert 0 < score_bits <= 32 and 0 < id_bits <= 32
    rows = gathered.shape[1] if rank_major else gathered.shape[0]
    num_candidates = gathered.shape[0] * topk if rank_major else gathered.shape[1]
    if out is None:
        out = torch.empty((rows, topk), dtype=torch.int32, device=gathered.device)
    _need(num_candidates % TB_SIZE == 0, "StableTopKFromGatheredCandidatesKernel requires candidate count to be a "
                                         f"multiple of {TB_SIZE}, got {num_candidates}")
    _need(gathered.dtype == torch.float32 and out.dtype == torch.int32,
          f"expected fp32 candidates and int32 output, got {gathered.dtype} and {out.dtype}")
    if rows == 0:
        return out
    src = _Flat(op, "gathered", gathered)
    r = torch.arange(rows)[:, None].expand(rows, num_candidates).reshape(-1)
    c = torch.arange(num_candidates)[None, :].expand(rows, num_candidates).reshape(-1)
    if rank_major:  # candidate c of a row: rank c // topk's entry c % topk
        base = (c // topk) * gathered.stride(0) + r * gathered.stride(1) + (c % topk) * gathered.stride(2)
        id_stride = gathered.stride(3)
    else:
        base, id_stride = r * gathered.stride(0) + c * gathered.stride(1), gathered.stride(2)
    score = src.load(base, float("-inf")).float().cpu().view(rows, num_candidates)
    ids = src.load(base + id_stride, -1.0).float().cpu().to(torch.int32).view(rows, num_candidates)
    high, low = _keys(score, ids, score_bits, id_bits)
    # Largest key first: by the score field, then the id field (two stable sorts, the minor key first).
    order = torch.sort(low, dim=1, descending=True, stable=True).indices
    order = order.gather(1, torch.sort(high.gather(1, order), dim=1, descending=True, stable=True).indices)
    take = order[:, :topk]
    key_high, key_low = high.gather(1, take), low.gather(1, take)
    # Each selected key decoded to its id (the id field's bits: ~field & mask); a 0 key (padding) to -1.
    chosen = torch.where((key_high == 0) & (key_low == 0), -1, (~key_low) & ((1 << id_bits) - 1)).to(torch.int32)
    result = torch.full((rows, topk), -1, dtype=torch.int32)
    result[:, : chosen.shape[1]] = chosen
    # The kernel writes output[row, i] through the tensor's layout (out may be a strided view of vLLM's buffer).
    rr = torch.arange(rows)[:, None].expand(rows, topk).reshape(-1)
    cc = torch.arange(topk)[None, :].expand(rows, topk).reshape(-1)
    _Flat(op, "out", out).store(rr * out.stride(0) + cc * out.stride(1), result.reshape(-1))
    return out


def _vllm_key_widths(module: types.ModuleType) -> None:
    """vLLM's own `dcp_topk_score_bits` and `dcp_topk_id_bits` (0.34: plain Python beside the kernels, in a module
    that cannot be imported here), compiled from the installed file under its name: the code under test, not ours."""
    dsa = importlib.util.find_spec(MODULE.rsplit(".", 1)[0])
    path = Path(next(iter(dsa.submodule_search_locations))) / (MODULE.rsplit(".", 1)[1] + ".py")
    if not path.is_file():
        return
    tree = ast.parse(path.read_text(), str(path))
    wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in KEY_WIDTHS]
    if wanted:
        module.__dict__.setdefault("torch", torch)
        exec(compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec"), module.__dict__)


def standin_module() -> types.ModuleType:
    """A module standing where vLLM's dcp_indexer_cutedsl is imported from, holding the two entry points."""
    module = types.ModuleType(MODULE, __doc__)
    module.pack_dcp_topk_candidates_cutedsl = pack_dcp_topk_candidates_cutedsl
    module.stable_topk_from_gathered_candidates_cutedsl = stable_topk_from_gathered_candidates_cutedsl
    _vllm_key_widths(module)
    module.__attnfuzz_standin__ = True
    return module


def install() -> None:
    """The stand-in module in sys.modules under vLLM's name, where `_merge_dcp_topk_global` imports it."""
    sys.modules[MODULE] = standin_module()
