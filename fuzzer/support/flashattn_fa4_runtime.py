"""Setting vLLM's FLASH_ATTN_MLA_SPARSE_FA4 backend (`FlashAttnMLASparseFA4Backend`, SM100, FlashAttention 4 through
its CuTe-DSL interface) up without a model, for its target and reproducers. torch and vLLM only (plus attnfuzz's
stand-ins).

The backend (vllm/v1/attention/backends/mla/flashattn_mla_sparse.py) derives from FLASHINFER_MLA_SPARSE's: the same
metadata builder (`FlashAttnMLASparseFA4MetadataBuilder` adds nothing to the trtllm-gen one), the same impl but for
its kernel call: `FlashAttnMLASparseFA4Impl._forward_mqa_kernel` runs a batch of decode tokens only (`is_decode`)
through FA4 (vLLM's `flash_attn_varlen_func(..., fa_version=4)` with the top-k rows as `gather_kv_indices`, the valid
counts as `gather_kv_valid_length`, one query row a token, the cache as flat rows), every other batch through
FlashInfer's trtllm-gen (its parent's call, LSE turned to natural log). So the engine is FLASHINFER_MLA_SPARSE's
(`flashinfer_sparse_runtime.engine`), with the impl's kernel call run where both kernels are found:
- FA4: vLLM's own `flash_attn_varlen_func` (its FA4 branch: argument checks, descales dropped for bf16) runs for
  real; on a host whose `vllm.vllm_flash_attn` cannot load (any CPU) its module is loaded from vLLM's file beside a
  stand-in package, the compiled FA2/FA3 extensions it tries left absent. What it imports at fa_version=4,
  `vllm.vllm_flash_attn.cute.interface._flash_attn_fwd`, is attnfuzz's stand-in
  (`fuzzer.support.standins.flash_attn_fa4`; no attnfuzz host has SM100, where FA4's sparse kernels run).
- trtllm-gen: attnfuzz's stand-in as `flashinfer.decode` (`fuzzer.support.standins.flashinfer_trtllm_mla`, SM100).
Both only for the span of that call; the module's `flash_attn_varlen_func` (FA3's stand-in on a CPU, which
FLASH_ATTN_MLA_SPARSE calls) is vLLM's wrapper during it, in the namespace the impl's method reads its globals from
(a mutant's copy included).

vLLM's platform check would not choose the backend here (`supports_compute_capability`: major == 10;
`supports_combination`: FlashInfer installed and FA4's CuTe-DSL entry point importable): the engine is built as an
SM100 host builds it, and every result says so (`PLATFORM_NOTE`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import os
import types

from fuzzer.support import flashinfer_sparse_runtime
from fuzzer.support.flashmla_runtime import FLASH_ATTN_INTERFACE, FLASH_ATTN_SPARSE_MODULE, flash_attn_sparse_backend
from fuzzer.support.sparse_mla_steps import prepare_cpu
from fuzzer.support.standins import flash_attn_fa4, flashinfer_trtllm_mla
from fuzzer.support.standins.importable import importable_as

NAME = "FLASH_ATTN_MLA_SPARSE_FA4"
EMULATED = (
    f"{flash_attn_fa4.KERNEL}: FA4's _flash_attn_fwd as vLLM 0.33.0 vendors it (vllm_flash_attn/cute: its checks, "
    "the sparse decode and MLA forward kernels' gather semantics), for decode batches",
    *flashinfer_sparse_runtime.EMULATED[10],
)
PLATFORM_NOTE = ("vLLM's FlashAttnMLASparseFA4Backend asks for major == 10 (supports_compute_capability, from "
                 "FLASHINFER_MLA_SPARSE) and for FlashInfer and FA4's CuTe-DSL entry point (supports_combination): this "
                 "host has none of them; the engine is built as an SM100 host builds it, FA4's and trtllm-gen's kernels "
                 "stand-ins, vLLM's flash_attn_varlen_func its own")


@functools.cache
def backend(device: str = "cuda"):
    """(vLLM's FlashAttnMLASparseFA4Backend, the ops attnfuzz's stand-ins replace for it). Its module is
    FLASH_ATTN_MLA_SPARSE's, imported as that backend's loader imports it (FA3's stand-in in vllm_flash_attn's place
    where it cannot load)."""
    flash_attn_sparse_backend(device)
    flash_attn_interface_file()  # the kernel call's flash_attn_varlen_func is vLLM's own, from that file
    backend_cls = importlib.import_module(FLASH_ATTN_SPARSE_MODULE).FlashAttnMLASparseFA4Backend
    backend_cls.get_impl_cls()
    return backend_cls, EMULATED


def prepare_host(device: str):
    """(vLLM's backend class, the ops the stand-ins replace, the shims), as sparse_mla_steps.prepare_host."""
    shims = prepare_cpu(device)
    backend_cls, emulated = backend(device)
    return backend_cls, emulated, [*shims, PLATFORM_NOTE]


def flash_attn_interface_file() -> str:
    """vLLM's vllm_flash_attn/flash_attn_interface.py: the installed release's, or where a host without the package
    (the GPU bundle leaves vllm_flash_attn out) keeps that release's copy, $ATTNFUZZ_VLLM_FLASH_ATTN_INTERFACE
    (scripts/gpu-ops.sh carries it)."""
    vllm = importlib.import_module("vllm")
    for path in (os.path.join(os.path.dirname(vllm.__file__), "vllm_flash_attn", "flash_attn_interface.py"),
                 os.environ.get("ATTNFUZZ_VLLM_FLASH_ATTN_INTERFACE", "")):
        if path and os.path.isfile(path):
            return path
    raise FileNotFoundError("vLLM's vllm_flash_attn/flash_attn_interface.py is not on this host (the GPU bundle "
                            "leaves vllm_flash_attn out: scripts/gpu-ops.sh carries it)")


@functools.cache
def vllm_flash_attn_interface() -> types.ModuleType:
    """vLLM's `vllm_flash_attn.flash_attn_interface`: imported where its package loads, else from its file with a
    stand-in package around it for the span of that load (its compiled FA2/FA3 extensions fail to import and are
    left absent, as the module itself allows)."""
    with contextlib.suppress(ImportError):
        return importlib.import_module(FLASH_ATTN_INTERFACE)
    package_name = FLASH_ATTN_INTERFACE.rsplit(".", 1)[0]
    path = flash_attn_interface_file()
    package = types.ModuleType(package_name, "attnfuzz's stand-in package around vLLM's flash_attn_interface.py")
    package.__path__ = [os.path.dirname(path)]
    spec = importlib.util.spec_from_file_location(FLASH_ATTN_INTERFACE, path)
    module = importlib.util.module_from_spec(spec)
    with importable_as({package_name: package, FLASH_ATTN_INTERFACE: module}):
        spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def kernels(scope: dict):
    """Inside the block: `flash_attn_varlen_func` in `scope` (the globals the impl's kernel call reads) vLLM's own,
    `_flash_attn_fwd` FA4's stand-in, `flashinfer.decode` trtllm-gen's stand-in."""
    saved = scope.get("flash_attn_varlen_func")
    scope["flash_attn_varlen_func"] = vllm_flash_attn_interface().flash_attn_varlen_func
    try:
        with flash_attn_fa4.importable(), flashinfer_trtllm_mla.importable(10):
            yield
    finally:
        scope["flash_attn_varlen_func"] = saved


def _kernel_call_with_fa4(impl) -> None:
    """impl._forward_mqa_kernel (its class's, looked up at each call: a mutant's patch included) run inside
    `kernels`, with the globals of the function that runs (under any wrapper)."""
    def call(*args, **kwargs):
        method = type(impl)._forward_mqa_kernel
        with kernels(inspect.unwrap(method).__globals__):
            return method(impl, *args, **kwargs)

    impl._forward_mqa_kernel = call


def engine(backend_cls, cfg, spec, heads: int, kv_cache_dtype: str, topk_indices_buffer, k_scale: float,
           q_scale: float, device: str, model_type: str = "deepseek_v32"):
    """(impl, layer, builder) as vLLM's model runner holds them: FLASHINFER_MLA_SPARSE's engine
    (`flashinfer_sparse_runtime.engine`) on this backend's classes, its impl's kernel call running FA4 and
    trtllm-gen as the module docstring says."""
    impl, layer, builder = flashinfer_sparse_runtime.engine(
        10, backend_cls, cfg, spec, heads, kv_cache_dtype, topk_indices_buffer, k_scale=k_scale, q_scale=q_scale,
        device=device, model_type=model_type)
    _kernel_call_with_fa4(impl)
    return impl, layer, builder
