"""Setting vLLM up to run DeepSeek-V4.1's attention on FlashMLA's mega-attention kernel (`FLASHMLA_MEGA_ATTN_DSV41`,
`DeepseekV4MegaAttnAttention` of `vllm/models/deepseek_v41/nvidia/flash_mla_mega_attn.py`, SM100) without a model.

What differs from V4.1's FlashMLA layer (dsv41_runtime, whose pieces this module uses): the layer class; its
`forward_mqa(q, kv, positions, output)` takes q unnormed and unroped in the kernel's fused layout (the permuted wq_b
produces it) and writes an MXFP8 output pair (`alloc_mega_attn_output`) already inverse-roped; the layer reads
`rotary_emb.cos_sin_cache` and `n_wv_group`; under `nvfp4_ds_mla` its compressed cache holds 288-byte NVFP4 records
beside the 528-byte MXFP8 SWA ones. The layer is made without its `__init__` (TP group, linears, weight permutes,
DeepGEMM), with the attributes its forward_mqa reads. The mega kernels are stand-ins on every attnfuzz host
(`standins.flashmla_mega`: no host has an SM100 with FlashMLA's mega ops), bound as the module's
`torch.ops._flashmla_C`. torch and vLLM only (plus attnfuzz's stand-in modules).
"""

from __future__ import annotations

import functools
import importlib
from types import SimpleNamespace

import torch

from fuzzer.support import dsv4_runtime
from fuzzer.support import dsv41_runtime as v41
from fuzzer.support.standins import flashmla_mega

MEGA_LAYER_MODULE = "vllm.models.deepseek_v41.nvidia.flash_mla_mega_attn"
MEGA_LAYER_CLASS = "DeepseekV4MegaAttnAttention"
NVFP4_ENTRY_BYTES = 288  # V4.1's NVFP4 compressed record (nvfp4_ds_mla)
ROPE_BASE = 10000.0
GROUP, O_CHUNK, HEAD_DIM = 8, 32, 512


def install_standins(device: str = "cpu") -> tuple[str, ...]:
    """The mega kernels' stand-ins bound as the layer module's `torch.ops._flashmla_C`, and the SWA builder's FlashMLA
    entry point (`get_mla_metadata`) where this host lacks FlashMLA; the names of those bound."""
    module = importlib.import_module(MEGA_LAYER_MODULE)
    module.torch = flashmla_mega.TorchWithMegaOps()
    return ("fused_norm_rope_attn_rope_cast_decode", "fused_norm_rope_attn_rope_cast_fwd",
            *dsv4_runtime.bind_swa_standins(device))


def prepare_host(device: str) -> tuple[list[str], tuple[str, ...]]:
    """(shims, ops stood in for): V4.1's host preparation, then the mega kernels' stand-ins."""
    shims, _ = dsv4_runtime.prepare_host(device, v41.FLASHMLA_LAYER_MODULE)
    return shims, install_standins(device)


