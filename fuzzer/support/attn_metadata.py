"""vLLM's CommonAttentionMetadata for one step, as its model runner makes it."""

from __future__ import annotations

import dataclasses


def attn_metadata(query_start_loc, seq_lens, num_computed_tokens, block_table, slot_mapping, num_actual_tokens: int,
                  max_query_len: int, max_seq_len: int):
    """vLLM's CommonAttentionMetadata for one step, with only the fields the installed release declares."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    values = dict(query_start_loc=query_start_loc, query_start_loc_cpu=query_start_loc.cpu(), seq_lens=seq_lens,
                  seq_lens_cpu=seq_lens.cpu(), seq_lens_cpu_upper_bound=seq_lens.cpu(),
                  num_computed_tokens_cpu=num_computed_tokens.cpu(), num_reqs=len(seq_lens),
                  num_actual_tokens=num_actual_tokens, max_query_len=max_query_len, max_seq_len=max_seq_len,
                  block_table_tensor=block_table, slot_mapping=slot_mapping)
    names = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    return CommonAttentionMetadata(**{k: v for k, v in values.items() if k in names})
