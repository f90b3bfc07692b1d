"""vLLM's STEP5_DSA backend (Step5's GQA + DSA attention, `vllm/models/step5/nvidia/`) set up and driven without a
model, as its layer drives it: the calls `vllm.step5_dsa` makes, written once for its run() and its reproducers.
torch and vLLM only (plus attnfuzz's stand-in modules where the host lacks a compiled kernel).

What a Step5 DSA layer (`Step5Attention` with `Step5SparseAttention`, models/step5/nvidia/model.py) holds and hands
the backend, made here as the model makes it: the impl (`Step5DSAAttentionImpl`, through the backend's
`get_impl_cls()`, with the sparse_config fields it reads), the CSA tail ring layer (`Step5CSATailRing`, the real
class, bound to its own cache of one KV page per block) set on the impl as `csa_ring`, the region-summary layer
(`Step5SparseSummaryCacheLayer`, real, whose `bind_kv_cache` sets the impl's `summary_cache`), and the layer object
the builder looks up in the forward context (its impl, its packed KV cache, `_k_scale`/`_v_scale`). Per step: the
backend's `Step5DSAMetadataBuilder.build` and the ring's `Step5CSATailRingMetadataBuilder.build` (its Triton
`_ring_metadata_kernel`) from one CommonAttentionMetadata, then `impl.forward` under a forward context holding both,
with the indexer's outputs as the model's `qkv_indexer_norm_rope` hands them (fp8 queries [tokens, groups, 8, 256]
group-major, fp32 weights, the key [tokens, 1, 256] and z [tokens, 1, 256]) and the headwise gate.

On a CPU host: vLLM's `vllm/models/step5/__init__.py` imports the VL model (`nvidia/vl.py` -> `step3_vl` ->
torchvision), which this venv lacks, so the package is made importable without running its `__init__` (its nvidia
modules are imported directly); the backend's modules see an SM90 platform (the impl refuses to construct without
SM90/SM100) and a CUDA-less torch's answers for device index, capability and SM count; Triton's interpreter gets
libdevice's `exp` (which it does not implement). Everything else is vLLM's, the Triton kernels interpreted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import os
import pathlib
import sys
import types
from types import SimpleNamespace

import torch

from fuzzer.support.standins import flashinfer_step5, indexer_ops
from fuzzer.support.vllm_calls import implemented, named_keywords

PACKAGE = "vllm.models.step5"
SPARSE_MODULE = "vllm.models.step5.nvidia.sparse_attention"
ADAPTER_MODULE = "vllm.models.step5.nvidia.flashinfer_sparse"
# 0.34 moved the tail ring and the summary cache from nvidia/ to common/: the first that imports is this release's
RING_MODULES = ("vllm.models.step5.nvidia.csa_tail_ring", "vllm.models.step5.common.csa_tail_ring")
SUMMARY_MODULES = ("vllm.models.step5.nvidia.sparse_summary_cache", "vllm.models.step5.common.sparse_summary_cache")
TOPK_MODULE = "vllm.model_executor.layers.indexer_topk"
LAYER = "model.layers.0.self_attn.attn"
RING = LAYER + ".csa_tail_ring"
SUMMARY = LAYER + ".sparse_summary_cache"
HEAD_SIZE, PROXY_DIM = 192, 256
SCALE = HEAD_SIZE ** -0.5
MAX_MODEL_LEN = 1 << 20  # the impl's region capacity (max_model_len / 8) is past any case's context
H100_SMS = 132


def import_package() -> list[str]:
    """Import Step5's backend modules; where `vllm.models.step5`'s `__init__` cannot import (it pulls in the VL model,
    which needs torchvision), make the package importable without it. Returns what was done, in words."""
    try:
        importlib.import_module(PACKAGE)
        return []
    except Exception as e:  # noqa: BLE001 (any import failure of the package's __init__: say which)
        if PACKAGE in sys.modules and getattr(sys.modules[PACKAGE], "__path__", None) and \
                getattr(sys.modules[PACKAGE], "_attnfuzz_bare", False):
            return [_bare_note(e)]
        import vllm

        package = types.ModuleType(PACKAGE)
        package.__path__ = [str(pathlib.Path(vllm.__file__).parent / "models" / "step5")]
        package._attnfuzz_bare = True
        sys.modules[PACKAGE] = package
        return [_bare_note(e)]


def import_moved(names: tuple[str, ...]):
    """The first of `names` (one module where releases keep it) that this release has."""
    for name in names[:-1]:
        if importlib.util.find_spec(name) is not None:
            return importlib.import_module(name)
    return importlib.import_module(names[-1])


def _bare_note(e: Exception) -> str:
    return (f"vllm.models.step5 imported without its __init__ ({type(e).__name__}: {e}: it imports the Step5 VL "
            "model's processor, which needs torchvision); the backend's nvidia modules are imported directly")


class Sm90Platform:
    """vLLM's platform as an H100/H200 answers what Step5's backend asks: compute capability 9.0 (the impl refuses
    anything but SM90/SM100/SM103), no PDL launch attribute (`is_arch_support_pdl`, read at import on real GPUs), the
    host's device type. Everything else is the host's own platform's answer."""

    device_type = "cpu"

    def __init__(self, platform):
        self._platform = platform

    def __getattr__(self, name):
        return getattr(self._platform, name)

    def get_device_capability(self, device_id: int = 0):
        from vllm.platforms.interface import DeviceCapability

        return DeviceCapability(9, 0)

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        return capability == 90

    def is_arch_support_pdl(self) -> bool:
        return False


