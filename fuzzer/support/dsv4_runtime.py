"""Setting vLLM up to run DeepSeek-V4's sparse attention (`FLASHMLA_SPARSE_DSV4`) without a model.

One real VllmConfig from a tiny `deepseek_v4` config.json (written under the state directory), vLLM's own SWA
cache layer (`DeepseekV4SWACache`), the compressed K cache's spec as the layer declares it, and the attention
layer `DeepseekV4FlashMLAAttention` with the attributes its `forward_mqa` reads. The layer's `__init__` cannot run
here (it builds linears on a TP group, `torch.cuda.Event`s and DeepGEMM's fp8 einsum recipe), so the layer is made
with `__new__` and given those attributes as `__init__` sets them. Where the host lacks FlashMLA's compiled
kernels (any CPU), the torch stand-ins of `standins.flashmla_ops` are bound where vLLM's DSv4 modules look them up.
Also the step's vLLM calls, written once for the target and its reproducers (`prepare_host`, `step_layer`,
`build_metadata`, `forward_mqa`; V4.1's target calls them too), and what they share: the runner's
CommonAttentionMetadata of a KV-cache group, the guard on the builders' persistent buffers, and the metadata
tensors the step is judged on.
torch and vLLM only (plus attnfuzz's stand-in modules).
"""

from __future__ import annotations

import functools
import importlib
import tempfile
from types import SimpleNamespace

import torch

from fuzzer.support.cpu_host import prepare_cpu_host
from fuzzer.support.flashmla_runtime import _has_flashmla_kernels
from fuzzer.support.vllm_setup import define_missing_c_queries, model_config, mtp_speculative_config
from fuzzer.support.standins import flashmla_ops

FLASHMLA_LAYER_MODULE = "vllm.models.deepseek_v4.nvidia.flashmla"
SWA_MODULE = "vllm.v1.attention.backends.mla.sparse_swa"
SPARSE_MLA_MODULE = "vllm.models.deepseek_v4.sparse_mla"

HEAD_DIM, ROPE_DIM, ENTRY_BYTES = 512, 64, 584  # DeepSeek-V4: 448 NoPE + 64 RoPE; 584-byte fp8_ds_mla record
SWA_BLOCK_SIZE = 64  # DeepseekV4SWACache's default block_size (tokens a page)
BLOCK_SIZE = 256  # the compressed K cache's kernel block size (DeepseekV4SparseMLABackend): tokens a page
MAX_MODEL_LEN = 163840  # past the gpu-scale profile's 128K contexts; C128A rows of up to 1280 entries
LAYER = "model.layers.0.attn"  # the attention layer's prefix; its SWA cache is f"{LAYER}.swa_cache"
# A tiny DeepSeek-V4-shaped HF config: ModelConfig needs one on disk; the builders read sliding_window,
# index_topk (set per case) and the layers' compress ratios (each present type gets a FlashMLA tile-scheduler plan).
HF_CONFIG = dict(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", hidden_size=512,
                 num_attention_heads=64, head_dim=HEAD_DIM, qk_rope_head_dim=ROPE_DIM, q_lora_rank=256,
                 o_lora_rank=128, o_groups=8, sliding_window=128, index_topk=512, index_n_heads=8,
                 index_head_dim=128, num_hidden_layers=3, num_nextn_predict_layers=1, vocab_size=1000,
                 intermediate_size=256, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                 layer_types=["compressed_sparse_attention", "heavily_compressed_attention",
                              "compressed_sparse_attention"],
                 compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
                 # the same ratios as 0.30-0.32's builders read them (0.33 derives them from the two fields above
                 # when this one is absent): the three layers and the MTP layer (0: sliding window only)
                 compress_ratios=[4, 128, 4, 0],
                 max_position_embeddings=MAX_MODEL_LEN, torch_dtype="bfloat16")


@functools.cache
def install_standins(device: str) -> tuple[str, ...]:
    """Bind the FlashMLA stand-ins where DeepSeek-V4's modules look the compiled entry points up: for a host
    without `_flashmla_C`, or tensors on the CPU (the CUDA kernels cannot take them). The real ones otherwise."""
    return bind_standins(device, FLASHMLA_LAYER_MODULE, SWA_MODULE)


