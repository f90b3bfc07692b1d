"""vLLM set up to run a sparse-MLA backend or the indexer without a model, whatever the backend: one real
VllmConfig of a small DeepSeek-V3.2-shaped model (ModelConfig from a config.json on disk, no hub), vLLM's process groups
and workspace manager, the case's fields on that config, the CPU shims of vLLM's own accelerator plumbing, and the
indexer's top-k buffer handed to an impl as this release takes it. Shared by the targets and their reproducers (whose
attnfuzz_support.py carries what their path reaches). torch and vLLM only."""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import json
import os
from pathlib import Path
from types import SimpleNamespace

import torch

# DeepSeek-V3.2's MLA dims
KV_LORA_RANK, ROPE_DIM, QK_NOPE, V_HEAD = 512, 64, 128, 128
HEAD_SIZE, SM_SCALE = KV_LORA_RANK + ROPE_DIM, (QK_NOPE + ROPE_DIM) ** -0.5
LAYER = "attnfuzz.layer"  # the name the attention layer is registered under in the forward context
MAX_MODEL_LEN = 8192  # fp8 reserves max_model_len x sparse_mla_prefill_workspace_factor rows of 576 bf16


# A small DeepSeek-V3.2-shaped HF config: ModelConfig needs one on disk (no hub); only the MLA dims matter.
HF_CONFIG = dict(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", hidden_size=1024,
                 num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=KV_LORA_RANK, q_lora_rank=None,
                 qk_nope_head_dim=128, qk_rope_head_dim=ROPE_DIM, v_head_dim=128, index_topk=2048, index_n_heads=8,
                 index_head_dim=128, num_hidden_layers=1, vocab_size=1000, intermediate_size=256,
                 moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                 max_position_embeddings=MAX_MODEL_LEN, torch_dtype="bfloat16")


def standins_forced() -> bool:
    """ATTNFUZZ_STANDIN_OPS=1: attnfuzz's stand-ins in place of every compiled op even where the host has the op
    (triage: does a GPU-only finding follow vLLM's kernel or its Python?). Every result lists them as emulated."""
    return os.environ.get("ATTNFUZZ_STANDIN_OPS", "0") == "1"


