"""Setting vLLM up to run DeepSeek-V4's and V4.1's ROCm sparse attention without a model or an AMD GPU:
ROCM_FLASHMLA_SPARSE_DSV4 (`DeepseekV4ROCMAiterMLAAttention` of vllm/models/deepseek_v4/amd/rocm.py, backend
`DeepseekV4ROCMAiterMLASparseBackend`) and ROCM_FLASHMLA_SPARSE_DSV41 (`DeepseekV41ROCMAiterMLAAttention` of
vllm/models/deepseek_v41/amd/rocm.py).

The layer reads V4's 584-byte fp8_ds_mla record in both caches (`use_fp8_ds_mla_layout`: every --kv-cache-dtype the
backend takes, auto, fp8 and fp8_ds_mla, resolves to it) through vLLM's own Triton kernels
(vllm/v1/attention/ops/rocm_aiter_mla_sparse.py: the split-K sparse decode with the inverse RoPE fused into its
reduce, the sparse prefill over the gathered bf16 workspace; the ROCm builders' ragged SWA and C128A indices), and
hands `forward_mqa`'s output on inverse-RoPE'd (the rows the decode reduce did not rotate get
`rocm_inverse_rope_rows_`), so the rotation is part of the step. With vLLM's defaults (VLLM_ROCM_USE_AITER and
VLLM_ROCM_USE_AITER_TRITON_SPARSE_MLA off) none of AITER's kernels is on this route: nothing is stood in for.

What an AMD host answers that this one cannot, each named in every result's shims (`PLATFORM_NOTE`, `ARCH_NOTE`):
vLLM's platform is not ROCm here, so nothing of vLLM would pick the backend; the layer is built as a gfx950 (MI355X)
host builds it. `vllm.platforms.rocm` is imported with the device's arch answered gfx950
(rocm_aiter_sparse_runtime's import), and for the span of the step's calls (`emulated_arch`) the modules that read
the arch by value (the ops module's `_ON_GFX942`/`_ON_GFX950`, set at its import from `current_platform.is_rocm()`,
which is False here; V4's and V4.1's layer modules' `_ON_GFX950`) and the SWA backend's platform test
(`DeepseekSparseSWABackend.get_builder_cls`: `current_platform.is_rocm()` picks the ROCm SWA builder) answer as that
host's. The ops module's three Triton launchers assert their tensors are not on the CPU (`not q.is_cpu ...`): on a
CPU they run as copies compiled from vLLM's source with those asserts (and nothing else) taken out
(`cpu_launchers`).

gfx942 (MI300X) is reachable on supported hardware too, but its SWA cache holds FNUZ e4m3 (the ROCm fused insert
writes FNUZ there, and the decode and the gather read it with IS_FNUZ_MAIN / use_fnuz), which neither attnfuzz's
cache writer nor Triton's interpreter corrections (fp8e4b8) model: not driven (`ARCHS`).
torch and vLLM only (plus attnfuzz's support modules).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import inspect
import linecache
import textwrap
from types import SimpleNamespace

import torch

from fuzzer.support import dsv4_runtime, dsv41_runtime
from fuzzer.support.cpu_host import prepare_cpu_host_for
from fuzzer.support.interp.corrections import correct_floats, correct_index_scalar
from fuzzer.support.vllm_setup import define_missing_c_queries
from fuzzer.support.rocm_aiter_sparse_runtime import _import_rocm_platform

LAYER_MODULES = {"4": "vllm.models.deepseek_v4.amd.rocm", "4.1": "vllm.models.deepseek_v41.amd.rocm"}
LAYER_CLASSES = {"4": "DeepseekV4ROCMAiterMLAAttention", "4.1": "DeepseekV41ROCMAiterMLAAttention"}
OPS_MODULE = "vllm.v1.attention.ops.rocm_aiter_mla_sparse"
SWA_MODULE = dsv4_runtime.SWA_MODULE
ROPE_MODULES = {"4": "vllm.models.deepseek_v4.common.rope", "4.1": "vllm.models.deepseek_v41.common.rope"}
# DeepSeek-V4's RoPE fields (its config.json; vLLM's DeepseekV4Config reads them so), for a config without them
ROPE_CONFIG = dict(rope_theta=10000.0, compress_rope_theta=160000.0,
                   rope_parameters={"main": {"rope_type": "default", "rope_theta": 10000.0},
                                    "compress": {"rope_type": "default", "rope_theta": 160000.0}})
# The archs the target can emulate: their (gfx942, gfx950, gfx1250) flags as vLLM's modules read them. gfx950
# (MI355X); gfx1201 (RDNA4) and gfx1250 are the un-tuned archs whose decode takes the ops module's fallback kernel
# (both write OCP e4m3 caches, as gfx950 does).
ARCHS = {"gfx950": (False, True, False), "gfx1201": (False, False, False), "gfx1250": (False, False, True)}
DEFAULT_ARCH = "gfx950"
# The ops module's launchers whose CPU-tensor asserts are taken out on a CPU (see the module docstring).
CPU_LAUNCHERS = ("_rocm_sparse_attn_decode_ragged_triton", "_rocm_sparse_attn_prefill_ragged_triton",
                 "_rocm_sparse_attn_decode_ragged_bf16_triton")
PLATFORM_NOTE = ("vLLM's platform is not ROCm here, so nothing of vLLM would pick ROCM_FLASHMLA_SPARSE_DSV4/_DSV41: "
                 "the layer is built as a gfx950 (MI355X) host builds it; vllm.platforms.rocm imported with the device "
                 "arch answered 'gfx950'; VLLM_ROCM_USE_AITER and VLLM_ROCM_USE_AITER_TRITON_SPARSE_MLA at vLLM's "
                 "default (off): no AITER kernel on the route")
ARCH_NOTE = ("for the step's calls, the arch vLLM's modules read by value answered as the case's (Dsv4.rocm_arch; "
             "gfx950: _ON_GFX950=True, the others False): the ops module's _ON_GFX942/_ON_GFX950 (set at its import "
             "from current_platform.is_rocm(), False here), the DSv4/DSv4.1 ROCm layer modules' _ON_GFX950, "
             "vllm.platforms.rocm's _ON_GFX942/_ON_GFX950/_ON_GFX1250 (on_gfx1250()), and sparse_swa's "
             "current_platform.is_rocm()=True (DeepseekSparseSWABackend.get_builder_cls picks the ROCm SWA builder)")
CPU_NOTE = ("CPU only: the ops module's Triton launchers (" + ", ".join(CPU_LAUNCHERS) + ") compiled from vLLM's "
            "source without their `assert not q.is_cpu ...` device asserts, nothing else changed")


def layer_class(version: str = "4"):
    """vLLM's ROCm DeepSeek-V4 (`version` "4") or V4.1 ("4.1") attention layer class, its module imported as a
    gfx950 host imports it."""
    _import_rocm_platform()
    return getattr(importlib.import_module(LAYER_MODULES[version]), LAYER_CLASSES[version])


def _is_cpu_assert(node: ast.stmt) -> bool:
    return isinstance(node, ast.Assert) and any(isinstance(n, ast.Attribute) and n.attr == "is_cpu"
                                                for n in ast.walk(node.test))


def _without_cpu_asserts(module, name: str):
    """`module.name` compiled anew in the module's namespace from vLLM's source, its top-level asserts on
    `.is_cpu` removed (and nothing else)."""
    fn = getattr(module, name)
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    body = tree.body[0].body
    kept = [s for s in body if not _is_cpu_assert(s)]
    if len(kept) == len(body):
        raise RuntimeError(f"{module.__name__}.{name}: no `.is_cpu` assert where attnfuzz expects one")
    tree.body[0].body = kept
    src = ast.unparse(tree)
    filename = f"<attnfuzz: {module.__name__}.{name} without its CPU-tensor asserts>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    scope = vars(module)  # defined where its callers look it up, with the module's globals
    exec(compile(src, filename, "exec"), scope)
    return scope[name]


@functools.cache
def cpu_launchers() -> tuple[str, ...]:
    """On a CPU: the ops module's launchers without their device asserts (module docstring). Once a process."""
    ops = importlib.import_module(OPS_MODULE)
    for name in CPU_LAUNCHERS:
        _without_cpu_asserts(ops, name)
    return (CPU_NOTE,)