def bind_standins(device: str, layer_module: str, swa_module: str) -> tuple[str, ...]:
    """The FlashMLA stand-ins bound in a DeepSeek-V4-family layer module and its SWA builder's module where this
    host needs them (install_standins); the names of those bound."""
    if device != "cpu" and _has_flashmla_kernels():
        return ()
    layer = importlib.import_module(layer_module)
    layer.flash_mla_with_kvcache = flashmla_ops.flash_mla_with_kvcache
    layer.flash_mla_sparse_fwd = flashmla_ops.flash_mla_sparse_fwd
    return ("flash_mla_with_kvcache", "flash_mla_sparse_fwd", *bind_swa_standins(device, swa_module))


def bind_swa_standins(device: str, swa_module: str = SWA_MODULE) -> tuple[str, ...]:
    """The SWA builder's FlashMLA entry point (`get_mla_metadata`: the empty tile-scheduler plan it makes for every
    present layer type) bound to its stand-in where this host needs it; the names bound."""
    if device != "cpu" and _has_flashmla_kernels():
        return ()
    swa = importlib.import_module(swa_module)
    swa.get_mla_metadata = flashmla_ops.get_mla_metadata
    swa.FlashMLASchedMeta = flashmla_ops.FlashMLASchedMeta
    return ("get_mla_metadata",)


@functools.cache
def cpu_shims() -> tuple[str, ...]:
    """CPU-only plumbing: the workspace manager grows through torch.accelerator.empty_cache, which a CPU lacks."""
    import vllm.v1.worker.workspace as workspace

    workspace.torch = SimpleNamespace(**{**vars(torch), "accelerator": SimpleNamespace(empty_cache=lambda: None)})
    return ("workspace manager: torch.accelerator.empty_cache no-op",)


def prepare_host(device: str, layer_module: str = FLASHMLA_LAYER_MODULE) -> tuple[list[str], tuple[str, ...]]:
    """What this host needs before the layer's calls: (shims, FlashMLA ops stood in for). The capability queries
    ModelConfig makes of a `_C` this build may lack; on a CPU, Triton's interpreter corrected and the accelerator
    plumbing shimmed; where FlashMLA's compiled kernels are missing (any CPU), its torch stand-ins bound in the
    layer's module (`layer_module`: V4's or V4.1's) and the SWA builder's."""
    shims = list(define_missing_c_queries())
    if device == "cpu":
        shims += [*prepare_cpu_host(), *cpu_shims()]
    return shims, bind_standins(device, layer_module, SWA_MODULE)


@functools.cache
def dsv4_config(device: str, state_dir: str | None = None):
    """Process-wide: one real VllmConfig for a DeepSeek-V4 model (per-case fields are set by `configure`), fp8_ds_mla
    cache of 256-token blocks, and the workspace manager. The model's config.json goes under `state_dir` (None: a
    new temporary directory)."""
    from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig
    from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

    model = model_config(state_dir or tempfile.mkdtemp(), "dsv4-model", HF_CONFIG, MAX_MODEL_LEN)
    cfg = VllmConfig(model_config=model, device_config=DeviceConfig(device=device),
                     cache_config=CacheConfig(block_size=BLOCK_SIZE, cache_dtype="fp8_ds_mla"),
                     scheduler_config=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=256,
                                                      max_model_len=MAX_MODEL_LEN, is_encoder_decoder=False))
    if not is_workspace_manager_initialized():
        init_workspace_manager(torch.device(device))
    return cfg


def configure(cfg, *, window_size: int, index_topk: int, num_speculative_tokens: int, max_num_batched_tokens: int,
              max_model_len: int = 0, cache_dtype: str = "fp8_ds_mla"):
    """The case's fields on the shared config, before its builders are made (they read them at construction).
    MTP (num_speculative_tokens > 0): vLLM's speculative config as the builders read it (the decode threshold 1 + k;
    `vllm_setup.mtp_speculative_config`). max_model_len 0: MAX_MODEL_LEN. `cache_dtype`: the engine's
    --kv-cache-dtype (FlashMLA's layer: fp8_ds_mla; FlashInfer's: a plain-row dtype)."""
    cfg.cache_config.cache_dtype = cache_dtype
    hf = cfg.model_config.hf_config
    hf.sliding_window, hf.index_topk = window_size, index_topk
    cfg.model_config.max_model_len = cfg.scheduler_config.max_model_len = max_model_len or MAX_MODEL_LEN
    cfg.scheduler_config.max_num_batched_tokens = max_num_batched_tokens
    cfg.speculative_config = mtp_speculative_config(num_speculative_tokens)
    return cfg


