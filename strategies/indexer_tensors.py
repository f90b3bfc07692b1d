"""Indexer case -> tensors, deterministically from the case's seeds, on any device (no vLLM import).

A token's index key is a function of its cache slot (drawn once per trace from the last step's seed), so a shared
prefix block holds the same keys for every request that reads it, and a step reads what the steps before it wrote.
Each step's queries (fp8, as DeepSeek-V3.2's fused q-RoPE-quant hands them over, the per-token scale folded into
the weights) and head weights come from that step's own seed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from strategies.case import Case, TopkSpec
from strategies.tensors import to_e4m3

INDEX_HEAD_DIM = 128
_K_SCALE = {"normal": 1.0, "large": 100.0, "tiny": 1e-3, "zero_tiles": 1.0}
_Q_SCALE = {"normal": 1.0, "large": 40.0, "tiny": 0.01, "zero_tiles": 1.0}


@dataclass(frozen=True)
class IndexerInputs:
    q_fp8: torch.Tensor  # float8_e4m3fn [num_actual_tokens, heads, 128]
    weights: torch.Tensor  # fp32 [num_actual_tokens, heads]
    k: torch.Tensor  # bf16 [num_actual_tokens, 128]: each new token's index key (a padding token's: zeros)
    slots: torch.Tensor  # int64 [num_actual_tokens]: each new token's cache slot, -1 for a padding token
    positions: torch.Tensor  # int64 [num_actual_tokens]: each token's position in its request (0 for padding)
    context_slots: torch.Tensor  # int64 [n]: the slots of every request's cached context
    context_k: torch.Tensor  # bf16 [n, 128]: their keys


def key_pool(case: Case, device: str | torch.device = "cpu") -> torch.Tensor:
    """bf16 [pool_slots, 128]: the index key of whatever token sits in each slot, for every step of the trace: block
    by block from the trace's first step's seed, so any step of it (judged with its history) draws the same keys."""
    root = case.steps[0].seed
    blocks = []
    for b in range(case.pool_blocks):
        g = torch.Generator(device="cpu").manual_seed(root * 100_003 + b)
        k = torch.randn(case.block_size, INDEX_HEAD_DIM, generator=g) * _K_SCALE[case.values]
        if case.values == "zero_tiles":  # all-zero keys: every score 0, ties the top-k may break either way
            k[torch.rand(case.block_size, generator=g) < 0.25] = 0
        blocks.append(k)
    return torch.cat(blocks).to(torch.bfloat16).to(device)


def request_slots(case: Case, req: int, positions: range) -> list[int]:
    row = case.block_table[case.table_row(req)]
    return [row[p // case.block_size] * case.block_size + p % case.block_size for p in positions]


def materialize_indexer_inputs(step: Case, pool: torch.Tensor) -> IndexerInputs:
    """The step's tensors on `pool`'s device (`pool`: key_pool of the trace's last step)."""
    device = pool.device
    g = torch.Generator(device="cpu").manual_seed(step.seed + 11)
    rows, heads = step.num_actual_tokens, step.heads
    q = torch.randn(rows, heads, INDEX_HEAD_DIM, generator=g) * _Q_SCALE[step.values]
    if step.values == "zero_tiles":
        q[torch.rand(rows, heads, generator=g) < 0.25] = 0
    weights = torch.randn(rows, heads, generator=g) * heads ** -0.5
    slots, positions, context = [], [], []
    for r, req in enumerate(step.requests):
        slots += request_slots(step, r, range(req.context_len, req.seq_len))
        positions += range(req.context_len, req.seq_len)
        context += request_slots(step, r, range(req.context_len))
    slots += [-1] * step.padded_tokens
    positions += [0] * step.padded_tokens
    slots_t = torch.tensor(slots, dtype=torch.int64)
    k = torch.where((slots_t >= 0)[:, None], pool.cpu()[slots_t.clamp(min=0)], 0).to(torch.bfloat16)
    context_t = torch.tensor(sorted(set(context)), dtype=torch.int64)
    return IndexerInputs(
        q_fp8=to_e4m3(q).to(device), weights=weights.to(device),
        k=k.to(device), slots=slots_t.to(device), positions=torch.tensor(positions, dtype=torch.int64).to(device),
        context_slots=context_t.to(device), context_k=pool[context_t.to(device)])


SKIP_TOPK_SEED = 7919  # the skip_topk layer's values: its own q, K/V and kv_b_proj, from the step's seed + this


def attention_view(case: Case, layer: int = 0) -> Case:
    """The step (with its history) as layer `layer` of DeepSeek-V3.2's attention module sees it (0: the indexer's
    layer; 1: the skip_topk layer after it): a plain sparse-MLA case of the module's MLA heads, its own values, no
    indexer. `strategies.tensors` draws its q, K/V and kv_b_proj from it; its top-k rows are the indexer's, read from
    the persistent buffer (the drawn ones, empty TopkSpecs, are unused)."""

    def one(step: Case) -> Case:
        return dataclasses.replace(step, heads=step.indexer.attention_heads, indexer=None, earlier=(),
                                   topk=(TopkSpec(0),) * len(step.requests), seed=step.seed + layer * SKIP_TOPK_SEED)

    return dataclasses.replace(one(case), earlier=tuple(one(e) for e in case.earlier))