def has_op(namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
        return True
    except (AttributeError, RuntimeError):
        return False


def has_cache_op(name: str) -> bool:
    if standins_forced():
        return False
    return has_op("_C_cache_ops", name)


def try_import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


@functools.cache
def cpu_shims() -> tuple[str, ...]:
    """CPU-only stand-ins for vLLM's accelerator plumbing, whichever backend runs: they change no computation (streams
    are no-ops there). A backend module's own (FlashMLA's) are its runtime's."""
    import vllm.v1.attention.backends.utils as backend_utils
    import vllm.v1.worker.workspace as workspace

    # Modules that bound PIN_MEMORY by name at import (0.33; older releases lack some of them).
    optional = [try_import(m) for m in ("vllm.model_executor.layers.attention.mla_attention",
                                         "vllm.model_executor.layers.attention.sparse_mla_attention",
                                         "vllm.v1.attention.backends.mla.index_group")]
    index_group = optional[2]
    for m in (*[m for m in optional[:2] if m is not None], backend_utils):
        if hasattr(m, "PIN_MEMORY"):
            m.PIN_MEMORY = False
    if index_group is not None:
        index_group._create_side_stream = lambda device: NoStream()
        index_group._create_event = lambda: NoStream()
        index_group.current_stream = lambda: NoStream()
        # 0.34 makes them with torch.Stream, torch.Event and torch.accelerator.current_stream directly
        index_group.torch = SimpleNamespace(**{**vars(torch), "Stream": NoStream, "Event": NoStream, "accelerator":
                                               SimpleNamespace(**{**vars(torch.accelerator), "current_stream": NoStream})})
    workspace.torch = SimpleNamespace(**{**vars(torch), "accelerator": SimpleNamespace(empty_cache=lambda: None)})
    _zeros, _empty = torch.zeros, torch.empty
    mla = optional[0]
    pinned_mla = mla is not None and "pin_memory=True" in inspect.getsource(mla)
    if pinned_mla:  # 0.26 allocates the chunked-context metadata pinned, literally (0.33 through PIN_MEMORY)
        mla.torch = SimpleNamespace(**{**vars(torch), "zeros": lambda *a, pin_memory=False, **k: _zeros(*a, **k),
                                       "empty": lambda *a, pin_memory=False, **k: _empty(*a, **k)})
    return (*(("mla_attention: torch.empty/zeros(pin_memory=True) unpinned (chunked-context metadata)",)
              if pinned_mla else ()),
            "PIN_MEMORY=False where (sparse_)mla_attention and backends.utils bound it",
            "index group side stream / events / current_stream: no-ops (CPU has no streams)",
            "workspace manager: torch.accelerator.empty_cache no-op")


class NoStream:  # CPU work is synchronous: waits, records and stream scopes order nothing
    def __init__(self, *a, **k): ...
    def wait_event(self, *a): ...
    def wait_stream(self, *a): ...
    def record(self, *a): ...
    def synchronize(self): ...
    def __enter__(self): return self
    def __exit__(self, *a): return False


# Capability queries some constructors make of vLLM's compiled `_C` (CUTLASS fp8 GEMMs: ModelConfig's
# architecture inspection, the layer's fp8 quant ops). A build without `_C` (the GPU bundle) answers as a
# build without those kernels would: False. Attention computes nothing with them.
_C_QUERIES = ("cutlass_scaled_mm_supports_block_fp8", "cutlass_scaled_mm_supports_fp8")


@functools.cache  # a library that cannot load here is tried once a process (a failed dlopen costs tenths of a second)
def _load_vllm_libraries() -> None:
    for library in ("vllm._C", "vllm._C_stable_libtorch"):
        with contextlib.suppress(Exception):  # not built for this host (no CUDA driver: ImportError)
            importlib.import_module(library)


def define_missing_c_queries() -> tuple[str, ...]:
    """Define the `_C` capability queries no compiled library of vLLM's registers here, answering False. vLLM's
    libraries are loaded first: a query defined in Python before the library that registers it is loaded makes
    that library's registration a duplicate when vLLM loads it later (the likely cause of the SIGABRT reproducers that
    asked first met on the GPU host with the real ops; not yet confirmed there: bench/scenarios/gpu-repros-real-ops)."""
    _load_vllm_libraries()
    missing = []
    for name in _C_QUERIES:
        try:
            getattr(torch.ops._C, name)
        except (AttributeError, RuntimeError):
            missing.append(name)
    if missing:
        if not _LIBS:
            _LIBS.append(torch.library.Library("_C", "FRAGMENT"))
        for name in missing:
            _LIBS[0].define(f"{name}(int cuda_device_capability) -> bool")
            _LIBS[0].impl(name, lambda cap: False, "CompositeExplicitAutograd")
    return tuple(f"torch.ops._C.{name} -> False (not in this build)" for name in missing)


@contextlib.contextmanager
def _inspect_in_process():
    """ModelConfig inspects the architecture by importing DeepSeek's model module in a subprocess, whose
    quantization utils ask vLLM's compiled `_C` whether CUTLASS block-fp8 GEMMs exist. Where `_C` is missing
    (the GPU bundle), inspect in this process, where `define_missing_c_queries` answers."""
    from vllm.model_executor.models import registry

    define_missing_c_queries()
    run_in_subprocess = registry._run_in_subprocess
    registry._run_in_subprocess = lambda fn: fn()
    try:
        yield
    finally:
        registry._run_in_subprocess = run_in_subprocess


_LIBS: list = []


def model_config(state_dir: str, name: str, hf_config: dict, max_model_len: int):
    """A real ModelConfig of the model whose config.json (`hf_config`) is written under `state_dir`/`name` (no hub)."""
    from vllm.config import ModelConfig

    model_dir = (Path(state_dir) / name).resolve()
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(hf_config))
    with _inspect_in_process():
        return ModelConfig(model=str(model_dir), tokenizer=None, skip_tokenizer_init=True, dtype="bfloat16",
                           max_model_len=max_model_len)


