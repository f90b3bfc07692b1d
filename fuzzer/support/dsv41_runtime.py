"""Setting vLLM up to run DeepSeek-V4.1's sparse attention (`FLASHMLA_SPARSE_DSV41`) without a model.

What differs from DeepSeek-V4 (dsv4_runtime, whose shared pieces this module re-exports): the layer and builders
live in `vllm.models.deepseek_v41`; compress ratios are 0 (sliding window only), 1 and 2, both compressed kinds
reading the indexer's top-k; the compressed K cache is owned by the kv-source layers only (`kv_source_layer_ids`)
and a consumer reads its source's cache and metadata through `compressed_cache_prefix`; its block is the backend's
kernel block size (64 on SM90, 128 elsewhere) and the SWA cache's block is 32. On every arch but SM100 both caches
hold V4's 584-byte record (`_use_v41_mxfp8_kv_record`), which is what this module sets up; the 528-byte MXFP8 record
(SM100's FlashMLA only) too, where the decode kernel that reads it is a stand-in. The layer is made with `__new__` and given the attributes its `forward_mqa` reads, as
its `__init__` sets them (the `__init__` needs a TP group, linears, CUDA events and DeepGEMM).
torch and vLLM only (plus attnfuzz's stand-in modules).
"""

from __future__ import annotations

import functools
import importlib
import tempfile

import torch

from fuzzer.support import dsv4_runtime
from fuzzer.support.dsv4_runtime import (  # noqa: F401  the pieces V4.1 shares with V4, re-exported
    ENTRY_BYTES,
    GUARDED,
    HEAD_DIM,
    ROPE_DIM,
    bind_standins,
    common_metadata,
    configure,
    cpu_shims,
    guard_buffers,
    metadata_outputs,
)
from fuzzer.support.vllm_setup import model_config

FLASHMLA_LAYER_MODULE = "vllm.models.deepseek_v41.nvidia.flashmla"
SWA_MODULE = "vllm.v1.attention.backends.mla.sparse_swa"
SPARSE_MLA_MODULE = "vllm.models.deepseek_v41.sparse_mla"

SWA_BLOCK_SIZE = 32  # DeepseekV4Attention (V4.1) makes its DeepseekV4SWACache with block_size=32
MAX_MODEL_LEN = 163840
# Layers of the tiny config, per compress ratio: the kv (and index) source layer, and a consumer above it that
# reads the source's compressed cache. Ratio 0 layers have neither.
SOURCE_LAYER = {1: 0, 2: 2}
CONSUMER_LAYER = {1: 1, 2: 3}
SWA_ONLY_LAYER = 4
V41_ENTRY_BYTES = 528  # the MXFP8 record V4.1's layer writes on SM100 (512 fp8 + 16 UE8M0, interleaved)


def layer_prefix(layer_id: int) -> str:
    return f"model.layers.{layer_id}.attn"


HF_CONFIG = dict(architectures=["DeepseekV41ForCausalLM"], model_type="deepseek_v41", hidden_size=512,
                 num_attention_heads=64, head_dim=HEAD_DIM, qk_rope_head_dim=ROPE_DIM, q_lora_rank=256,
                 o_lora_rank=128, o_groups=8, sliding_window=128, index_topk=512, index_n_heads=8,
                 index_head_dim=128, num_hidden_layers=5, num_nextn_predict_layers=1, vocab_size=1000,
                 intermediate_size=256, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                 # every V4.1 layer type present, so the SWA builder plans each (swaonly, c1a, c2a); MTP layer: 0
                 compress_ratios=[1, 1, 2, 2, 0, 0], kv_source_layer_ids=[0, 2], index_source_layer_ids=[0, 2],
                 max_position_embeddings=MAX_MODEL_LEN, torch_dtype="bfloat16")


@functools.cache
def install_standins(device: str) -> tuple[str, ...]:
    """Bind the FlashMLA stand-ins where DeepSeek-V4.1's layer module and the shared SWA builder look the compiled
    entry points up: for a host without `_flashmla_C`, or CPU tensors. The real ones otherwise."""
    return bind_standins(device, FLASHMLA_LAYER_MODULE, SWA_MODULE)


