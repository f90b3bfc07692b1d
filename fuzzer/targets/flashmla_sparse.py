"""`vllm.flashmla_sparse`: vLLM's FlashMLA sparse-MLA backend (`FLASHMLA_SPARSE`), whole, on the MQA route.

vLLM's FlashMLASparseMetadataBuilder and FlashMLASparseImpl.forward_mqa over every token (no prefill backend
on the layer, so nothing is split off to dense MHA), with a bf16 or fp8_ds_mla cache: the builder's split and
req_id_per_token, the index group and the index-remap Triton kernel, head padding, the fp8 mixed-batch and
separate prefill/decode paths. Where this host lacks FlashMLA's compiled kernels and vLLM's cache ops (any
CPU), torch stand-ins from `fuzzer.standins.flashmla_ops` are bound where `flashmla_sparse` looks them up.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import json
from types import SimpleNamespace

import torch

from fuzzer.targets.backend_harness import cache_writer, common_attn_metadata, paged_cache, step_tensors
from fuzzer.targets.base import Target
from oracles.attention_judge import judge_attention
from oracles.materialize import HEAD_SIZE, KV_LORA_RANK, ROPE_DIM, SM_SCALE
from strategies.batches import AttentionFeatures, attention_cases

BACKEND_MODULE = "vllm.v1.attention.backends.mla.flashmla_sparse"
LAYER = "attnfuzz.layer"
FP8_ENTRY_BYTES = 656
MAX_MODEL_LEN = 8192  # fp8 reserves max_model_len x sparse_mla_prefill_workspace_factor rows of 576 bf16
# A small DeepSeek-V3.2-shaped HF config: ModelConfig needs one on disk (no hub); only the MLA dims matter.
HF_CONFIG = dict(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", hidden_size=1024,
                 num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=KV_LORA_RANK, q_lora_rank=None,
                 qk_nope_head_dim=128, qk_rope_head_dim=ROPE_DIM, v_head_dim=128, index_topk=2048, index_n_heads=8,
                 index_head_dim=128, num_hidden_layers=1, vocab_size=1000, intermediate_size=256,
                 moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                 max_position_embeddings=MAX_MODEL_LEN, torch_dtype="bfloat16")


def _has_flashmla_kernels() -> bool:
    return importlib.import_module("vllm.v1.attention.ops.flashmla")._is_flashmla_available()[0]


def _has_cache_op(name: str) -> bool:
    try:
        getattr(torch.ops._C_cache_ops, name)
        return True
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def install_standins() -> tuple[str, ...]:
    """Bind torch stand-ins where flashmla_sparse looks the compiled ops up; only for ops this host lacks."""
    from fuzzer.standins import flashmla_ops

    mod, bound = importlib.import_module(BACKEND_MODULE), []
    if not _has_flashmla_kernels():
        for name in ("flash_mla_sparse_fwd", "flash_mla_with_kvcache", "get_mla_metadata", "FlashMLASchedMeta"):
            setattr(mod, name, getattr(flashmla_ops, name))
        bound += ["flash_mla_sparse_fwd", "flash_mla_with_kvcache", "get_mla_metadata"]
    missing = [n for n in ("concat_mla_q", "cp_gather_and_upconvert_fp8_kv_cache") if not _has_cache_op(n)]
    if missing:  # `ops` is vLLM's _custom_ops, bound by name: rebind it to a copy with the stand-ins
        mod.ops = SimpleNamespace(**{**vars(mod.ops), **{n: getattr(flashmla_ops, n) for n in missing}})
        bound += missing
    return tuple(bound)


@functools.cache
def cpu_shims() -> tuple[str, ...]:
    """CPU-only stand-ins for accelerator plumbing: they change no computation (streams are no-ops there)."""
    import vllm.model_executor.layers.attention.mla_attention as mla_attention
    import vllm.model_executor.layers.attention.sparse_mla_attention as sparse_mla_attention
    import vllm.v1.attention.backends.mla.index_group as index_group
    import vllm.v1.attention.backends.utils as backend_utils
    import vllm.v1.worker.workspace as workspace

    mod = importlib.import_module(BACKEND_MODULE)
    for m in (mla_attention, sparse_mla_attention, backend_utils):  # PIN_MEMORY bound by name at their import
        m.PIN_MEMORY = False

    class _NoStream:  # CPU work is synchronous: waits, records and stream scopes order nothing
        def __init__(self, *a, **k): ...
        def wait_event(self, *a): ...
        def wait_stream(self, *a): ...
        def record(self, *a): ...
        def synchronize(self): ...
        def __enter__(self): return self
        def __exit__(self, *a): return False

    mod.num_compute_units = lambda device_id=0: 132  # CPU platform raises NotImplementedError; SM90's count
    index_group._create_side_stream = lambda device: _NoStream()
    index_group._create_event = lambda: _NoStream()
    index_group.current_stream = mod.current_stream = lambda: _NoStream()
    workspace.torch = SimpleNamespace(**{**vars(torch), "accelerator": SimpleNamespace(empty_cache=lambda: None)})
    _zeros = torch.zeros
    mod.torch = SimpleNamespace(**{**vars(torch), "zeros": lambda *a, pin_memory=False, **k: _zeros(*a, **k)})
    return ("PIN_MEMORY=False where (sparse_)mla_attention and backends.utils bound it",
            "flashmla_sparse.num_compute_units=132 (CPU platform raises)",
            "index group side stream / events / current_stream: no-ops (CPU has no streams)",
            "workspace manager: torch.accelerator.empty_cache no-op",
            "flashmla_sparse: torch.zeros(pin_memory=True) unpinned (fp8 separate path)")


@contextlib.contextmanager
def _inspect_in_process():
    """ModelConfig inspects the architecture by importing DeepSeek's model module in a subprocess, whose
    quantization utils ask vLLM's compiled `_C` whether CUTLASS block-fp8 GEMMs exist. Where `_C` is missing
    (the GPU bundle), inspect in this process and answer as a build without those kernels would (False):
    attention computes nothing with it."""
    from vllm.model_executor.models import registry

    try:
        torch.ops._C.cutlass_scaled_mm_supports_block_fp8
    except (AttributeError, RuntimeError):
        if not _LIBS:
            lib = torch.library.Library("_C", "FRAGMENT")
            lib.define("cutlass_scaled_mm_supports_block_fp8(int cuda_device_capability) -> bool")
            lib.impl("cutlass_scaled_mm_supports_block_fp8", lambda cap: False, "CompositeExplicitAutograd")
            _LIBS.append(lib)  # the definition lives as long as the library object
    run_in_subprocess = registry._run_in_subprocess
    registry._run_in_subprocess = lambda fn: fn()
    try:
        yield
    finally:
        registry._run_in_subprocess = run_in_subprocess


_LIBS: list = []


@functools.cache
def vllm_runtime(device: str):
    """Process-wide: one real VllmConfig (per-case fields are set by `configure`), a world-size-1 gloo
    process group (the impl asks for the TP group), and the workspace manager."""
    from fuzzer.env import STATE_DIR
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

    model_dir = (STATE_DIR / "flashmla-model").resolve()
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(HF_CONFIG))
    with _inspect_in_process():
        model = ModelConfig(model=str(model_dir), tokenizer=None, skip_tokenizer_init=True, dtype="bfloat16",
                            max_model_len=MAX_MODEL_LEN)
    cfg = VllmConfig(model_config=model, device_config=DeviceConfig(device=device))
    with set_current_vllm_config(cfg):
        if parallel_state._TP is None:
            init_file = (STATE_DIR / "flashmla-dist-init").resolve()
            init_file.unlink(missing_ok=True)
            parallel_state.init_distributed_environment(1, 0, f"file://{init_file}", 0, "gloo")
            parallel_state.initialize_model_parallel(1, 1)
    if not is_workspace_manager_initialized():
        init_workspace_manager(torch.device(device))
    return cfg


def configure(cfg, case, max_num_batched_tokens: int):
    """The case's model/cache/scheduler fields on the shared config, as vLLM's tests patch theirs."""
    cfg.model_config.hf_text_config.index_topk = case.topk_width
    cfg.model_config.get_num_attention_heads = lambda parallel_config=None: case.heads  # TP = 128 / heads
    cfg.cache_config.cache_dtype = case.kv_cache_dtype
    cfg.cache_config.block_size = case.block_size
    cfg.scheduler_config.max_num_batched_tokens = max_num_batched_tokens
    # A placeholder layer with no prefill backend: every token takes forward_mqa.
    cfg.compilation_config.static_forward_context[LAYER] = SimpleNamespace(prefill_backend=None)
    return cfg


class FlashMLASparse(Target):
    name = "vllm.flashmla_sparse"
    summary = "FlashMLA sparse-MLA backend (FLASHMLA_SPARSE): builder + impl.forward_mqa, bf16 and fp8_ds_mla"
    bug_classes = "B C D G H I J K"
    oracle = staticmethod(judge_attention)
    real_parts = ("FlashMLASparseMetadataBuilder", "FlashMLASparseImpl.forward_mqa", "SparseMLAIndexGroup",
                  "the index-remap Triton kernel")
    kv_cache_dtypes = ("bfloat16", "fp8_ds_mla")

    def unavailable(self) -> str | None:
        try:
            importlib.import_module(BACKEND_MODULE)
        except Exception as e:
            return f"cannot import {BACKEND_MODULE}: {type(e).__name__}: {e}"
        if importlib.util.find_spec("vllm.v1.attention.backends.mla.index_group") is None:
            from fuzzer.targets.vllm_api import vllm_version

            return f"drives vLLM's sparse-MLA index group (as in 0.33); vLLM {vllm_version()} has none: not supported yet"
        return None

    def prepare(self) -> None:
        self.shims: list[str] = []
        if self.device == "cpu":  # before the backend is imported: it binds PIN_MEMORY by name
            from fuzzer.interp.corrections import CORRECTIONS, install_corrections
            from fuzzer.standins.cpu_shims import install_cpu_shims

            install_corrections()
            self.shims = [*install_cpu_shims(), *cpu_shims(), *(f"interpreter correction: {c}" for c in CORRECTIONS)]
        self.emulated = install_standins()
        self.cfg = vllm_runtime(self.device)

    def cases(self, profile):
        return attention_cases(profile, AttentionFeatures(kv_cache_dtypes=self.kv_cache_dtypes, block_sizes=(64, 128)))

    def step(self, case, device):
        """Inputs, poisoned cache, top-k buffer, new-token slots for `case` on `device`."""
        inp, slots, topk_buffer = step_tensors(case, device)
        if case.kv_cache_dtype == "fp8_ds_mla":  # 0xFF: fp8 NaN codes, NaN scales, NaN RoPE
            cache = paged_cache(case, device, dtype=torch.uint8, width=FP8_ENTRY_BYTES, poison=255)
        else:
            cache = paged_cache(case, device)
        return inp, slots, cache, topk_buffer

    def writer(self, case):
        """(write(kv_c, k_pe, cache, slots), emulated op name or None): vLLM's cache writer or the stand-in."""
        if case.kv_cache_dtype != "fp8_ds_mla":
            write, emulated = cache_writer()
            return (lambda kv_c, k_pe, cache, slots: write(kv_c, k_pe, cache, slots, "auto", torch.ones((), device=cache.device))), emulated
        if _has_cache_op("concat_and_cache_mla"):
            op = torch.ops._C_cache_ops.concat_and_cache_mla
            return (lambda kv_c, k_pe, cache, slots: op(kv_c, k_pe, cache, slots, "fp8_ds_mla", torch.ones((), device=cache.device))), None
        from fuzzer.standins.flashmla_ops import concat_and_cache_mla

        convention = case.fp8_scale if case.fp8_scale != "e8m0_trunc" else "pow2"  # pow2 scales survive e8m0
        return (lambda kv_c, k_pe, cache, slots: concat_and_cache_mla(kv_c, k_pe, cache, slots, "fp8_ds_mla", None, convention)), "concat_and_cache_mla"

    def run(self, case):
        from vllm.config import set_current_vllm_config
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        dev = self.device
        backend = importlib.import_module(BACKEND_MODULE).FlashMLASparseBackend
        inp, slots, cache, topk_buffer = self.step(case, dev)
        write, write_emulated = self.writer(case)
        cfg = configure(self.cfg, case, max_num_batched_tokens=topk_buffer.shape[0])
        spec = MLAAttentionSpec(block_size=case.block_size, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.bfloat16,
                                cache_dtype_str=case.kv_cache_dtype)
        before = []

        def call():
            # The cache as the layer leaves it before attention; every other row stays poisoned.
            write(inp.kv_c[slots], inp.k_pe[slots], cache, slots)
            before.append(cache.clone())
            with set_current_vllm_config(cfg), torch.inference_mode():
                builder = backend.get_builder_cls()(spec, [LAYER], cfg, torch.device(dev))
                metadata = builder.build(0, common_attn_metadata(case, inp.index, dev))
                # topk_indices_buffer= with indexer=None: the index group orders on the compute stream.
                impl = backend.get_impl_cls()(
                    case.heads, HEAD_SIZE, SM_SCALE, 1, None, None, case.kv_cache_dtype, None, "decoder", None,
                    topk_indices_buffer=topk_buffer, indexer=None, q_lora_rank=None, kv_lora_rank=KV_LORA_RANK,
                    qk_nope_head_dim=128, qk_rope_head_dim=ROPE_DIM, qk_head_dim=128 + ROPE_DIM, v_head_dim=128,
                    kv_b_proj=None)
                q = (inp.q[..., :KV_LORA_RANK], inp.q[..., KV_LORA_RANK:])  # (ql_nope, q_pe), as the layer passes it
                out, lse = impl.forward_mqa(q, cache, metadata, None)
            return {"out": out, "lse": lse}

        obs = self.observe(call)
        if before and case.kv_cache_dtype == "fp8_ds_mla":  # the bytes written, for the oracle to read back
            obs.outputs["cache_slots"] = slots.cpu()
            obs.outputs["cache_entries"] = before[0][slots // case.block_size, slots % case.block_size].cpu()
        obs.emulated = tuple(x for x in (*self.emulated, write_emulated) if x)
        obs.notes["shims"] = self.shims
        changed = (cache.view(torch.uint8) != before[0].view(torch.uint8)).any(dim=-1).nonzero() if before else []
        if len(changed):
            obs.notes["cache_changed"] = f"{len(changed)} rows, first block {int(changed[0][0])} offset {int(changed[0][1])}"
        return obs

    def render_repro(self, finding) -> tuple[str, dict]:
        # Not yet: a standalone script would have to carry the stand-ins and the VllmConfig set-up. Until
        # then the finding is replayed with `attnfuzz replay` (report.md says so).
        return "", {}