def step_config(device: str, state_dir: str | None = None, **fields):
    """vLLM's config for the step: the process's DeepSeek-V4 VllmConfig with the case's fields set (`configure`)."""
    return configure(dsv4_config(device, state_dir), **fields)


def has_cutedsl() -> bool:
    """vLLM's own test for its CuTe-DSL kernels (`cutlass` importable), which DeepSeek-V4's dequantize-and-gather takes
    in the Triton kernel's place when it passes; False for a release without the test."""
    try:
        from vllm.utils.import_utils import has_cutedsl as vllm_has_cutedsl
    except ImportError:
        return False
    return bool(vllm_has_cutedsl())


def compressed_spec(compress_ratio: int):
    """The compressed K cache's spec, as DeepseekV4Attention.get_kv_cache_spec declares it for fp8_ds_mla."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode

    return MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, max_tp_shards=1, head_size=HEAD_DIM,
                            dtype=torch.uint8, tokens_per_state=compress_ratio, cache_dtype_str="fp8_ds_mla",
                            alignment=576, model_version="deepseek_v4", kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"),
                            state_content_bytes=ENTRY_BYTES)


def swa_cache_layer(cfg, window_size: int, block_size: int = SWA_BLOCK_SIZE, prefix: str = f"{LAYER}.swa_cache",
                    layer_module: str = FLASHMLA_LAYER_MODULE, layer_class: str = "DeepseekV4FlashMLAAttention",
                    dtype: torch.dtype = torch.uint8, **packing):
    """vLLM's DeepseekV4SWACache for the layer `layer_class` of `layer_module` (it registers itself in the forward
    context under its prefix), of the layer's cache dtype (uint8: fp8_ds_mla; FlashInfer's plain rows: bf16 or
    e4m3); `packing`: the record layout V4.1's layer passes (packed_bytes_per_token and its alignments)."""
    from vllm.config import set_current_vllm_config

    swa = importlib.import_module(SWA_MODULE)
    layer_cls = getattr(importlib.import_module(layer_module), layer_class)
    cfg.compilation_config.static_forward_context.pop(prefix, None)
    with set_current_vllm_config(cfg):
        return swa.DeepseekV4SWACache(head_dim=HEAD_DIM, window_size=window_size, dtype=dtype, prefix=prefix,
                                      cache_config=cfg.cache_config, backend_cls=layer_cls.swa_backend_cls,
                                      block_size=block_size, **packing)


def paged(raw: torch.Tensor, entries_per_block: int) -> torch.Tensor:
    """The [num_blocks, entries, 584] view of a raw [num_blocks, page_bytes] cache, as the runner binds it."""
    pages, page_bytes = raw.shape
    return torch.as_strided(raw, (pages, entries_per_block, ENTRY_BYTES), (page_bytes, ENTRY_BYTES, 1))


def attention_layer(cfg, compress_ratio: int, swa_layer, kv_cache: torch.Tensor | None,
                    topk_indices_buffer: torch.Tensor, attn_sink: torch.Tensor, cls=None):
    """DeepseekV4FlashMLAAttention (or `cls`, another DeepseekV4Attention subclass) with what its forward_mqa reads,
    set as its __init__ sets it (the __init__ itself needs a TP group, linears, CUDA events and DeepGEMM; see the
    module docstring). `attn_sink` [padded heads] fp32."""
    import torch.nn as nn

    cls = cls or importlib.import_module(FLASHMLA_LAYER_MODULE).DeepseekV4FlashMLAAttention
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    hf = cfg.model_config.hf_config
    layer.prefix = LAYER
    layer.compress_ratio = compress_ratio
    layer.window_size = hf.sliding_window
    layer.max_image_tokens = 0
    layer.head_dim, layer.scale = HEAD_DIM, HEAD_DIM**-0.5
    layer.padded_heads = attn_sink.shape[0]
    layer.attn_sink = attn_sink
    layer.swa_cache_layer = swa_layer
    # SWA-only layers own no compressed cache (the runner leaves them the empty tensor __init__ sets).
    layer.kv_cache = kv_cache if kv_cache is not None else torch.tensor([])
    layer.topk_indices_buffer = topk_indices_buffer
    layer.max_num_batched_tokens = cfg.scheduler_config.max_num_batched_tokens
    layer.max_model_len = cfg.model_config.max_model_len
    return layer


