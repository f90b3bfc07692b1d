"""Setting vLLM up to run DeepSeek-V4's and V4.1's FlashInfer sparse attention on SM100 without a model:
FLASHINFER_MLA_SPARSE_DSV4 (`DeepseekV4FlashInferMLAAttention` of vllm/models/deepseek_v4/nvidia/flashinfer_sparse.py,
backend `DeepseekV4FlashInferMLASparseBackend`) and FLASHINFER_MLA_SPARSE_DSV41 (the same names under
vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py).

The layer stores plain rows (`use_fp8_ds_mla_layout = False`): each token's 512-wide latent as a bf16 row
(--kv-cache-dtype auto / bfloat16) or a per-tensor e4m3 row at k_scale 1.0 (fp8 / fp8_e4m3), in both its SWA cache
and its compressed K cache; its `forward_mqa` builds one combined sparse table per token with vLLM's Triton
`build_flashinfer_mixed_sparse_indices` (SWA slots, then compressed slots, remapped to storage rows by each pool's
block span: `_packed_block_span`, for the packed KV layout of vLLM issue 47783) and calls FlashInfer's
`trtllm_batch_decode_sparse_mla_dsv4` once for the decodes and once for the prefills. The layer is made without its
`__init__` (a TP group, linears, CUDA events, DeepGEMM's recipe; dsv4_runtime.attention_layer), with the attributes
`__init__` sets that forward_mqa reads, the fp8 scale buffers included. vLLM's own code makes the compressed cache's
spec (`get_kv_cache_spec`) and the layer's dtypes (`_resolve_dsv4_kv_cache_dtype`).

vLLM's platform check would not choose the backend here (`supports_compute_capability`: major 10 or 12): the layer
is built as an SM100 host builds it, and FlashInfer's kernel is attnfuzz's stand-in
(`standins.flashinfer_dsv4_mla`), bound as the layer module's `flashinfer_trtllm_batch_decode_sparse_mla_dsv4` for
the span of each forward_mqa call only (`PLATFORM_NOTE`). Not driven: the SM120 layer of the same backend
(`DeepseekV4FlashInferSM120Attention`, fp8_ds_mla), the RopeQuant output (128 local heads with an fp8 cache and an
fp8 wo_a: FlashInfer's fused inverse-RoPE fp8 epilogue), DSpark's non-causal decode rows.
torch and vLLM only (plus attnfuzz's stand-ins).
"""

from __future__ import annotations

import contextlib
import importlib

import torch

from fuzzer.support import dsv4_runtime, dsv41_runtime
from fuzzer.support.cpu_host import prepare_cpu_host
from fuzzer.support.vllm_setup import define_missing_c_queries
from fuzzer.support.standins import flashinfer_dsv4_mla, flashinfer_trtllm_mla

LAYER_MODULES = {"4": "vllm.models.deepseek_v4.nvidia.flashinfer_sparse",
                 "4.1": "vllm.models.deepseek_v41.nvidia.flashinfer_sparse"}
LAYER_CLASS = "DeepseekV4FlashInferMLAAttention"
KERNEL_NAME = "flashinfer_trtllm_batch_decode_sparse_mla_dsv4"  # the layer module's name for FlashInfer's entry point
PLATFORM_NOTE = ("vLLM's DeepseekV4FlashInferMLASparseBackend.supports_compute_capability asks for major 10 or 12: "
                 "this host has neither; the layer is built as an SM100 host builds it (DeepseekV4FlashInferMLAAttention)"
                 " and FlashInfer's trtllm_batch_decode_sparse_mla_dsv4 is a stand-in bound in the layer's module for "
                 "its forward_mqa calls only")
EMULATED = (f"{flashinfer_dsv4_mla.KERNEL}: FlashInfer's Python checks, the semantics of its test reference and "
            "vLLM's call site (what they leave open is named in the result: not_public)",)


def layer_class(version: str = "4"):
    """vLLM's FlashInfer DeepSeek-V4 (`version` "4") or V4.1 ("4.1") SM100 attention layer class."""
    return getattr(importlib.import_module(LAYER_MODULES[version]), LAYER_CLASS)


def prepare_host(device: str, version: str = "4") -> tuple[list[str], tuple[str, ...]]:
    """What this host needs before the layer's calls: (shims, ops stood in for). The capability queries ModelConfig
    makes of a `_C` this build may lack; on a CPU, Triton's interpreter corrected and the accelerator plumbing
    shimmed; the SWA builder's FlashMLA plan stand-in where FlashMLA is missing (it makes an empty plan per layer
    type, which FlashInfer's layer never reads); FlashInfer's kernel always a stand-in."""
    layer_class(version)
    shims = list(define_missing_c_queries())
    if device == "cpu":
        shims += [*prepare_cpu_host(), *dsv4_runtime.cpu_shims()]
    shims.append(PLATFORM_NOTE)
    return shims, (*EMULATED, *dsv4_runtime.bind_swa_standins(device))


