"""What the installed vLLM release offers, detected once (before any mutant is injected).

Signatures, module paths and behaviour drift between releases (0.23 -> 0.33): the converter gained
BLOCK_STRIDE_ROWS, idx_mapping and DCP arguments, the DCP filter appeared, and `return_valid_counts` went
from counting in place to compacting the valid entries to the front. Targets ask this module instead of
pinning one release's internals; a feature a release lacks is never generated for it.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from functools import lru_cache

from fuzzer.errors import TargetUnavailable

SPARSE_UTILS = "vllm.v1.attention.backends.mla.sparse_utils"


def import_vllm() -> str:
    """Import vLLM (once per process: 7-20 s on the GPU host) and return its version; raises what the import
    raised."""
    import vllm

    return vllm.__version__


def vllm_version() -> str:
    try:
        import vllm

        return vllm.__version__
    except Exception as e:
        return f"not importable ({type(e).__name__}: {e})"


def sparse_utils():
    """The module, looked up at call time so that patches made to it take effect as inside vLLM."""
    try:
        return importlib.import_module(SPARSE_UTILS)
    except Exception as e:
        raise TargetUnavailable(f"cannot import {SPARSE_UTILS} from vLLM {vllm_version()}: {type(e).__name__}: {e}") from e


@dataclass(frozen=True)
class RemapApi:
    """Features of `triton_convert_req_index_to_global_index` / `triton_filter_and_convert_dcp_index`."""

    version: str
    convert_params: frozenset[str]
    dcp_filter_params: frozenset[str] | None  # None: the release has no DCP filter
    compacts_valid_counts: bool  # return_valid_counts compacts valid entries to a prefix
    checks_row_contract: bool  # the wrapper asserts req_id and token_indices cover the same tokens

    @property
    def has_block_stride_rows(self) -> bool:
        return "BLOCK_STRIDE_ROWS" in self.convert_params

    @property
    def has_idx_mapping(self) -> bool:
        return "idx_mapping" in self.convert_params

    @property
    def has_dcp_filter(self) -> bool:
        return self.dcp_filter_params is not None

    @property
    def dcp_has_interleave(self) -> bool:
        return bool(self.dcp_filter_params) and "cp_kv_cache_interleave_size" in self.dcp_filter_params

    @property
    def dcp_has_block_stride_rows(self) -> bool:
        return bool(self.dcp_filter_params) and "BLOCK_STRIDE_ROWS" in self.dcp_filter_params


@lru_cache(maxsize=None)
def remap_api() -> RemapApi:
    su = sparse_utils()
    convert = getattr(su, "triton_convert_req_index_to_global_index", None)
    if convert is None:
        raise TargetUnavailable(f"vLLM {vllm_version()} has no triton_convert_req_index_to_global_index")
    src = inspect.getsource(convert)
    dcp = getattr(su, "triton_filter_and_convert_dcp_index", None)
    return RemapApi(
        version=vllm_version(),
        convert_params=frozenset(inspect.signature(convert).parameters),
        dcp_filter_params=None if dcp is None else frozenset(inspect.signature(dcp).parameters),
        compacts_valid_counts=bool(re.search(r"COMPACT_TO_FRONT\s*=\s*return_valid_counts", src)),
        checks_row_contract=bool(re.search(r"req_id\.shape\[0\]\s*==\s*token_indices\.shape\[0\]", src)),
    )
