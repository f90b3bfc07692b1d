"""DeepSeek-V3.2 / GLM-5's attention module (`DeepseekV32Attention`) driven for one step as its `forward` drives it,
without a model: its indexer feeding its sparse MLA on FLASHMLA_SPARSE through the module's own seam,
`_sparse_indexer_and_attn` (the indexer op, the index group's ready event, the layer's dense-MHA / MQA split, W_UV).
torch and vLLM only (plus attnfuzz's stand-ins where the host lacks a compiled kernel).

What `forward` does before that seam is the model's (projections, norms, RoPE, the fused q quantization) and is not
run: the step hands the seam q after RoPE, the new tokens' latent, and the indexer's fp8 queries and head weights.
`fused_norm_rope` also has three side effects the seam relies on; the target makes them (`clear_topk_rows` here, the
two cache writes through vLLM's cache ops): the MLA cache write, the index K-cache write and, on an indexer layer,
the top-k buffer's rows cleared to -1 (which is why the seam passes `skip_topk_buffer_clear=True`).

The layers are made without DeepSeek-V3.2's own __init__ (its projections and RoPE need a checkpoint's config):
`MLAAttention.__init__` on an instance of the class, then the attributes that __init__ sets after it, computed as it
computes them; the indexer is vLLM's `DeepseekV32Indexer` (`indexer_runtime.indexer_layer`). Layers share one
`SparseMLAIndexGroupBuilder`, as DeepseekV2Model builds them: a skip_topk layer (no indexer) joins the index group
of the layer before it and reuses its top-k conversion.
"""

from __future__ import annotations

import importlib

import torch

from fuzzer.support.flashmla_runtime import BACKEND_MODULE, CPU_SDPA_PREFILL_MODULE, after_loading
from fuzzer.support.vllm_setup import KV_LORA_RANK, LAYER, QK_NOPE, ROPE_DIM, SM_SCALE, V_HEAD

V32_ATTENTION = "vllm.models.deepseek_v32.attention"
INDEX_GROUP_MODULE = "vllm.v1.attention.backends.mla.index_group"
SKIP_TOPK_LAYER = "attnfuzz.layer.skip_topk"  # the second layer's prefix: no indexer, the first's top-k


def cpu_capture_query() -> tuple[str, ...]:
    """On a host without CUDA, `torch.cuda.is_current_stream_capturing()` answers False (no stream captures there);
    torch's CPU build raises instead. The module's seam and the indexer op ask it on every step."""
    if torch.cuda.is_available():
        return ()
    torch.cuda.is_current_stream_capturing = lambda: False
    return ("torch.cuda.is_current_stream_capturing: False (a CPU host)",)


def index_group_builder(cfg, topk_indices_buffer: torch.Tensor):
    """The model's one SparseMLAIndexGroupBuilder over the persistent top-k buffer (DeepseekV2Model.__init__)."""
    group = importlib.import_module(INDEX_GROUP_MODULE)
    return group.SparseMLAIndexGroupBuilder(topk_indices_buffer, group.get_sparse_mla_index_group_max_rows(cfg))