@contextlib.contextmanager
def flashinfer_kernel(layer):
    """The stand-in as what the name the layer's module calls FlashInfer's kernel by resolves to, inside the block
    only: that name is vllm.utils.flashinfer's lazy wrapper (imported by value into the module, and into any copy of
    its namespace a mutant compiles a method in), whose cached lookup `_get_impl` answers the stand-in for the
    block."""
    wrapper = getattr(importlib.import_module(type(layer).__module__), KERNEL_NAME)
    cell = dict(zip(wrapper.__code__.co_freevars, wrapper.__closure__))["_get_impl"]
    saved = cell.cell_contents
    cell.cell_contents = lambda: flashinfer_dsv4_mla.trtllm_batch_decode_sparse_mla_dsv4
    try:
        yield
    finally:
        cell.cell_contents = saved


def cache_dtypes(cache_dtype: str, version: str = "4") -> tuple[str, torch.dtype]:
    """(cache dtype string, torch dtype) as vLLM's DeepseekV4Attention of `version` (its base class's module,
    `_resolve_dsv4_kv_cache_dtype`) resolves them for the plain-row layout."""
    base = layer_class(version).__mro__[1]  # DeepseekV4Attention of V4's or V4.1's attention.py
    return importlib.import_module(base.__module__)._resolve_dsv4_kv_cache_dtype(False, cache_dtype, None)