# The interpreter corrections the route's Triton kernels need: fp8 records dequantized, bf16 arithmetic and casts, tl.dot
# of bf16, scalar index ranges; no NVFP4 writer (its inline asm) is on the route.
CORRECTIONS = (correct_floats, correct_index_scalar)


def prepare_host(device: str, version: str = "4",
                 corrections: tuple = CORRECTIONS) -> tuple[list[str], tuple[str, ...]]:
    """What this host needs before the layer's calls: (shims, ops stood in for: none). The capability queries
    ModelConfig makes of a `_C` this build may lack; on a CPU, Triton's interpreter corrected by `corrections` (a
    campaign: every correction, EVERY), the accelerator plumbing shimmed and the launchers' device
    asserts taken out; vLLM's ROCm modules imported as a gfx950 host imports them."""
    layer_class(version)
    shims = list(define_missing_c_queries())
    if device == "cpu":
        shims += [*prepare_cpu_host_for(*corrections), *dsv4_runtime.cpu_shims(), *cpu_launchers()]
    return [*shims, PLATFORM_NOTE, ARCH_NOTE], ()


class _RocmPlatform:
    """sparse_swa's current_platform, answering is_rocm() as an AMD host's (and is_cpu() False)."""

    def __init__(self, platform):
        self._platform = platform

    def is_rocm(self) -> bool:
        return True

    def is_cpu(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._platform, name)