def dsv32_layer(cfg, heads: int, kv_b_weight: torch.Tensor, topk_indices_buffer: torch.Tensor, indexer, group_builder,
                device: str, prefix: str = LAYER, backend=None, disable_tp: bool = False, shardq_eligible: bool = False):
    """`DeepseekV32Attention` on `backend` (vLLM's sparse-MLA backend class; None: FLASHMLA_SPARSE) with `indexer` (a DeepseekV32Indexer, or None: a skip_topk layer),
    vLLM's CPU_SDPA_MLA prefill backend, kv_b_proj holding `kv_b_weight`, registered as `prefix`. disable_tp: kv_b_proj
    outside TP (`kv_b_weight` is already this rank's rows of the TP-split projection, under an emulated TP group).
    shardq_eligible: as DeepSeek-V3.2 makes its non-MTP layers (0.34+: ShardQ where the impl supports it).
    Call inside `set_current_vllm_config(cfg)`."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.linear import ColumnParallelLinear
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.kv_cache_interface import is_quantized_kv_cache

    attention = importlib.import_module(V32_ATTENTION)
    layer_cls = attention.DeepseekV32Attention
    cfg.compilation_config.static_forward_context.pop(prefix, None)
    outside_tp = {"disable_tp": True} if disable_tp else {}
    shardq = {"shardq_eligible": True} if shardq_eligible else {}  # a keyword releases before 0.34 lack
    kv_b_proj = ColumnParallelLinear(KV_LORA_RANK, heads * (QK_NOPE + V_HEAD), bias=False, params_dtype=torch.bfloat16,
                                     prefix=f"{prefix}.kv_b_proj", **outside_tp).to(device)
    kv_b_proj.weight.data.copy_(kv_b_weight)
    layer = layer_cls.__new__(layer_cls)
    with torch.device(device), set_default_torch_dtype(torch.bfloat16):  # as the model loader builds layers
        MLAAttention.__init__(
            layer, num_heads=heads, scale=SM_SCALE, qk_nope_head_dim=QK_NOPE, qk_rope_head_dim=ROPE_DIM,
            v_head_dim=V_HEAD, q_lora_rank=None, kv_lora_rank=KV_LORA_RANK, kv_b_proj=kv_b_proj,
            cache_config=cfg.cache_config, prefix=prefix,
            attn_backend=backend or importlib.import_module(BACKEND_MODULE).FlashMLASparseBackend, use_sparse=True,
            indexer=indexer, topk_indices_buffer=topk_indices_buffer, index_group_builder=group_builder,
            prefill_backend_cls=importlib.import_module(CPU_SDPA_PREFILL_MODULE).CPUSDPAMLAPrefillBackend, **shardq)
    after_loading(layer)
    # What DeepseekV32Attention.__init__ sets after MLAAttention.__init__, as it computes it (no MTP layer here).
    layer.num_local_heads, layer.qk_head_dim = heads, QK_NOPE + ROPE_DIM
    layer.indexer, layer.topk_indices_buffer, layer.skip_topk = indexer, topk_indices_buffer, False
    short_prefill_scoring_skip = (indexer is not None and not layer.use_pcp and attention.current_platform.is_cuda()
                                  and layer.supports_dense_mha_prefill)
    layer._dense_mha_metadata_layer_name = layer.layer_name if short_prefill_scoring_skip else ""
    fp8_attention = is_quantized_kv_cache(layer.kv_cache_dtype)
    layer._fp8_query = fp8_attention and layer.impl.supports_quant_query_input
    layer._fp8_kv_needs_view = fp8_attention and not layer.kv_cache_dtype.endswith("_ds_mla")
    layer._index_rope_interleave = False
    return layer


def clear_topk_rows(topk_indices_buffer: torch.Tensor, num_rows: int) -> None:
    """What `fused_norm_rope` does to the top-k buffer on an indexer layer (its program 3): the step's rows, padding
    tokens' included, set to -1 before the indexer scatters into them."""
    topk_indices_buffer[:num_rows] = -1



def forward_context_maps(layers, mla_metadata, indexer_metadata, slot_mapping) -> tuple[dict, dict]:
    """The forward context's attention metadata and slot mappings by layer name, as the model runner keys them: each
    MLA layer's under its name, its indexer's under the index K cache's prefix."""
    metadata = {layer.layer_name: mla_metadata for layer in layers}
    slots = {layer.layer_name: slot_mapping for layer in layers}
    for layer in layers:
        if layer.indexer is not None:
            metadata[layer.indexer.k_cache.prefix] = indexer_metadata
            slots[layer.indexer.k_cache.prefix] = slot_mapping
    return metadata, slots

def module_step(cfg, layers: list, indexer_metadata, mla_metadata, q: torch.Tensor, kv_c: torch.Tensor,
                k_pe: torch.Tensor, index_q_fp8: torch.Tensor, index_weights: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor, cudagraph_mode: str = "none") -> list[torch.Tensor]:
    """One step of the module's layers, in order, under one forward context (each layer's metadata by its name, as
    the runner keys them): q [T, H, 192] after RoPE, kv_c [T, 512] and k_pe [T, 64] the new tokens' (T: the rows
    the model hands the layer, CUDA-graph padding included), the indexer's fp8 queries [T, heads, 128] and head
    weights [T, heads]. Each layer absorbs q_nope through W_UK where `forward` would (`_should_prepare_mqa_query`)
    and runs `_sparse_indexer_and_attn`. Returns each layer's output [T, H * 128]."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import set_forward_context

    mode = CUDAGraphMode.FULL if cudagraph_mode == "full" else CUDAGraphMode.NONE
    metadata, slots = forward_context_maps(layers, mla_metadata, indexer_metadata, slot_mapping)
    rows = q.shape[0]
    hidden = torch.empty((rows, 1), dtype=torch.bfloat16, device=q.device)  # the seam reads only its row count
    outputs = []
    with set_forward_context(metadata, cfg, cudagraph_runtime_mode=mode, slot_mapping=slots):
        for layer in layers:
            q_nope, q_pe = q[..., :QK_NOPE], q[..., QK_NOPE:]
            if layer._should_prepare_mqa_query(mla_metadata, mode):
                ql_nope = torch.bmm(q_nope.transpose(0, 1), layer.W_UK_T).transpose(0, 1)
            else:
                ql_nope = q_nope
            output = torch.full((rows, layer.num_local_heads * V_HEAD), float("nan"), dtype=torch.bfloat16,
                                device=q.device)
            indexed = layer.indexer is not None
            layer._sparse_indexer_and_attn(positions, hidden, q_nope, q_pe, index_q_fp8 if indexed else None, None,
                                           index_weights if indexed else None, kv_c, k_pe, ql_nope, q_pe, output)
            outputs.append(output)
    return outputs
