"""DeepSeek-V3.2 / GLM-5's lightning indexer driven for one step as vLLM's model runner drives it, without a model:
the calls `vllm.indexer` makes, written once for its run() and the reproducers that show them. torch and vLLM only
(plus attnfuzz's stand-in modules where the host lacks a compiled kernel).

The route is the CUDA one (`SparseAttnIndexer.forward_cuda` -> the `sparse_attn_indexer` op): the index K-cache
write, the prefill gather and DeepGEMM's logits, the decode's paged logits, the top-k kernels, the DCP merge. On
a CPU host the indexer's modules are shown an SM90 CUDA platform (`Sm90View`) so they take the route an H200 takes,
and every compiled kernel is a bounds-checked stand-in."""

from __future__ import annotations

import contextlib
import functools
import importlib
from types import SimpleNamespace

import torch

from fuzzer.support.vllm_setup import configure, has_op, mtp_speculative_config, vllm_runtime
from fuzzer.support.standins import dcp_indexer as dcp_indexer_standin
from fuzzer.support.standins import deep_gemm as deep_gemm_standin
from fuzzer.support.standins import indexer_ops

INDEXER_MODULE = "vllm.model_executor.layers.sparse_attn_indexer"
BUILDER_MODULE = "vllm.v1.attention.backends.mla.indexer"
TOPK_MODULE = "vllm.model_executor.layers.indexer_topk"
DEEP_GEMM_MODULE = "vllm.utils.deep_gemm"
ATTENTION_MODULE = "vllm.models.deepseek_v32.attention"
PREFIX = "model.layers.0.self_attn.indexer"  # the k-cache layer is PREFIX + ".k_cache", as the model names it
HEAD_DIM, QUANT_BLOCK = 128, 128  # index_head_dim; one fp32 scale per 128 values
ENTRY_BYTES = HEAD_DIM + HEAD_DIM // QUANT_BLOCK * 4  # an index-cache entry: 128 fp8 values, then its scale
Q_LORA_RANK = 64  # wq_b's input width: its weights exist but the step hands the layer q already projected
H200_SMS = 132
_DEEP_GEMM_EMULATED = False  # prepare_indexer_host bound the stand-ins in place of vLLM's DeepGEMM


class Sm90View:
    """vLLM's platform object as an H200 would answer it: CUDA, compute capability 9.0, DeepGEMM's SM90 kernels.
    Everything else (device type, dispatch key, dtypes) is the host's own platform's answer."""

    def __init__(self, platform):
        self._platform = platform

    def __getattr__(self, name):
        return getattr(self._platform, name)

    def is_cuda(self) -> bool:
        return True

    def is_cuda_alike(self) -> bool:
        return True

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        return capability == 90

    def has_device_capability(self, capability, device_id: int = 0) -> bool:
        major = capability[0] * 10 + capability[1] if isinstance(capability, tuple) else capability
        return 90 >= major

    def is_device_capability(self, capability, device_id: int = 0) -> bool:
        return capability in (90, (9, 0))

    def get_device_capability(self, device_id: int = 0):
        return SimpleNamespace(major=9, minor=0, to_int=lambda: 90, as_version_str=lambda: "9.0")

    def num_compute_units(self, device_id: int = 0) -> int:
        return H200_SMS

    def is_arch_support_pdl(self) -> bool:
        return False  # PDL is a launch attribute of the real kernels; a stand-in has none to set


def _has_real_deep_gemm() -> bool:
    try:
        deep_gemm = importlib.import_module("vllm.third_party.deep_gemm")
    except Exception:  # a CPU host, or a GPU host whose bundle lacks it: no compiled extension to load
        return False
    return all(hasattr(deep_gemm, n) for n in ("fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits",
                                                "get_paged_mqa_logits_metadata"))


CACHE_OPS = ("indexer_k_quant_and_cache", "cp_gather_indexer_k_quant_cache")
TOPK_OPS = ("top_k_per_row_prefill", "top_k_per_row_decode", "persistent_topk", "cooperative_topk")