class _NoEvent:
    """torch.cuda.Event on a host without CUDA: the prefill plan's ordering event (nothing runs asynchronously)."""

    def record(self, *args) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _cpu_torch() -> SimpleNamespace:
    """torch as Step5's modules see it on a CPU: the accelerator's device index 0, an SM90 capability and an H100's
    SM count, no graph capture, CUDA events that order nothing (a CPU build of torch raises on each)."""
    cuda = SimpleNamespace(**{**vars(torch.cuda), "get_device_capability": lambda device=None: (9, 0),
                              "get_device_properties": lambda device=None: SimpleNamespace(
                                  multi_processor_count=H100_SMS),
                              "Event": _NoEvent, "is_current_stream_capturing": lambda: False,
                              "current_stream": lambda device=None: None})
    accelerator = SimpleNamespace(**{**vars(torch.accelerator), "current_device_index": lambda: 0})
    return SimpleNamespace(**{**vars(torch), "cuda": cuda, "accelerator": accelerator})


def _interpreted_libdevice() -> str:
    """Triton's interpreter implements `tl.math` but not libdevice (`tl.extra.cuda.libdevice`, which 0.33's kernels
    call, and the backend-neutral `tl.extra.libdevice`, vLLM's `tldevice` in 0.34; their calls raise or return
    None): their `exp` (fp32 `__nv_expf`, what Step5's summary update and headwise gate call) becomes `tl.exp`,
    numpy's fp32 exp under the interpreter."""
    import triton.language as tl
    from triton.language.extra import libdevice as neutral
    from triton.language.extra.cuda import libdevice

    def exp(arg0, _semantic=None):
        return tl.exp(arg0)

    exp._attnfuzz = True
    for module in (libdevice, neutral):
        if not getattr(module.exp, "_attnfuzz", False):
            module.exp = exp
    return ("triton interpreter: libdevice's exp (tl.extra.cuda.libdevice, tl.extra.libdevice) as tl.exp (numpy's "
            "fp32 exp; the interpreter has no libdevice)")


def _has_op(namespace: str, name: str) -> bool:
    try:
        return hasattr(getattr(torch.ops, namespace), name)
    except Exception:  # noqa: BLE001 (an op library that cannot load: no op)
        return False


@functools.cache
def real_flashinfer(device: str) -> str | None:
    """FlashInfer's version where its own prefill wrappers and `attn_scores` import (a GPU host with
    ATTNFUZZ_FLASHINFER=real after scripts/gpu-flashinfer.sh install), unless ATTNFUZZ_STANDIN_OPS=1; None: the
    import stand-in (flashinfer_step5)."""
    if device != "cuda" or os.environ.get("ATTNFUZZ_STANDIN_OPS") == "1":
        return None
    try:
        import flashinfer
        from flashinfer import BatchPrefillWithRaggedKVCacheWrapper  # noqa: F401
        from flashinfer.attn_scores import fp8_paged_mqa_logits  # noqa: F401
    except Exception:  # noqa: BLE001 (absent or broken: the stand-in, named as such)
        return None
    return getattr(flashinfer, "__version__", "?")


