"""Building vLLM's sparse-MLA objects without a model, the way vLLM's own unit tests do
(../shared/docs/vllm-sparse-mla.md section 4), for any release 0.23-0.33.

The config passed to builders is a namespace holding exactly what they read (upstream tests replace
`hf_text_config` with a namespace too); the builder, metadata, impl and kernels are vLLM's own.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from strategies.tensors import HEAD_SIZE, KV_LORA_RANK, ROPE_DIM

MAX_MODEL_LEN = 8192


def model_namespace(case, max_num_batched_tokens: int) -> SimpleNamespace:
    hf = SimpleNamespace(kv_lora_rank=KV_LORA_RANK, qk_nope_head_dim=128, qk_rope_head_dim=ROPE_DIM,
                         v_head_dim=128, index_topk=case.topk_width, q_lora_rank=None, model_type="deepseek_v32")
    model = SimpleNamespace(hf_text_config=hf, hf_config=hf, max_model_len=MAX_MODEL_LEN, dtype=torch.bfloat16,
                            get_num_attention_heads=lambda parallel_config: case.heads,
                            get_head_size=lambda: HEAD_SIZE, get_num_kv_heads=lambda parallel_config: 1)
    return SimpleNamespace(model_config=model, parallel_config=SimpleNamespace(decode_context_parallel_size=1),
                           scheduler_config=SimpleNamespace(max_num_batched_tokens=max_num_batched_tokens),
                           cache_config=SimpleNamespace(cache_dtype=case.kv_cache_dtype, block_size=case.block_size))


def common_attn_metadata(case, index, device):
    """vLLM's CommonAttentionMetadata for the case, with only the fields the installed release declares."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = index.query_start_loc
    slots = []  # the new tokens' cache slots (the layer writes them this step)
    for r, req in enumerate(case.requests):
        row = case.block_table[case.table_row(r)]
        for pos in range(req.context_len, req.seq_len):
            slots.append(row[pos // case.block_size] * case.block_size + pos % case.block_size)
    slots += [-1] * case.padded_tokens  # the runner's slot for a CUDA-graph padding token: none
    seq_lens = index.seq_lens
    values = dict(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl.cpu(), seq_lens=seq_lens.to(device),
        seq_lens_cpu=seq_lens.cpu(), num_computed_tokens_cpu=torch.tensor([r.context_len for r in case.requests]),
        seq_lens_cpu_upper_bound=seq_lens.cpu(), num_reqs=len(case.requests), num_actual_tokens=case.num_actual_tokens,
        max_query_len=max((r.query_len for r in case.requests), default=0),
        max_seq_len=max((r.seq_len for r in case.requests), default=0),
        block_table_tensor=index.block_table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
    )
    names = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    return CommonAttentionMetadata(**{k: v for k, v in values.items() if k in names})


def paged_cache(case, device, dtype=torch.bfloat16, width: int = HEAD_SIZE, poison=float("nan"), guards=None,
                name: str = "kv_cache") -> torch.Tensor:
    """[num_blocks, block_size, width], blocks `block_stride_rows` rows apart (other layers' pages in
    between), every row poisoned so that a read of a slot no request owns shows up; inside guard regions."""
    rows = case.stride_rows
    if guards is not None:
        storage = guards.empty(name, case.num_blocks * rows * width, dtype, device).view(-1, width)
        storage.fill_(poison)
    else:
        storage = torch.full((case.num_blocks * rows, width), poison, dtype=dtype, device=device)
    return storage.as_strided((case.num_blocks, case.block_size, width), (rows * width, width, 1))


def cache_writer():
    """vLLM's compiled `concat_and_cache_mla` where this host has it, else attnfuzz's stand-in."""
    try:
        op = torch.ops._C_cache_ops.concat_and_cache_mla
        return (lambda kv_c, k_pe, cache, slots, dtype, scale: op(kv_c, k_pe, cache, slots, dtype, scale)), None
    except (AttributeError, RuntimeError):
        from fuzzer.support.standins.cache_ops import concat_and_cache_mla

        return concat_and_cache_mla, "concat_and_cache_mla"


TOPK_POISON = 2**30 - 1  # rows of the top-k buffer past this step's tokens: must never be read


def step_tensors(case, device, inputs=None, guards=None):
    """(attention inputs, the physical slots the step's requests hold, the indexer's top-k buffer) on
    `device`. The buffer has spare rows, poisoned, as the indexer's persistent buffer has."""
    from strategies.tensors import materialize_attention_inputs

    inp = inputs if inputs is not None else materialize_attention_inputs(case, device)
    slots = (torch.unique(torch.cat(inp.slot_of)) if inp.slot_of else torch.zeros(0, dtype=torch.int64)).to(device)
    shape = (case.num_actual_tokens + 8, case.topk_width)
    if guards is not None:
        topk_buffer = guards.empty("topk_indices_buffer", shape[0] * shape[1], torch.int32, device).view(shape)
        topk_buffer.fill_(TOPK_POISON)
    else:
        topk_buffer = torch.full(shape, TOPK_POISON, dtype=torch.int32, device=device)
    topk_buffer[: case.num_tokens] = inp.index.topk_indices
    topk_buffer[case.num_tokens : case.num_actual_tokens] = -1  # padding tokens: the indexer finds no request
    return inp, slots, topk_buffer


def with_padded_tokens(case, rows: torch.Tensor) -> torch.Tensor:
    """`rows` (one per token of the step) and a row for each CUDA-graph padding token after them: the model
    runs on padding tokens too, so they carry values (drawn from the case's seed) that nothing may judge."""
    if not case.padded_tokens:
        return rows
    gen = torch.Generator().manual_seed(case.seed + 7919)
    pad = torch.randn((case.padded_tokens, *rows.shape[1:]), generator=gen).to(rows.dtype).to(rows.device)
    return torch.cat([rows, pad])