@contextlib.contextmanager
def emulated_arch(arch: str = DEFAULT_ARCH):
    """Inside the block, vLLM's modules that read the device's arch by value answer as `arch`'s host (ARCH_NOTE);
    after it, what they held before."""
    gfx942, gfx950, gfx1250 = ARCHS[arch]
    ops = importlib.import_module(OPS_MODULE)
    swa = importlib.import_module(SWA_MODULE)
    platform = importlib.import_module("vllm.platforms.rocm")
    layers = [importlib.import_module(m) for m in LAYER_MODULES.values()]
    saved = [(ops, "_ON_GFX942", gfx942), (ops, "_ON_GFX950", gfx950),
             *((m, "_ON_GFX950", gfx950) for m in layers),
             (platform, "_ON_GFX942", gfx942), (platform, "_ON_GFX950", gfx950), (platform, "_ON_GFX1250", gfx1250),
             (swa, "current_platform", _RocmPlatform(swa.current_platform))]
    before = [(m, name, getattr(m, name)) for m, name, _ in saved]
    for m, name, value in saved:
        setattr(m, name, value)
    try:
        yield
    finally:
        for m, name, value in before:
            setattr(m, name, value)


def rotary_emb(cfg, compress_ratio: int, version: str = "4"):
    """The layer's rotary embedding as its __init__ makes it (vLLM's `build_deepseek_v4_rope` of the model's
    version, on the model's config): forward_mqa reads its cos_sin_cache for the inverse RoPE."""
    from vllm.config import set_current_vllm_config

    hf = cfg.model_config.hf_config
    if getattr(hf, "rope_parameters", None) is None:  # V4.1's tiny config names no RoPE: DeepSeek-V4's own
        hf = SimpleNamespace(**ROPE_CONFIG, max_position_embeddings=hf.max_position_embeddings)
    build = importlib.import_module(ROPE_MODULES[version]).build_deepseek_v4_rope
    with set_current_vllm_config(cfg):
        rope = build(hf, head_dim=dsv4_runtime.HEAD_DIM, rope_head_dim=dsv4_runtime.ROPE_DIM,
                     max_position_embeddings=hf.max_position_embeddings, compress_ratio=compress_ratio)
    return rope.to(cfg.device_config.device)


def _rocm_attributes(layer, cfg, version: str, num_heads: int) -> None:
    """What the ROCm layer's __init__ (over DeepseekV4Attention's) sets that its forward_mqa reads: the rank's heads,
    the NoPE/RoPE split, the resolved cache dtype (fp8_ds_mla for every name the backend takes), the RoPE, no KV
    connector, no fp8 wo_a (the BF16 path: forward_mqa owes the inverse RoPE), AITER's sparse MLA (and its prefill) off."""
    base = type(layer).__mro__[1]  # DeepseekV4Attention of V4's or V4.1's attention.py
    resolve = importlib.import_module(base.__module__)._resolve_dsv4_kv_cache_dtype
    layer.kv_cache_dtype, layer.kv_cache_torch_dtype = resolve(True, cfg.cache_config.cache_dtype, None)
    layer.n_local_heads = num_heads
    layer.rope_head_dim = dsv4_runtime.ROPE_DIM
    layer.nope_head_dim = dsv4_runtime.HEAD_DIM - dsv4_runtime.ROPE_DIM
    layer.rotary_emb = rotary_emb(cfg, layer.compress_ratio, version)
    layer._has_kv_transfer = False
    layer._wo_a_fp8_weight = None
    layer._use_aiter_sparse_mla = False
    layer._use_aiter_sparse_mla_decode = layer._use_aiter_sparse_mla_prefill = False  # 0.34's two names for it


# -- the step's calls, as the target makes them and its reproducers show them ------------------------------------