@functools.cache
def prepare_indexer_host(device: str, force_standins: bool = False) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Bind what the indexer's CUDA route needs and this host lacks: (emulated kernels, platform overrides), in words.

    DeepGEMM's three attention functions are bound where vLLM's wrapper looks them up (`_..._impl`), so vLLM's
    own wrappers (schedule slots, the block-table clone) still run; the compiled ops through a copy of vLLM's
    `ops` namespace in each module that calls them (and torch.ops._C's top-k kernels, which indexer_topk calls
    directly, through a copy of that module's `torch`). On a CPU the modules' `current_platform` is `Sm90View`."""
    global _DEEP_GEMM_EMULATED
    indexer, builder, topk = (importlib.import_module(m) for m in (INDEXER_MODULE, BUILDER_MODULE, TOPK_MODULE))
    deep_gemm = importlib.import_module(DEEP_GEMM_MODULE)
    emulated, overrides = [], []
    if device == "cpu":
        view = Sm90View(indexer.current_platform)
        for mod in (indexer, builder, topk, deep_gemm):
            mod.current_platform = view
        builder.num_compute_units = lambda device_id=0: H200_SMS
        overrides += [f"current_platform of {', '.join(m.__name__ for m in (indexer, builder, topk, deep_gemm))}: "
                      "an SM90 CUDA platform (Sm90View; the host is a CPU)",
                      f"num_compute_units: {H200_SMS} (an H200's SMs)"]
        if hasattr(deep_gemm, "mqa_logits_use_mx_scales"):  # cached what the platform answered (0.33; 0.30 lacks it)
            deep_gemm.mqa_logits_use_mx_scales.cache_clear()
    if force_standins or device == "cpu" or not _has_real_deep_gemm():
        _DEEP_GEMM_EMULATED = True
        standin = deep_gemm_standin.standin_module()
        deep_gemm._fp8_fp4_mqa_logits_impl = standin.fp8_fp4_mqa_logits
        deep_gemm._fp8_fp4_paged_mqa_logits_impl = standin.fp8_fp4_paged_mqa_logits
        deep_gemm._get_paged_mqa_logits_metadata_impl = standin.get_paged_mqa_logits_metadata
        for mod in (indexer, builder):
            mod.has_deep_gemm = lambda: True
        emulated += ["deep_gemm.fp8_fp4_mqa_logits", "deep_gemm.fp8_fp4_paged_mqa_logits",
                     "deep_gemm.get_paged_mqa_logits_metadata"]
    missing = [n for n in CACHE_OPS if force_standins or device == "cpu" or not has_op("_C_cache_ops", n)]
    missing += [n for n in TOPK_OPS if force_standins or device == "cpu" or not has_op("_C", n)]
    if missing:
        ops = {n: getattr(indexer_ops, n) for n in missing}
        for mod in (indexer, topk):  # vLLM's _custom_ops wrappers, bound by name in each module
            mod.ops = SimpleNamespace(**{**vars(mod.ops), **{n: f for n, f in ops.items() if hasattr(mod.ops, n)}})
        direct = {n: ops[n] for n in ("persistent_topk", "cooperative_topk") if n in ops}
        if direct:  # indexer_topk calls these as torch.ops._C.<name>
            topk.torch = SimpleNamespace(**{**vars(torch), "ops": SimpleNamespace(_C=SimpleNamespace(**direct))})
        emulated += missing
    return tuple(emulated), tuple(overrides)


# The DCP merge's checks that ask for CuTe-DSL and CUDA tensors (`_assert_cutedsl_dcp_merge_supported`): a host that
# runs the merge's stand-ins has neither; the merge's other checks (fp32 logits, int32 indices, top-k 512/1024/2048)
# stay as vLLM wrote them.
_CUTEDSL_ONLY_CHECKS = ("not has_cutedsl()", "logits.device.type != 'cuda'")


def _has_real_dcp_merge() -> bool:
    try:
        module = importlib.import_module(dcp_indexer_standin.MODULE)
    except Exception:  # no CuTe-DSL (cutlass, cuda.bindings, quack): the module cannot import at all
        return False
    return not getattr(module, "__attnfuzz_standin__", False)


@functools.cache
def prepare_dcp_merge(device: str, force_standins: bool = False) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The indexer's DCP top-k merge (`_merge_dcp_topk_global`) where this host lacks its kernels (CuTe-DSL's
    module; on a CPU, CUDA tensors too): attnfuzz's stand-ins in vLLM's module's place (`standins/dcp_indexer.py`)
    and vLLM's own check function rebuilt without its two CuTe-DSL/CUDA-only tests. Returns (emulated kernels,
    overrides), in words; nothing where the host runs the real ones."""
    import ast
    import inspect
    import sys
    import textwrap

    if not force_standins and device != "cpu" and _has_real_dcp_merge():
        return (), ()
    sys.modules.pop(dcp_indexer_standin.MODULE, None)
    dcp_indexer_standin.install()
    indexer = importlib.import_module(INDEXER_MODULE)
    check = inspect.unwrap(indexer._assert_cutedsl_dcp_merge_supported)
    tree = ast.parse(textwrap.dedent(inspect.getsource(check)))

    class Drop(ast.NodeTransformer):
        def visit_If(self, node):
            return None if ast.unparse(node.test) in _CUTEDSL_ONLY_CHECKS else node

    tree = ast.fix_missing_locations(Drop().visit(tree))
    scope = dict(vars(indexer))
    exec(compile(tree, inspect.getsourcefile(check), "exec"), scope)
    indexer._assert_cutedsl_dcp_merge_supported = scope[check.__name__]
    return ((("dcp_indexer_cutedsl.pack_dcp_topk_candidates_cutedsl (vLLM's Triton pack kernel, in a module that "
              "needs CuTe-DSL to import)"), "dcp_indexer_cutedsl.stable_topk_from_gathered_candidates_cutedsl (CuTe-DSL)"),
            ("_assert_cutedsl_dcp_merge_supported without its CuTe-DSL and CUDA-tensor tests",))


def indexer_config(device: str, state_dir: str, step, max_num_batched_tokens: int):
    """vLLM's config for the step: the shared VllmConfig (vllm_setup) with the indexer's fields: index_topk,
    index_n_heads, the cache's block size, MTP's draft tokens (speculative_config) and the top-k backend."""
    cfg = configure(vllm_runtime(device, state_dir), step, max_num_batched_tokens)
    hf = cfg.model_config.hf_text_config
    hf.index_n_heads, hf.index_head_dim = step.heads, HEAD_DIM
    cfg.kernel_config.sparse_indexer_topk_backend = step.indexer.topk_backend
    cfg.speculative_config = mtp_speculative_config(step.indexer.num_speculative_tokens)
    return cfg


def indexer_layer(cfg, topk_indices_buffer: torch.Tensor, kv_cache: torch.Tensor):
    """DeepSeek-V3.2's indexer module (`DeepseekV32Indexer`: its k-cache layer and its `SparseAttnIndexer` op) on the
    step's config, its index cache bound as the runner binds it ([num_blocks, block_size, 132] uint8)."""
    from vllm.config import set_current_vllm_config

    attention = importlib.import_module(ATTENTION_MODULE)
    context = cfg.compilation_config.static_forward_context
    context.pop(PREFIX + ".k_cache", None)  # one layer per step's config: the name is the model's, reused
    with set_current_vllm_config(cfg):
        layer = attention.DeepseekV32Indexer(cfg, cfg.model_config.hf_text_config, cfg.model_config.get_hidden_size(),
                                             Q_LORA_RANK, None, cfg.cache_config, topk_indices_buffer, prefix=PREFIX)
    layer.k_cache.bind_kv_cache(kv_cache.unsqueeze(1))
    return layer


@contextlib.contextmanager
def scheduled_sms(num_sms: int):
    """Case.indexer.num_sms for what runs inside: the builder's `num_compute_units` (read when vLLM makes a builder:
    the schedule's rows) and DeepGEMM's `set_num_sms` (its paged logits launch one task per SM and assert the
    schedule has as many), restored after. 0: the device's, as they are."""
    if not num_sms:
        yield
        return
    builder = importlib.import_module(BUILDER_MODULE)
    deep_gemm = deep_gemm_standin if _DEEP_GEMM_EMULATED else importlib.import_module(DEEP_GEMM_MODULE)
    units, sms = builder.num_compute_units, deep_gemm.get_num_sms()
    builder.num_compute_units = lambda device_id=0: num_sms
    deep_gemm.set_num_sms(num_sms)
    try:
        yield
    finally:
        builder.num_compute_units = units
        deep_gemm.set_num_sms(sms)


def indexer_builder(cfg, layer, device: str, block_table_width: int):
    """The indexer's metadata builder (`DeepseekV32IndexerMetadataBuilder`) for the layer's k-cache spec."""
    from vllm.config import set_current_vllm_config

    builder_cls = importlib.import_module(BUILDER_MODULE).DeepseekV32IndexerMetadataBuilder
    with set_current_vllm_config(cfg):
        spec = layer.k_cache.get_kv_cache_spec(cfg)
        return builder_cls(spec, [layer.k_cache.prefix], cfg, torch.device(device), block_table_width=block_table_width)


def indexer_step(cfg, builder, layer, common, q_fp8: torch.Tensor, k: torch.Tensor, weights: torch.Tensor,
                 num_rows: int, cudagraph_mode: str = "none"):
    """One step: the builder's metadata for the step's CommonAttentionMetadata, then the layer's op on the CUDA
    route (`forward_cuda`: index K written to the cache, logits, top-k into the persistent buffer) under the step's
    forward context. `num_rows`: the rows the model hands the op (hidden_states), CUDA-graph padding included.
    Returns (the layer's topk_indices_buffer, the metadata)."""
    from vllm.config import CUDAGraphMode, set_current_vllm_config
    from vllm.forward_context import set_forward_context

    with set_current_vllm_config(cfg):
        metadata = builder.build(0, common)
        mode = CUDAGraphMode.FULL if cudagraph_mode == "full" else CUDAGraphMode.NONE
        hidden_states = torch.empty((num_rows, 1), dtype=torch.bfloat16, device=q_fp8.device)  # only its rows count
        with torch.inference_mode(), set_forward_context({layer.k_cache.prefix: metadata}, cfg,
                                                         cudagraph_runtime_mode=mode):
            out = layer.indexer_op.forward_cuda(hidden_states, q_fp8, k, weights)
    return out, metadata


@contextlib.contextmanager
def logits_budget(megabytes: int):
    """VLLM_SPARSE_INDEXER_MAX_LOGITS_MB for the step (the builder splits prefills into chunks by it)."""
    import os

    before = os.environ.get("VLLM_SPARSE_INDEXER_MAX_LOGITS_MB")
    os.environ["VLLM_SPARSE_INDEXER_MAX_LOGITS_MB"] = str(megabytes)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("VLLM_SPARSE_INDEXER_MAX_LOGITS_MB", None)
        else:
            os.environ["VLLM_SPARSE_INDEXER_MAX_LOGITS_MB"] = before


def write_index_keys(k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The keys of tokens an earlier step (or a prefix-cache hit) left in the index cache, written as the layer
    writes them: through vLLM's `indexer_k_quant_and_cache` (the op the indexer calls), quant block 128, ue8m0."""
    ops = importlib.import_module(INDEXER_MODULE).ops
    if slot_mapping.numel():
        ops.indexer_k_quant_and_cache(k, kv_cache, slot_mapping, QUANT_BLOCK, "ue8m0")


def index_cache(num_blocks: int, block_size: int, device: str) -> torch.Tensor:
    """The layer's index cache, [num_blocks, block_size, 132] uint8, every byte 0xFF: e4m3 NaN values and NaN
    scales, so a slot read before anything wrote it turns its scores NaN."""
    return torch.full((num_blocks, block_size, ENTRY_BYTES), 0xFF, dtype=torch.uint8, device=device)
