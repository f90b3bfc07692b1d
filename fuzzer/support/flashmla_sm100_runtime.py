"""vLLM's FLASHMLA_SPARSE backend as an SM100 host runs it, for the `nvfp4_ds_mla` cache (DeepSeek-V3.2's 352-byte
NVFP4 entry, which vLLM takes on SM100 only: `FlashMLASparseBackend.supports_combination`).

What SM100 changes in the backend's Python (vllm/v1/attention/backends/mla/flashmla_sparse.py, read from 0.33.0):
`FlashMLASparseMetadataBuilder.__init__` asks `current_platform.is_device_capability_family(100)` for its decode
threshold (128 up to 32 heads, 256 at 64, 1024 at 128) and its tile-scheduler buffer (the full SM count), and the
backend's kernel block size is 64 for a quantized cache (`get_supported_kernel_block_sizes`). No attnfuzz host has an
SM100, so the builder is made with the module's `current_platform` answering family 100 (only while it is made), and
the compiled ops this cache needs are stand-ins: FlashMLA's sparse decode on the 352-byte entry, the cache writer
(`concat_and_cache_mla` for nvfp4_ds_mla) and `cp_gather_and_upconvert_nvfp4_kv_cache`. torch and vLLM only (plus
attnfuzz's stand-in modules).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from types import SimpleNamespace

from fuzzer.support.flashmla_runtime import BACKEND_MODULE, flashmla_sparse_backend
from fuzzer.support.sparse_mla_steps import sparse_mla_engine
from fuzzer.support.standins import flashmla_ops

SM100_SHIM = ("vLLM's FlashMLASparseBackend takes nvfp4_ds_mla on SM100 only (supports_combination) and its builder "
              "reads is_device_capability_family(100): this host has no SM100; the builder is made with that query "
              "answering True, and FlashMLA's SM100 kernels are stand-ins")


@functools.cache
def flashmla_sparse_sm100_backend(device: str = "cuda"):
    """(vLLM's FLASHMLA_SPARSE backend class, the stand-ins bound for it): FlashMLA's (flashmla_sparse_backend), and
    the nvfp4 upconverting gather bound in the module's `ops` (no host attnfuzz runs on has it for an SM100)."""
    backend, emulated = flashmla_sparse_backend(device)
    mod = importlib.import_module(BACKEND_MODULE)
    mod.ops = SimpleNamespace(**{**vars(mod.ops),
                                 "cp_gather_and_upconvert_nvfp4_kv_cache": flashmla_ops.cp_gather_and_upconvert_nvfp4_kv_cache})
    return backend, (*emulated, "cp_gather_and_upconvert_nvfp4_kv_cache")


class _SM100Platform:
    """vLLM's current_platform, but of the Blackwell family (compute capability 10.0)."""

    def __init__(self, platform):
        self._platform = platform

    def is_device_capability_family(self, family: int, device_id: int = 0) -> bool:
        return family == 100

    def __getattr__(self, name):
        return getattr(self._platform, name)


@contextlib.contextmanager
def sm100_platform():
    """While inside: the FlashMLA-sparse module's `current_platform` answers as an SM100 host's."""
    mod = importlib.import_module(BACKEND_MODULE)
    platform = mod.current_platform
    mod.current_platform = _SM100Platform(platform)
    try:
        yield
    finally:
        mod.current_platform = platform


def sparse_mla_engine_sm100(backend, spec, cfg, heads: int, kv_cache_dtype: str, topk_indices_buffer, device: str):
    """(builder, impl) as an SM100 host's runner makes them (`sparse_mla_engine` under `sm100_platform`)."""
    with sm100_platform():
        return sparse_mla_engine(backend, spec, cfg, heads, kv_cache_dtype, topk_indices_buffer, device)