def rows_view(raw: torch.Tensor, rows_per_block: int, dtype: torch.dtype) -> torch.Tensor:
    """The [num_blocks, rows, 512] view of a raw plain-row cache [num_blocks, page bytes] as the runner binds it: its
    block stride the whole page (longer than the rows under the packed layout), its token stride one row."""
    pages, page_bytes = raw.shape
    elem = torch.empty((), dtype=dtype).element_size()
    return torch.as_strided(raw.view(dtype), (pages, rows_per_block, 512), (page_bytes // elem, 512, 1))


def runner_table(table: torch.Tensor, block_size: int, max_model_len: int) -> torch.Tensor:
    """A step's block table [num_reqs, columns] as wide as the model runner's (`BlockTable`: cdiv(max_model_len,
    block_size) columns a request), the columns past the step's 0 (the null block)."""
    width = max(table.shape[1], -(-max_model_len // block_size))
    wide = torch.zeros((table.shape[0], width), dtype=table.dtype, device=table.device)
    wide[:, : table.shape[1]] = table
    return wide


def set_layer_dtypes(layer, cfg, version: str = "4", scales: bool = True) -> None:
    """What DeepseekV4Attention.__init__ and the FlashInfer layer's __init__ set of the cache dtype: kv_cache_dtype,
    kv_cache_torch_dtype and (`scales`), for a per-tensor fp8 cache, the scale buffers (1.0) and the Python-float bmm
    scales."""
    layer.kv_cache_dtype, layer.kv_cache_torch_dtype = cache_dtypes(cfg.cache_config.cache_dtype, version)
    if layer.kv_cache_torch_dtype != torch.float8_e4m3fn or not scales:
        return
    device = layer.attn_sink.device
    for name in ("_flashinfer_fp8_q_scale", "_flashinfer_fp8_q_scale_inv", "_flashinfer_fp8_kv_scale"):
        layer.register_buffer(name, torch.tensor([1.0], dtype=torch.float32, device=device), persistent=False)
    layer._flashinfer_fp8_bmm1_scale = layer.scale * 1.0 * 1.0
    layer._flashinfer_fp8_bmm2_scale = 1.0


def padded_heads(heads: int, version: str = "4") -> int:
    """The q/output heads the layer allocates (its get_padded_num_q_heads: 8, 16, 32, 64 or 128)."""
    return layer_class(version).get_padded_num_q_heads(heads)


# -- the step's calls, as the target makes them and its reproducers show them ------------------------------------

def step_layer(cfg, compress_ratio: int, window_size: int, swa_block_size: int, swa_pages: torch.Tensor,
               compressed_pages: torch.Tensor | None, topk_indices_buffer: torch.Tensor, attn_sink: torch.Tensor):
    """vLLM's objects for a DeepSeek-V4 step on FlashInfer's SM100 layer: its SWA cache (DeepseekV4SWACache of the
    layer's dtype) and compressed K cache with their raw pages bound as plain rows (`rows_view`; `compressed_pages`
    None: a sliding-window layer has none), and the layer made without its __init__. Returns (layer, the compressed
    cache's spec as the layer declares it, or None, its KV-cache group's prefix)."""
    cls = layer_class("4")
    _, dtype = cache_dtypes(cfg.cache_config.cache_dtype)
    swa_layer = dsv4_runtime.swa_cache_layer(cfg, window_size, swa_block_size, layer_module=LAYER_MODULES["4"],
                                             layer_class=LAYER_CLASS, dtype=dtype)
    swa_layer.kv_cache = rows_view(swa_pages, swa_block_size, dtype)
    kv_cache = None
    if compressed_pages is not None:
        kv_cache = rows_view(compressed_pages, cfg.cache_config.block_size // compress_ratio, dtype)
    layer = dsv4_runtime.attention_layer(cfg, compress_ratio, swa_layer, kv_cache, topk_indices_buffer, attn_sink,
                                         cls=cls)
    set_layer_dtypes(layer, cfg)
    spec = layer.get_kv_cache_spec(cfg) if compressed_pages is not None else None
    return layer, spec, dsv4_runtime.LAYER


def step_layer_v41(cfg, compress_ratio: int, kv_source: str, window_size: int, swa_block_size: int,
                   compressed_block_size: int, swa_pages: torch.Tensor, compressed_pages: torch.Tensor | None,
                   topk_indices_buffer: torch.Tensor, attn_sink: torch.Tensor, num_heads: int):
    """vLLM's objects for a DeepSeek-V4.1 step on FlashInfer's SM100 layer (V4.1's DeepseekV4FlashInferMLAAttention):
    its SWA cache of plain rows, the compressed K cache of its kv source (a consumer, `kv_source` "shared", reads the
    source layer's beside it), both bound as plain rows, the layer made without its __init__
    (dsv41_runtime.attention_layers). Returns (layer, the kv source's compressed cache spec as it declares it, or
    None, that cache's KV-cache group's prefix)."""
    cls = layer_class("4.1")
    _, dtype = cache_dtypes(cfg.cache_config.cache_dtype, "4.1")
    layer_id, source_id = dsv41_runtime.layer_ids(compress_ratio, kv_source)
    swa_layer = dsv41_runtime.swa_cache_layer(cfg, layer_id, window_size, swa_block_size,
                                              layer_module=LAYER_MODULES["4.1"], layer_class=LAYER_CLASS, dtype=dtype)
    swa_layer.kv_cache = rows_view(swa_pages, swa_block_size, dtype)
    kv_cache = None
    if compressed_pages is not None:
        kv_cache = rows_view(compressed_pages, compressed_block_size // compress_ratio, dtype)
    layer = dsv41_runtime.attention_layers(cfg, compress_ratio, kv_source, swa_layer, kv_cache, topk_indices_buffer,
                                           attn_sink, num_heads, cls=cls)
    set_layer_dtypes(layer, cfg, "4.1")
    if source_id is None:
        return layer, None, None
    source = layer if layer.is_kv_source else cfg.compilation_config.static_forward_context[layer.compressed_cache_prefix]
    if source is not layer:  # what its __init__ sets that its get_kv_cache_spec reads
        source.head_dim = layer.head_dim
        set_layer_dtypes(source, cfg, "4.1", scales=False)
    return layer, source.get_kv_cache_spec(cfg), layer.compressed_cache_prefix


def forward_mqa(cfg, layer, metadata: dict, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The layer's attention on the step, its forward_mqa (decode and prefill calls of FlashInfer's kernel), in the
    forward context the runner sets, into a bf16 output filled with NaN (rows it does not write stay NaN). q is bf16
    as the model computes it; over a per-tensor fp8 cache the layer's fused insert hands forward_mqa q in e4m3 (times
    `_flashinfer_fp8_q_scale_inv`, 1.0, saturated), which is what it gets here."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    if layer.kv_cache_torch_dtype == torch.float8_e4m3fn:
        q = q.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    with set_current_vllm_config(cfg), torch.inference_mode(), set_forward_context(metadata, cfg), \
            flashinfer_kernel(layer):
        out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
        layer.forward_mqa(q, None, positions, out)
    return out


def not_public() -> list[tuple[str, list[int]]]:
    """What the stand-in's calls since the last look met that FlashInfer's public contract does not settle; cleared."""
    found = list(flashinfer_trtllm_mla.UNDOCUMENTED)
    flashinfer_trtllm_mla.UNDOCUMENTED.clear()
    return found