@functools.cache
def prepare_host(device: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Import Step5's backend and bind what this host lacks: (emulated kernels, shims), in words. Once a process."""
    shims = import_package()
    sparse = importlib.import_module(SPARSE_MODULE)
    adapter = importlib.import_module(ADAPTER_MODULE)
    topk = importlib.import_module(TOPK_MODULE)
    for names in (RING_MODULES, SUMMARY_MODULES):  # imported before any case (path probes wrap what is imported)
        import_moved(names)
    emulated: list[str] = []
    if device == "cpu":
        sparse.current_platform = Sm90Platform(sparse.current_platform)
        sparse.torch = adapter.torch = _cpu_torch()
        shims += ["sparse_attention.current_platform: compute capability 9.0 (Sm90Platform; the host is a CPU)",
                  (f"sparse_attention/flashinfer_sparse torch: device index 0, capability (9, 0), {H100_SMS} SMs, "
                   "no graph capture, CUDA events that order nothing (a CPU build of torch raises on each)"),
                  _interpreted_libdevice()]
    force = os.environ.get("ATTNFUZZ_STANDIN_OPS") == "1"
    if force or device == "cpu" or not _has_op("_C", "top_k_per_row_decode"):
        # select_regions' per_row top-k (indexer_topk binds vLLM's _custom_ops as `ops`)
        topk.ops = SimpleNamespace(**{**vars(topk.ops), "top_k_per_row_decode": indexer_ops.top_k_per_row_decode})
        emulated.append("top_k_per_row_decode (torch.ops._C: the per_row top-k select_regions asks for)")
    if not real_flashinfer(device):
        emulated.append("FlashInfer's BatchPrefillWith{Ragged,Paged}KVCacheWrapper and flashinfer.attn_scores, as "
                        "imports only (flashinfer_step5: constructed, never called on the decode route; plan/run refused)")
    return tuple(emulated), tuple(shims)


def vllm_config(cfg, max_num_batched_tokens: int, block_size: int, heads: int):
    """The shared VllmConfig's fields a Step5 step sets: the scheduler's token budget (the ring builder's buffers),
    the cache's block size, the rank's query heads (FlashAttention's builder sizes its scheduler metadata by them),
    vLLM's default indexer top-k backend (an indexer case before it in the process may have left cooperative or
    persistent, which Step5 refuses), no speculative decoding, an empty forward context for this engine's layers."""
    cfg.scheduler_config.max_num_batched_tokens = max_num_batched_tokens
    cfg.kernel_config.sparse_indexer_topk_backend = "auto"
    cfg.model_config.get_num_attention_heads = lambda parallel_config=None: heads
    cfg.cache_config.block_size = block_size
    cfg.speculative_config = None
    context = cfg.compilation_config.static_forward_context
    for name in (LAYER, RING, SUMMARY):
        context.pop(name, None)
    return cfg


def kv_cache_spec(groups: int, block_size: int, kv_cache_dtype: str):
    """The layer's spec (`Attention.get_kv_cache_spec` for this backend, customized by it: block strides in
    multiples of 8): full attention, `groups` KV heads of 192, bf16 or a uint8 fp8 cache."""
    from vllm.v1.attention.backend import AttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    backend = importlib.import_module(SPARSE_MODULE).Step5DSAAttentionBackend
    dtype = torch.uint8 if kv_cache_dtype == "fp8" else torch.bfloat16
    # The backend's own customize_spec: AttentionBackend's (the spec as it is) answering for it would be another call.
    return implemented(backend, "customize_spec", below=AttentionBackend)(FullAttentionSpec(block_size=block_size, num_kv_heads=groups, head_size=HEAD_SIZE,
                                                    dtype=dtype))


def engine(cfg, spec, heads: int, groups: int, kv_cache_dtype: str, topk: int, index_heads: int,
           kv_cache: torch.Tensor, ring_cache: torch.Tensor, summary_cache: torch.Tensor, k_scale: float,
           v_scale: float, device: str):
    """(impl, layer, ring, builder, ring builder), made as the model makes them (Step5Attention.__init__): the impl
    through the backend with the layer's sparse arguments (sparse_config's topk, sparse_indexer_num_heads and
    index_tp_size: one index TP rank per KV head, `index_heads` a group), in the model's default dtype (bf16); the
    tail ring and summary layers registered in the forward context and bound to their caches; the builders as the
    runner makes them for the layer's KV-cache group and the ring's."""
    from vllm.config import set_current_vllm_config

    sparse = importlib.import_module(SPARSE_MODULE)
    ring_mod, summary_mod = import_moved(RING_MODULES), import_moved(SUMMARY_MODULES)
    context = cfg.compilation_config.static_forward_context
    sparse_config = SimpleNamespace(topk=topk, sparse_indexer_num_heads=index_heads * groups, index_tp_size=groups)
    dtype = torch.get_default_dtype()
    standin = flashinfer_step5.importable() if not real_flashinfer(device) else contextlib.nullcontext()
    with standin, set_current_vllm_config(cfg):
        torch.set_default_dtype(torch.bfloat16)  # the model's dtype: the impl checks its activations are bf16
        try:
            impl_cls = sparse.Step5DSAAttentionBackend.get_impl_cls()
            impl = impl_cls(heads, HEAD_SIZE, SCALE, groups, None, None, kv_cache_dtype, None, "decoder", None,
                            **named_keywords(impl_cls, impl_cls.__name__, sparse_config=sparse_config,
                                             max_model_len=MAX_MODEL_LEN, max_num_seqs=256))
        finally:
            torch.set_default_dtype(dtype)
        layer = SimpleNamespace(impl=impl, kv_cache=kv_cache, layer_name=LAYER,
                                _k_scale=torch.tensor(k_scale, dtype=torch.float32, device=device),
                                _v_scale=torch.tensor(v_scale, dtype=torch.float32, device=device),
                                get_kv_cache_spec=lambda vllm_config: spec)
        context[LAYER] = layer
        ring = ring_mod.Step5CSATailRing(prefix=RING, main_layer_name=LAYER, num_speculative_tokens=0,
                                         static_forward_context=context)
        ring_spec = ring.get_kv_cache_spec(cfg)
        ring.bind_kv_cache(ring_cache)
        impl.csa_ring = ring
        summaries = summary_mod.Step5SparseSummaryCacheLayer(prefix=SUMMARY, target_impl=impl,
                                                             static_forward_context=context)
        summaries.bind_kv_cache(summary_cache)
        builder = sparse.Step5DSAMetadataBuilder(spec, [LAYER], cfg, torch.device(device))
        ring_builder = ring_mod.Step5CSATailRingMetadataBuilder(ring_spec, [RING], cfg, torch.device(device))
    return impl, layer, ring, builder, ring_builder


def ring_page_elements(groups: int, block_size: int) -> int:
    """bf16 elements of one ring page: the ring shares the main KV page's size (groups x block x 384 bf16 here)."""
    return groups * block_size * 2 * HEAD_SIZE


def common_metadata(query_start_loc, seq_lens, block_table, slot_mapping, positions, max_seq_len: int):
    """vLLM's CommonAttentionMetadata for a decode step of one token a request, with its positions (the ring
    builder's kernel reads them)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    n = int(seq_lens.shape[0])
    values = {"query_start_loc": query_start_loc, "query_start_loc_cpu": query_start_loc.cpu(), "seq_lens": seq_lens,
              "seq_lens_cpu": seq_lens.cpu(), "seq_lens_cpu_upper_bound": seq_lens.cpu(),
              "num_computed_tokens_cpu": (seq_lens - 1).clamp(min=0).cpu(), "num_reqs": n, "num_actual_tokens": n,
              "max_query_len": 1, "max_seq_len": max_seq_len, "block_table_tensor": block_table,
              "slot_mapping": slot_mapping, "positions": positions}
    names = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    return CommonAttentionMetadata(**{k: v for k, v in values.items() if k in names})


def decode_step(cfg, impl, layer, builder, ring_builder, common, query, proxy_query, proxy_key, proxy_weights,
                proxy_z, gate, defer_inactive_clear: bool):
    """One decode step as the model runs it: both builders' metadata from the step's CommonAttentionMetadata, then
    the impl's forward (Step5SparseAttention._forward_dsa_attention -> step5_dsa_attention_with_output) under a
    forward context holding them. `proxy_query`/`proxy_weights` are group-major ([groups, tokens, ...]) and handed
    over transposed, as `qkv_indexer_norm_rope` returns them. Returns (output [tokens, heads, 192] bf16, the
    regions each (token, group) row selected: int64 [rows, min(topk, regions) + 1], as the adapter returned them)."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    selected: list[torch.Tensor] = []
    adapter = impl.adapter
    select = adapter.select_regions

    def record(*args, **kwargs):  # the adapter's own selection, kept (a copy) for the oracle
        regions = select(*args, **kwargs)
        selected.append(regions.clone())
        return regions

    output = torch.full(query.shape, float("nan"), dtype=query.dtype, device=query.device)
    with set_current_vllm_config(cfg):
        metadata = builder.build(0, common)
        ring_metadata = ring_builder.build(0, common)
        adapter.select_regions = record
        try:
            with set_forward_context({LAYER: metadata, RING: ring_metadata}, cfg), torch.inference_mode():
                impl.forward(layer, query, None, None, layer.kv_cache, metadata, output,
                             dsa_proxy_query=proxy_query.transpose(0, 1), dsa_proxy_key=proxy_key,
                             dsa_proxy_weights=proxy_weights.transpose(0, 1), dsa_proxy_z=proxy_z,
                             defer_inactive_clear=defer_inactive_clear, dsa_gate=gate)
        finally:
            del adapter.select_regions  # the class's method again
    return output, (selected[0] if selected else None)