def common_metadata(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                    slot_mapping: torch.Tensor, positions: torch.Tensor, num_actual_tokens: int):
    """The runner's CommonAttentionMetadata for one KV-cache group of the step: its block table and its slots of
    the step's tokens (-1 for padding tokens, which `num_actual_tokens` counts past query_start_loc[-1])."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl_cpu, seq_lens_cpu = query_start_loc.cpu(), seq_lens.cpu()
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc.clone(), query_start_loc_cpu=qsl_cpu, seq_lens=seq_lens.clone(),
        num_reqs=len(seq_lens_cpu), num_actual_tokens=num_actual_tokens,
        max_query_len=int((qsl_cpu[1:] - qsl_cpu[:-1]).max()), max_seq_len=int(seq_lens_cpu.max()),
        # clones: the compressed builder clamps the block table in place
        block_table_tensor=block_table.clone(), slot_mapping=slot_mapping, positions=positions.clone(),
        seq_lens_cpu_upper_bound=seq_lens_cpu)


# The builders' persistent buffers whose rows a step owns only through the views its metadata holds (buffer,
# metadata field): a write outside them is a metadata kernel running past its rows (the C128A fix in sparse_mla.py).
GUARDED = (("decode_swa_indices", "decode_swa_indices"), ("prefill_swa_indices", "prefill_swa_indices"),
           ("prefill_swa_lens", "prefill_swa_lens"),
           ("c128a_global_decode_buffer", "c128a_global_decode_topk_indices"),
           ("c128a_decode_lens_buffer", "c128a_decode_topk_lens"),
           ("c128a_prefill_buffer", "c128a_prefill_topk_indices"))
BUFFER_POISON = 2**30 - 1


def guard_buffers(builder):
    """Fill the builder's guarded buffers (those it has) with BUFFER_POISON before it builds; returns
    check(metadata): the elements of each written outside the view the step's metadata holds of it, in words."""
    buffers = {name: getattr(builder, name) for name, _ in GUARDED if getattr(builder, name, None) is not None}
    for buffer in buffers.values():
        buffer.fill_(BUFFER_POISON)

    def check(metadata) -> list[str]:
        found = []
        for name, field in GUARDED:
            buffer = buffers.get(name)
            if buffer is None:
                continue
            allowed = torch.zeros(buffer.numel(), dtype=torch.bool, device=buffer.device)
            view = getattr(metadata, field, None)
            if (view is not None and view.numel()
                    and view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()):
                index = torch.arange(buffer.numel(), device=buffer.device)
                allowed[torch.as_strided(index, view.shape, view.stride(),
                                         view.storage_offset() - buffer.storage_offset()).flatten()] = True
            written = (buffer.flatten() != BUFFER_POISON) & ~allowed
            if written.any():
                where = written.nonzero().flatten()
                row = buffer.stride(0) if buffer.dim() > 1 else 1
                found.append(f"{name}: {int(written.sum())} elements outside the step's view "
                             f"{tuple(view.shape) if view is not None else '(none)'} written (rows "
                             f"{int(where[0]) // row}..{int(where[-1]) // row} of {buffer.shape[0]})")
        return found

    return check


def metadata_outputs(swa_md, md=None) -> dict[str, torch.Tensor]:
    """What the builders made that the step is judged on, by name (copies): the SWA builder's batch split, token
    maps, SWA indices and lengths and prefill gather lengths; the compressed builder's (`md`, C4/C128 layers)
    compressed slot mapping and C128A top-k metadata."""
    out = {"split": torch.tensor([swa_md.num_decodes, swa_md.num_prefills, swa_md.num_decode_tokens,
                                  swa_md.num_prefill_tokens]),
           "token_to_req_indices": swa_md.token_to_req_indices, "is_valid_token": swa_md.is_valid_token,
           "decode_swa_indices": swa_md.decode_swa_indices if swa_md.num_decode_tokens else None,
           "decode_swa_lens": swa_md.decode_swa_lens if swa_md.num_decode_tokens else None,
           "prefill_swa_indices": swa_md.prefill_swa_indices, "prefill_swa_lens": swa_md.prefill_swa_lens,
           "prefill_gather_lens": swa_md.prefill_gather_lens}
    if md is not None:
        out.update({"compressed_slot_mapping": md.slot_mapping,
                    "c128a_decode_indices": md.c128a_global_decode_topk_indices,
                    "c128a_decode_lens": md.c128a_decode_topk_lens,
                    "c128a_prefill_indices": md.c128a_prefill_topk_indices})
    return {k: v.clone() for k, v in out.items() if v is not None}