@functools.cache
def dsv41_config(device: str, state_dir: str | None = None):
    """Process-wide: one real VllmConfig for a DeepSeek-V4.1 model (per-case fields: `configure`), fp8_ds_mla,
    and the workspace manager. The model's config.json goes under `state_dir` (None: a new temporary directory)."""
    from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig
    from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

    model = model_config(state_dir or tempfile.mkdtemp(), "dsv41-model", HF_CONFIG, MAX_MODEL_LEN)
    cfg = VllmConfig(model_config=model, device_config=DeviceConfig(device=device),
                     cache_config=CacheConfig(block_size=128, cache_dtype="fp8_ds_mla"),
                     scheduler_config=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=256,
                                                      max_model_len=MAX_MODEL_LEN, is_encoder_decoder=False))
    if not is_workspace_manager_initialized():
        init_workspace_manager(torch.device(device))
    return cfg


def step_config(device: str, state_dir: str | None = None, **fields):
    """vLLM's config for the step: the process's DeepSeek-V4.1 VllmConfig with the case's fields set (V4's
    `configure`)."""
    return configure(dsv41_config(device, state_dir), **fields)


def page_alignment(record: int) -> int:
    """DeepseekV4Attention's kv_page_alignment: V4's 576-byte TMA stride, 512 for V4.1's record (SM100)."""
    return 512 if record == V41_ENTRY_BYTES else 576


def compressed_spec(compress_ratio: int, block_size: int, record: int = ENTRY_BYTES):
    """The kv-source layer's compressed K cache spec, as DeepseekV4Attention.get_kv_cache_spec (V4.1) declares it
    for fp8_ds_mla, in blocks of `block_size` tokens: off SM100 the 584-byte V4 record (pages aligned to 576), on
    SM100 the 528-byte MXFP8 one (aligned to 512)."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode

    return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=HEAD_DIM, dtype=torch.uint8,
                            tokens_per_state=compress_ratio, cache_dtype_str="fp8_ds_mla",
                            alignment=page_alignment(record), model_version="deepseek_v4",
                            kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"), state_content_bytes=record)


def paged(raw: torch.Tensor, entries_per_block: int, record: int = ENTRY_BYTES) -> torch.Tensor:
    """The [num_blocks, entries, record bytes] view of a raw [num_blocks, page_bytes] cache, as the runner binds it."""
    pages, page_bytes = raw.shape
    return torch.as_strided(raw, (pages, entries_per_block, record), (page_bytes, record, 1))


def layer_ids(compress_ratio: int, kv_source: str) -> tuple[int, int | None]:
    """(the attention layer's id, its kv source's id or None): a source reads its own cache, a consumer the
    source's below it; a sliding-window layer has none."""
    if compress_ratio == 0:
        return SWA_ONLY_LAYER, None
    source = SOURCE_LAYER[compress_ratio]
    return (source if kv_source == "own" else CONSUMER_LAYER[compress_ratio]), source


def swa_cache_layer(cfg, layer_id: int, window_size: int, block_size: int = SWA_BLOCK_SIZE,
                    record: int = ENTRY_BYTES, layer_module: str = FLASHMLA_LAYER_MODULE,
                    layer_class: str = "DeepseekV4FlashMLAAttention", dtype: torch.dtype = torch.uint8):
    """vLLM's DeepseekV4SWACache as the V4.1 layer makes it (no bounded replay): off SM100 584-byte records, pages
    aligned to 576; on SM100 (`record` 528) MXFP8 records, pages aligned to 512 and a block stride of whole rows of
    both caches' records (lcm of the two: FlashMLA reads the interleaved records as rows of the whole cache). It
    registers itself in the forward context under its prefix. `layer_module`, `layer_class`, `dtype`: another V4.1
    layer's (FlashInfer's: plain rows of bf16 or e4m3, for which the record arguments do not count)."""
    return dsv4_runtime.swa_cache_layer(
        cfg, window_size, block_size, prefix=f"{layer_prefix(layer_id)}.swa_cache", layer_module=layer_module,
        layer_class=layer_class, dtype=dtype, packed_bytes_per_token=record,
        packed_page_alignment=page_alignment(record),
        packed_block_stride_alignment=record if record == V41_ENTRY_BYTES else None)


def _bare_layer(cfg, layer_id: int, compress_ratio: int, source_id: int | None, cls=None):
    import torch.nn as nn

    cls = cls or importlib.import_module(FLASHMLA_LAYER_MODULE).DeepseekV4FlashMLAAttention
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    prefix = layer_prefix(layer_id)
    context = cfg.compilation_config.static_forward_context
    context.pop(prefix, None)
    context[prefix] = layer  # __init__ registers the layer: consumers find their source here
    layer.prefix, layer.layer_id = prefix, layer_id
    layer.compress_ratio = compress_ratio
    layer.is_kv_source = source_id == layer_id
    layer.kv_source_layer_id = source_id
    layer.compressed_cache_prefix = None if source_id is None else layer_prefix(source_id)
    layer._static_forward_context = context
    layer.kv_cache = torch.tensor([])  # what __init__ leaves; the runner binds a kv source's cache
    return layer