def step_layer(cfg, compress_ratio: int, window_size: int, swa_block_size: int, entries_per_block: int,
               swa_pages: torch.Tensor, compressed_pages: torch.Tensor | None, topk_indices_buffer: torch.Tensor,
               attn_sink: torch.Tensor, num_heads: int):
    """vLLM's objects for a DeepSeek-V4 step on the ROCm layer: its SWA cache (DeepseekV4SWACache; the layer names
    no SWA backend, so the cache's is DeepseekSparseSWABackend, whose builder on a ROCm host is the ROCm one) and
    compressed K cache with their raw 584-byte-record pages bound as the runner binds them, and the layer made
    without its __init__ (dsv4_runtime.attention_layer, then `_rocm_attributes`). Returns (layer, the compressed
    cache's spec or None, its KV-cache group's prefix)."""
    cls = layer_class("4")
    swa_layer = dsv4_runtime.swa_cache_layer(cfg, window_size, swa_block_size, layer_module=LAYER_MODULES["4"],
                                             layer_class=LAYER_CLASSES["4"])
    swa_layer.kv_cache = dsv4_runtime.paged(swa_pages, swa_block_size)
    spec = kv_cache = None
    if compressed_pages is not None:
        spec, kv_cache = (dsv4_runtime.compressed_spec(compress_ratio),
                          dsv4_runtime.paged(compressed_pages, entries_per_block))
    layer = dsv4_runtime.attention_layer(cfg, compress_ratio, swa_layer, kv_cache, topk_indices_buffer, attn_sink,
                                         cls=cls)
    _rocm_attributes(layer, cfg, "4", num_heads)
    return layer, spec, dsv4_runtime.LAYER


def step_layer_v41(cfg, compress_ratio: int, kv_source: str, window_size: int, swa_block_size: int, kv_record: int,
                   compressed_block_size: int, entries_per_block: int, swa_pages: torch.Tensor,
                   compressed_pages: torch.Tensor | None, topk_indices_buffer: torch.Tensor, attn_sink: torch.Tensor,
                   num_heads: int):
    """vLLM's objects for a DeepSeek-V4.1 step on the ROCm layer (DeepseekV41ROCMAiterMLAAttention, its SWA
    backend DeepseekV41ROCMAiterSparseSWABackend): V4.1's SWA cache and the compressed K cache of its kv source
    (584-byte records: V4.1 writes the MXFP8 record on SM100 only), the layer and a consumer's kv (and index) source
    made without __init__ (dsv41_runtime.attention_layers), then what the ROCm __init__ adds (`_rocm_attributes`,
    the index source's prefix and the per-ratio ragged top-k caches). Returns (layer, the compressed cache's spec or
    None, its KV-cache group's prefix: the kv source's)."""
    cls = layer_class("4.1")
    layer_id, source_id = dsv41_runtime.layer_ids(compress_ratio, kv_source)
    swa_layer = dsv41_runtime.swa_cache_layer(cfg, layer_id, window_size, swa_block_size, kv_record,
                                              layer_module=LAYER_MODULES["4.1"], layer_class=LAYER_CLASSES["4.1"])
    swa_layer.kv_cache = dsv41_runtime.paged(swa_pages, swa_block_size, kv_record)
    spec = kv_cache = None
    if compressed_pages is not None:
        spec = dsv41_runtime.compressed_spec(compress_ratio, compressed_block_size, kv_record)
        kv_cache = dsv41_runtime.paged(compressed_pages, entries_per_block, kv_record)
    layer = dsv41_runtime.attention_layers(cfg, compress_ratio, kv_source, swa_layer, kv_cache, topk_indices_buffer,
                                           attn_sink, num_heads, cls=cls)
    _rocm_attributes(layer, cfg, "4.1", num_heads)
    context = cfg.compilation_config.static_forward_context
    for each in {layer, *(context[p] for p in [layer.compressed_cache_prefix] if p)}:
        each._topk_ragged_cache, each._prefill_topk_ragged_cache = {}, {}
    # the index source is the kv source in V4.1's config (index_source_layer_ids == kv_source_layer_ids)
    layer._index_source_prefix = None if source_id is None else dsv41_runtime.layer_prefix(source_id)
    return layer, spec, None if source_id is None else dsv41_runtime.layer_prefix(source_id)


def build_metadata(cfg, layer, swa_common, compressed_spec, compressed_prefix, compressed_common, device: str,
                   found: list, guard_compressed: bool = True, arch: str = DEFAULT_ARCH) -> dict:
    """dsv4_runtime.build_metadata (each KV-cache group's builder, its buffers guarded) on the emulated arch."""
    with emulated_arch(arch):
        return dsv4_runtime.build_metadata(cfg, layer, swa_common, compressed_spec, compressed_prefix,
                                           compressed_common, device, found, guard_compressed)


def forward_mqa(cfg, layer, metadata: dict, q: torch.Tensor, positions: torch.Tensor,
                arch: str = DEFAULT_ARCH) -> torch.Tensor:
    """The layer's forward_mqa on the step (dsv4_runtime.forward_mqa: the runner's forward context, an output of
    NaN) on the emulated arch: its decode and prefill routes, then the inverse RoPE it owes."""
    with emulated_arch(arch):
        return dsv4_runtime.forward_mqa(cfg, layer, metadata, q, positions)