@functools.cache
def vllm_runtime(device: str, state_dir: str, world_size: int = 1, rank: int = 0, init_method: str | None = None):
    """Process-wide: one real VllmConfig (per-case fields are set by `configure`), vLLM's process groups
    (the impl asks for the TP group; by default a world of one, on gloo), and the workspace manager.
    `state_dir` holds the model's config.json and the process group's init file. With `world_size` > 1 this
    process is `rank` of a real group (NCCL on GPUs, gloo on CPUs) whose TP and DCP groups span every rank,
    as DCP reuses the TP ranks."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

    model = model_config(state_dir, "flashmla-model", HF_CONFIG, MAX_MODEL_LEN)
    cfg = VllmConfig(model_config=model, device_config=DeviceConfig(device=device))
    with set_current_vllm_config(cfg):
        if parallel_state._TP is None:
            if init_method is None:
                init_file = (Path(state_dir) / "flashmla-dist-init").resolve()
                init_file.unlink(missing_ok=True)
                init_method = f"file://{init_file}"
            backend = "nccl" if world_size > 1 and device == "cuda" else "gloo"
            parallel_state.init_distributed_environment(world_size, rank, init_method, rank, backend)
            parallel_state.initialize_model_parallel(world_size, 1, 1, world_size)
    if not is_workspace_manager_initialized():
        init_workspace_manager(torch.device(device))
    return cfg


def mtp_speculative_config(num_speculative_tokens: int):
    """vLLM's speculative config as its builders and the indexer read it under MTP (None without draft tokens): k draft
    tokens, no parallel drafting, DSpark, EAGLE or adaptive verification, and no drafting slots appended to the target
    batch (MTP's `max_num_new_slots_for_drafting`, which 0.34's decode threshold adds)."""
    if not num_speculative_tokens:
        return None
    return SimpleNamespace(num_speculative_tokens=num_speculative_tokens, method="mtp", parallel_drafting=False,
                           enable_adaptive_verification=False, max_num_new_slots_for_drafting=0,
                           use_eagle=lambda: False, use_dspark=lambda: False)


def configure(cfg, case, max_num_batched_tokens: int):
    """The case's model/cache/scheduler fields on the shared config, as vLLM's tests patch theirs."""
    cfg.model_config.hf_text_config.index_topk = case.topk_width
    cfg.model_config.get_num_attention_heads = lambda parallel_config=None: case.heads  # TP = 128 / heads
    cfg.cache_config.cache_dtype = case.kv_cache_dtype
    cfg.cache_config.block_size = case.block_size
    cfg.scheduler_config.max_num_batched_tokens = max_num_batched_tokens
    # DCP: every case sets it (the config is shared by every case of the process, DCP or not).
    cfg.parallel_config.decode_context_parallel_size = case.dcp.size
    cfg.parallel_config.cp_kv_cache_interleave_size = case.dcp.interleave
    # A placeholder layer with no prefill backend: every token takes forward_mqa.
    cfg.compilation_config.static_forward_context[LAYER] = SimpleNamespace(prefill_backend=None)
    return cfg


INDEX_GROUP_POISON = 0  # slot 0 of the null block: never a converted index (tables hold blocks >= 1)


def guard_index_group(impl, poison: bool = True):
    """Poison the index group's persistent physical top-k buffer; returns check(rows_converted) -> messages
    naming rows past the conversion's own that a call wrote (an overrun that stays inside vLLM's
    allocation, invisible to any memory checker). poison=False (a later step of a trace, on the buffer as
    earlier steps left it): rows past the conversion's that the call changed."""
    group = getattr(impl, "index_group", None)
    buffer = getattr(group, "physical_topk_indices", None)
    if buffer is None:
        return lambda rows: []
    if poison:
        buffer.fill_(INDEX_GROUP_POISON)
    before = buffer.clone()

    def check(rows: int) -> list[str]:
        written = (buffer[rows:] != before[rows:]).any(dim=-1).nonzero()
        if not len(written):
            return []
        return [f"index group physical_topk_indices: rows {rows + int(written[0])}..{rows + int(written[-1])} written by a "
                f"conversion of {rows} rows ({buffer.shape[0]} allocated): the index remap wrote past its output"]

    return check


def impl_topk_kwargs(impl_cls, topk_indices_buffer: torch.Tensor) -> dict:
    """How this release's FlashMLASparseImpl takes the indexer's top-k buffer. With an index group (0.33):
    `topk_indices_buffer=` and no indexer, so the group orders its conversion on the compute stream (an indexer
    would make it wait for an event only a real indexer records). Without one (0.23, 0.26): through `indexer=`,
    which 0.23 requires."""
    if try_import("vllm.v1.attention.backends.mla.index_group") is not None:
        return {"topk_indices_buffer": topk_indices_buffer, "indexer": None}
    return {"indexer": SimpleNamespace(topk_indices_buffer=topk_indices_buffer)}