def attention_layers(cfg, compress_ratio: int, kv_source: str, swa_layer, kv_cache: torch.Tensor | None,
                     topk_indices_buffer: torch.Tensor, attn_sink: torch.Tensor, num_heads: int, cls=None):
    """The V4.1 DeepseekV4FlashMLAAttention under test, with what its forward_mqa reads, set as __init__ sets it;
    for a consumer (kv_source "shared") also its kv-source layer, registered under its prefix and holding the
    compressed cache the runner binds to it. `attn_sink` [padded heads] fp32; `num_heads` the rank's q heads; `cls`:
    another V4.1 layer class (FlashInfer's) in FlashMLA's place."""
    layer_id, source_id = layer_ids(compress_ratio, kv_source)
    if source_id is not None and source_id != layer_id:
        source = _bare_layer(cfg, source_id, compress_ratio, source_id, cls)
        source.kv_cache = kv_cache
    layer = _bare_layer(cfg, layer_id, compress_ratio, source_id, cls)
    if layer.is_kv_source:
        layer.kv_cache = kv_cache
    hf = cfg.model_config.hf_config
    layer.window_size = hf.sliding_window
    layer.use_pcp = cfg.parallel_config.prefill_context_parallel_size > 1
    layer.head_dim, layer.scale = HEAD_DIM, HEAD_DIM**-0.5
    layer.n_local_heads = num_heads
    layer.padded_heads = attn_sink.shape[0]
    if hasattr(layer, "_get_prefill_num_heads"):  # FlashMLA's layer: the rank's heads on SM90 for 8/16/32
        layer._prefill_num_heads = layer._get_prefill_num_heads()
    layer.attn_sink = attn_sink
    layer.swa_cache_layer = swa_layer
    layer.topk_indices_buffer = topk_indices_buffer
    layer.max_num_batched_tokens = cfg.scheduler_config.max_num_batched_tokens
    layer.max_model_len = cfg.model_config.max_model_len
    return layer


# -- the step's calls V4.1 makes its own way (the rest are V4's: dsv4_runtime.build_metadata, forward_mqa) ---------

def step_layer(cfg, compress_ratio: int, kv_source: str, window_size: int, swa_block_size: int, kv_record: int,
               compressed_block_size: int, entries_per_block: int, swa_pages: torch.Tensor,
               compressed_pages: torch.Tensor | None, topk_indices_buffer: torch.Tensor, attn_sink: torch.Tensor,
               num_heads: int):
    """V4.1's objects for the step: the layer's SWA cache (DeepseekV4SWACache of `kv_record`-byte records) and the
    compressed K cache of its kv source, raw pages bound as the runner binds them (`compressed_pages` None: a
    sliding-window layer has none), and the layer, V4.1's DeepseekV4FlashMLAAttention, made without its __init__,
    with a consumer's kv-source layer beside it (`attention_layers`). Returns (layer, the compressed cache's spec or
    None, its KV-cache group's prefix: the kv source's)."""
    layer_id, source_id = layer_ids(compress_ratio, kv_source)
    swa_layer = swa_cache_layer(cfg, layer_id, window_size, swa_block_size, kv_record)
    swa_layer.kv_cache = paged(swa_pages, swa_block_size, kv_record)
    spec = kv_cache = None
    if compressed_pages is not None:
        spec = compressed_spec(compress_ratio, compressed_block_size, kv_record)
        kv_cache = paged(compressed_pages, entries_per_block, kv_record)
    layer = attention_layers(cfg, compress_ratio, kv_source, swa_layer, kv_cache, topk_indices_buffer, attn_sink,
                             num_heads)
    return layer, spec, None if source_id is None else layer_prefix(source_id)


def metadata_outputs_v41(swa_md, md=None) -> dict[str, torch.Tensor]:
    """What V4.1's builders made that the step is judged on: the SWA builder's, as V4's (`metadata_outputs`), and of
    the compressed builder (it makes no C128A metadata) its slot mapping."""
    out = metadata_outputs(swa_md)
    if md is not None:
        out["compressed_slot_mapping"] = md.slot_mapping.clone()
    return out