@functools.cache
def rope_cos_sin(positions: int) -> torch.Tensor:
    """float32 [positions, 64]: cos then sin of position x ROPE_BASE^(-2i/64), i < 32 (the layer's cos_sin_cache;
    any table serves, since the kernel and the reference read the same one)."""
    inv_freq = 1.0 / (ROPE_BASE ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def compressed_spec(compress_ratio: int, block_size: int, record: int):
    """The kv-source layer's compressed K cache spec as DeepseekV4Attention.get_kv_cache_spec (V4.1, SM100) declares
    it: nvfp4_ds_mla's 288-byte record (record 288) or fp8_ds_mla's 528-byte one, pages aligned to 512."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode

    dtype = "nvfp4_ds_mla" if record == NVFP4_ENTRY_BYTES else "fp8_ds_mla"
    return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=HEAD_DIM, dtype=torch.uint8,
                            tokens_per_state=compress_ratio, cache_dtype_str=dtype, alignment=512,
                            model_version="deepseek_v4", kv_quant_mode=get_kv_quant_mode(dtype),
                            state_content_bytes=record)


def step_layer(cfg, compress_ratio: int, kv_source: str, window_size: int, swa_block_size: int, kv_record: int,
               compressed_block_size: int, entries_per_block: int, swa_pages: torch.Tensor,
               compressed_pages: torch.Tensor | None, topk_indices_buffer: torch.Tensor, attn_sink: torch.Tensor,
               num_heads: int, compressed_record: int = v41.V41_ENTRY_BYTES):
    """The mega layer's objects for the step, as dsv41_runtime.step_layer makes V4.1's FlashMLA ones: its SWA cache
    (DeepseekV4SWACache of 528-byte records), the kv source's compressed cache of `compressed_record`-byte records,
    and DeepseekV4MegaAttnAttention made without __init__, with what its forward_mqa reads as __init__ sets it
    (`n_wv_group` = padded heads // 8, `rotary_emb.cos_sin_cache`, `kv_cache_dtype`). Returns (layer, the compressed
    cache's spec or None, its KV-cache group's prefix). The runner's dummy run has reserved its workspace."""
    layer_id, source_id = v41.layer_ids(compress_ratio, kv_source)
    swa_layer = dsv4_runtime.swa_cache_layer(
        cfg, window_size, swa_block_size, prefix=f"{v41.layer_prefix(layer_id)}.swa_cache",
        layer_module=MEGA_LAYER_MODULE, layer_class=MEGA_LAYER_CLASS, packed_bytes_per_token=kv_record,
        packed_page_alignment=512, packed_block_stride_alignment=kv_record)
    swa_layer.kv_cache = v41.paged(swa_pages, swa_block_size, kv_record)
    spec = kv_cache = None
    if compressed_pages is not None:
        spec = compressed_spec(compress_ratio, compressed_block_size, compressed_record)
        kv_cache = v41.paged(compressed_pages, entries_per_block, compressed_record)
    module = importlib.import_module(MEGA_LAYER_MODULE)
    cls = getattr(module, MEGA_LAYER_CLASS)
    layer = v41.attention_layers(cfg, compress_ratio, kv_source, swa_layer, kv_cache, topk_indices_buffer, attn_sink,
                                 num_heads, cls=cls)
    layer.n_local_groups = num_heads // GROUP
    layer.n_wv_group = layer.padded_heads // GROUP
    layer.kv_cache_dtype = "nvfp4_ds_mla" if compressed_record == NVFP4_ENTRY_BYTES else "fp8_ds_mla"
    # on the step's device, as the layer's rotary embedding keeps it (the kernel indexes it with the positions)
    layer.rotary_emb = SimpleNamespace(
        cos_sin_cache=rope_cos_sin(cfg.model_config.max_model_len + 1).to(topk_indices_buffer.device))
    if hasattr(module, "_swapab_decode_supported"):  # 0.34: small decodes' swap-AB kernel, decided as __init__ does
        layer._use_swapab = module._swapab_decode_supported(layer)  # (SM100 with the CuTe DSL only: not here)
    dummy_run(cfg, layer, topk_indices_buffer.device)
    return layer, spec, None if source_id is None else v41.layer_prefix(source_id)


def dummy_run(cfg, layer, device) -> None:
    """The runner's dummy run before any step: forward_mqa without attention metadata, which reserves the prefill
    workspace (the KV chunk and the index scratch side by side). 0.34's prefill keeps the KV chunk in a span at the
    workspace's tail (`get_retained`) that only this reservation keeps clear of the index scratch at its head."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    module = importlib.import_module(MEGA_LAYER_MODULE)
    with set_current_vllm_config(cfg), torch.inference_mode(), set_forward_context(None, cfg):
        out = module.alloc_mega_attn_output(1, layer.n_wv_group, device)
        q = torch.zeros(1, layer.n_wv_group * GROUP, HEAD_DIM, dtype=torch.bfloat16, device=device)
        layer.forward_mqa(q, None, torch.zeros(1, dtype=torch.int64, device=device), out)


def read_mxfp8_output(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The mega output pair -> float32 [tokens, n_wv_group * 8, 512] in the standard layout, read as vLLM's docstrings
    define it: data [tokens, groups, 8 * 512] e4m3, group g's value of head h, dim c * 32 + j at (c * 8 + h) * 32 + j
    (`o_fused_permutation`); scale [tokens, groups, 32] int32, each holding four UE8M0 exponents (lowest byte first)
    of four consecutive 32-value chunks of that layout (DeepGEMM's packed UE8M0)."""
    s, groups, _ = data.shape
    exps = torch.stack([(scale.to(torch.int64) >> (8 * k)) & 0xFF for k in range(4)], dim=-1).reshape(s, groups, -1)
    chunks = data.reshape(s, groups, -1, O_CHUNK).view(torch.float8_e4m3fn).float() * torch.exp2(exps.float() - 127)[..., None]
    chunks = chunks.reshape(s, groups, HEAD_DIM // O_CHUNK, GROUP, O_CHUNK).transpose(2, 3)
    return chunks.reshape(s, groups * GROUP, HEAD_DIM)


def forward_mqa(cfg, layer, metadata: dict, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The mega layer's attention on the step: DeepseekV4MegaAttnAttention.forward_mqa in the runner's forward
    context, on q (standard layout, unroped) permuted to the kernel's fused layout by vLLM's `permute_q_to_fused`
    (what the load-time-permuted wq_b produces), into vLLM's `alloc_mega_attn_output` pair filled with NaN codes
    and 0xFF scales first (rows it does not write read back NaN). Returns the pair read back
    (`read_mxfp8_output`), float32 [tokens, padded heads, 512]."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.models.deepseek_v41.common.ops.fused_layout import permute_q_to_fused

    module = importlib.import_module(MEGA_LAYER_MODULE)
    with set_current_vllm_config(cfg), torch.inference_mode(), set_forward_context(metadata, cfg):
        out = module.alloc_mega_attn_output(q.shape[0], layer.n_wv_group, q.device)
        out.data.view(torch.uint8).fill_(0x7F)
        out.scale.fill_(-1)
        layer.forward_mqa(permute_q_to_fused(q), None, positions, out)
    return read_mxfp8_output(out.data, out.scale)