# -- the step's calls, as the target makes them and its reproducers show them ------------------------------------

def step_layer(cfg, compress_ratio: int, window_size: int, swa_block_size: int, entries_per_block: int,
               swa_pages: torch.Tensor, compressed_pages: torch.Tensor | None, topk_indices_buffer: torch.Tensor,
               attn_sink: torch.Tensor):
    """vLLM's objects for the step: the layer's SWA cache (DeepseekV4SWACache) and compressed K cache with their raw
    pages bound as the runner binds them (`compressed_pages` None: a sliding-window layer has none), and the layer,
    DeepseekV4FlashMLAAttention, made without its __init__ (`attention_layer`). Returns (layer, the compressed cache's
    spec or None, its KV-cache group's prefix)."""
    swa_layer = swa_cache_layer(cfg, window_size, swa_block_size)
    swa_layer.kv_cache = paged(swa_pages, swa_block_size)
    spec = kv_cache = None
    if compressed_pages is not None:
        spec, kv_cache = compressed_spec(compress_ratio), paged(compressed_pages, entries_per_block)
    layer = attention_layer(cfg, compress_ratio, swa_layer, kv_cache, topk_indices_buffer, attn_sink)
    return layer, spec, LAYER


def build_metadata(cfg, layer, swa_common, compressed_spec, compressed_prefix, compressed_common, device: str,
                   found: list, guard_compressed: bool = True) -> dict:
    """The step's metadata, one KV-cache group at a time as the runner builds it: the layer's SWA builder
    (DeepseekSparseSWAFlashMLAMetadataBuilder) on its sliding-window cache's group, and where the layer has a
    compressed cache (`compressed_spec`), its backend's builder (DeepseekV4FlashMLAMetadataBuilder) on that cache's
    group. Each builder's persistent buffers are poisoned first (`guard_buffers`): what a build writes outside its
    step's views is added to `found`. Returns {group prefix: metadata}, the forward context's."""
    from vllm.config import set_current_vllm_config

    swa_layer, cls = layer.swa_cache_layer, type(layer)
    with set_current_vllm_config(cfg), torch.inference_mode():
        # the SWA cache's own backend (the layer's swa_backend_cls, or the default one where the layer names none)
        swa_builder = swa_layer.get_attn_backend().get_builder_cls()(swa_layer.get_kv_cache_spec(cfg),
                                                                     [swa_layer.prefix], cfg, torch.device(device))
        check = guard_buffers(swa_builder)
        metadata = {swa_layer.prefix: swa_builder.build(0, swa_common)}
        found += check(metadata[swa_layer.prefix])
        if compressed_spec is not None:
            builder = cls.backend_cls.get_builder_cls()(compressed_spec, [compressed_prefix], cfg, torch.device(device))
            check = guard_buffers(builder) if guard_compressed else None
            metadata[compressed_prefix] = builder.build(0, compressed_common)
            found += check(metadata[compressed_prefix]) if check else []
    return metadata


def forward_mqa(cfg, layer, metadata: dict, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The layer's attention on the step, DeepseekV4FlashMLAAttention.forward_mqa (its decode and prefill routes), in
    the forward context the runner sets, into an output filled with NaN (rows it does not write stay NaN)."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    with set_current_vllm_config(cfg), torch.inference_mode(), set_forward_context(metadata, cfg):
        out = torch.full_like(q, float("nan"))
        layer.forward_mqa(q, None, positions, out)
    return out


def saved_step(T: dict, num_actual_tokens: int):
    """A reproducer's step from its saved tensors: the runner's CommonAttentionMetadata of each KV-cache group (SWA,
    compressed: None where the layer has no compressed cache), the two raw caches as the model left them before
    attention, and a copy of each to compare with after the call."""
    swa, compressed = (None if f"{group}.block_table" not in T else
                       common_metadata(T["query_start_loc"], T["seq_lens"], T[f"{group}.block_table"],
                                       T[f"{group}.slot_mapping"], T["positions"], num_actual_tokens)
                       for group in ("swa", "compressed"))
    caches = [T["swa_pages"], T.get("compressed_pages")]
    return swa, compressed, caches, [None if c is None else c.clone() for c in caches]
