"""The config a sparse-MLA metadata builder reads, without a model: a namespace holding exactly those fields,
as vLLM's own unit tests build it (they replace `hf_text_config` with a namespace too). torch only."""

from __future__ import annotations

from types import SimpleNamespace

import torch

MAX_MODEL_LEN = 8192


def model_namespace(case, max_num_batched_tokens: int) -> SimpleNamespace:
    """DeepSeek-V3.2's MLA dims (latent 512, RoPE 64: 576 per cached token), the case's top-k width, heads,
    cache dtype and block size."""
    hf = SimpleNamespace(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                         v_head_dim=128, index_topk=case.topk_width, q_lora_rank=None, model_type="deepseek_v32")
    model = SimpleNamespace(hf_text_config=hf, hf_config=hf, max_model_len=MAX_MODEL_LEN, dtype=torch.bfloat16,
                            get_num_attention_heads=lambda parallel_config: case.heads,
                            get_head_size=lambda: 576, get_num_kv_heads=lambda parallel_config: 1)
    return SimpleNamespace(model_config=model, parallel_config=SimpleNamespace(decode_context_parallel_size=1),
                           scheduler_config=SimpleNamespace(max_num_batched_tokens=max_num_batched_tokens),
                           cache_config=SimpleNamespace(cache_dtype=case.kv_cache_dtype, block_size=case.block_size))
