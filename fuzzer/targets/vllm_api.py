"""What the installed vLLM release offers, detected once (before any mutant is injected).

Signatures, module paths and behaviour drift between releases (0.23 -> 0.33): the converter gained
BLOCK_STRIDE_ROWS, idx_mapping and DCP arguments, the DCP filter appeared, and `return_valid_counts` went
from counting in place to compacting the valid entries to the front. Targets ask this module instead of
pinning one release's internals; a feature a release lacks is never generated for it. What no detection foresaw
(a keyword renamed, a method moved, a return of another shape) fails at attnfuzz's call into vLLM: `moved_call`
tells it from the code under test's own answer, and the campaign says it could not test, naming the call.
"""

from __future__ import annotations

import dis
import importlib
import inspect
import linecache
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

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


@dataclass(frozen=True)
class Kernel:
    """A compiled kernel or op family the targets call: vLLM's (or FlashInfer's) own on this host, or attnfuzz's
    stand-in in its place (fuzzer/support/standins), and why."""

    name: str
    real: bool
    why: str


def kernels(device: str) -> list[Kernel]:
    """What of the compiled code the targets reach runs for real on `device`, asked as the targets ask when they bind
    their stand-ins (fuzzer/support: the same functions). On a CPU every one is a stand-in: the CUDA kernels cannot
    take CPU tensors."""
    from fuzzer.support import flashinfer_runtime, flashmla_runtime, indexer_runtime, vllm_setup  # deferred: torch

    if device != "cuda":
        why = "tensors on the CPU: the CUDA kernels cannot take them"
        return [Kernel(name, False, why) for name, _ in KERNELS]
    if vllm_setup.standins_forced():
        return [Kernel(name, False, "ATTNFUZZ_STANDIN_OPS=1") for name, _ in KERNELS]
    found = []
    for name, probe in KERNELS:
        try:
            real, why = probe(flashmla_runtime, flashinfer_runtime, indexer_runtime)
        except Exception as e:  # a probe that cannot load the extension: the targets bind the stand-in
            real, why = False, f"{type(e).__name__}: {e}"
        found.append(Kernel(name, real, why))
    return found


def _flashmla(fm, fi, ix):
    available, why = importlib.import_module("vllm.v1.attention.ops.flashmla")._is_flashmla_available()
    return available, "vllm._flashmla_C" if available else why


def _cache_ops(fm, fi, ix):
    ops = ("concat_and_cache_mla", "cp_gather_and_upconvert_fp8_kv_cache", *ix.CACHE_OPS)
    missing = [op for op in ops if not fm.has_cache_op(op)]
    return not missing, ("torch.ops._C_cache_ops" if not missing else f"for {', '.join(missing)}: this "
                         f"vLLM build lacks them")


KERNELS = (
    ("FlashMLA (flash_mla_sparse_fwd, flash_mla_with_kvcache)", _flashmla),
    ("FA3 (vllm_flash_attn's flash_attn_varlen_func)",
     lambda fm, fi, ix: (fm.has_compiled_flash_attn(), "vllm_flash_attn's compiled extension"
                         if fm.has_compiled_flash_attn() else "vllm_flash_attn has no compiled extension")),
    ("FlashInfer (BatchMLAPagedAttentionWrapper)",
     lambda fm, fi, ix: (bool(v := fi.real_flashinfer("cuda")), f"FlashInfer {v}" if v else
                         "flashinfer.mla does not import, or vLLM's gate for the backend refuses")),
    ("DeepGEMM (fp8_fp4_mqa_logits, fp8_fp4_paged_mqa_logits)",
     lambda fm, fi, ix: (ix._has_real_deep_gemm(), "vllm.third_party.deep_gemm" if ix._has_real_deep_gemm()
                         else "vllm.third_party.deep_gemm does not load")),
    ("vLLM _C cache ops (concat_and_cache_mla, ...)", _cache_ops),
)


# Where attnfuzz's calls into vLLM are made. Stand-ins and injected bugs stand for the code under test
# (what they raise is its answer, as the compiled op or the mutated vLLM would raise it).
_ROOT = Path(__file__).resolve().parents[2]
_PACKAGES = tuple(f"{_ROOT / d}/" for d in ("fuzzer", "strategies", "oracles"))  # installed, _ROOT is site-packages
_OURS = tuple(f"{_ROOT / d}/" for d in ("fuzzer/support", "fuzzer/targets"))  # the only code that calls vLLM
_THEIRS = tuple(f"{_ROOT / d}/" for d in ("fuzzer/support/standins", "fuzzer/mutants"))
_UNPACK = ("UNPACK_SEQUENCE", "UNPACK_EX")
# Not the call's site, so not shown: Target.observe (where every call is caught), the checks of vllm_calls.py.
_NOT_SHOWN = (f"{_ROOT / 'fuzzer/targets/base.py'}", f"{_ROOT / 'fuzzer/support/vllm_calls.py'}")


def moved_call(e: BaseException) -> str | None:
    """Where exception `e` says that a call attnfuzz makes into vLLM does not fit the installed release, that call,
    where it is made and what failed, in words; None where `e` is the code under test's own answer (raised inside
    vLLM, a kernel or a stand-in). Told by the exception's type and the frames that raised it, never by its
    message, as a reproducer's harness tells it (fuzzer/artifacts/repro_harness.py): raised in attnfuzz's own frame
    called from attnfuzz's own frame (not from vLLM's: vLLM calling a function attnfuzz wrapped is vLLM's call), a
    TypeError (arguments that do not bind: a keyword renamed, a parameter added; `CallMoved`: a return of another
    shape), an AttributeError or NameError (a method, attribute or function moved), an ImportError (a module moved),
    or a ValueError raised by the unpacking of what a call returned (a tuple of another length)."""
    frames, t = [], e.__traceback__
    while t is not None:
        if not t.tb_frame.f_code.co_filename.startswith("<frozen importlib"):  # an import's: the import statement's
            frames.append(t)
        t = t.tb_next
    if isinstance(e, AttributeError) and len(frames) > 1 and _module_getattr(frames[-1]):
        frames.pop()  # torch.nn.Module's attribute lookup: the frame that asked for the attribute raised it
    if not frames or not _ours(frames[-1]) or len(frames) > 1 and not _attnfuzz(frames[-2]):
        return None
    last = frames[-1]
    if isinstance(e, ValueError):
        code = last.tb_frame.f_code
        if next((i.opname for i in dis.get_instructions(code) if i.offset == last.tb_lasti), None) not in _UNPACK:
            return None
    elif not isinstance(e, (TypeError, AttributeError, NameError, ImportError)):
        return None
    shown = [f for f in frames[-2:] if _ours(f) and f.tb_frame.f_code.co_filename not in _NOT_SHOWN] or [last]
    return (" > ".join(f"{_where(f)} `{linecache.getline(f.tb_frame.f_code.co_filename, f.tb_lineno).strip()}`"
                       for f in shown) + f": {type(e).__name__}: {str(e).strip()[:400]}")


def unanswerable_device_query(e: BaseException) -> str | None:
    """Where exception `e` is a CPU host's torch refusing a device query vLLM made (the innermost frame in torch's
    `accelerator` or `cuda` package, and no CUDA error: "Cannot access accelerator device when none is available",
    "Torch not compiled with CUDA enabled"), that query and the vLLM line that made it, in words; None otherwise.
    A release that asks something new of the device meets this until attnfuzz answers it on a CPU (a shim in the
    backend's runtime): the case was not tested, which says nothing about vLLM. Told by type and frames, as
    `moved_call`; pinned memory, which torch refuses from C++, by the raising statement (`_pinned_memory_asked`)."""
    import torch

    tbs, t = [], e.__traceback__
    while t is not None:
        tbs.append(t)
        t = t.tb_next
    if not tbs or isinstance(e, getattr(torch, "AcceleratorError", ())):
        return None
    package = Path(torch.__file__).parent
    inside = [tb for tb in tbs if Path(tb.tb_frame.f_code.co_filename).is_relative_to(package)]
    last = Path(tbs[-1].tb_frame.f_code.co_filename)
    if not any(last.is_relative_to(package / sub) for sub in ("accelerator", "cuda")):
        return _pinned_memory_asked(e, tbs[-1])
    asked = inside[0] if inside else tbs[-1]
    caller = tbs[tbs.index(asked) - 1] if tbs.index(asked) > 0 else asked
    module = [p for p in Path(asked.tb_frame.f_code.co_filename).relative_to(package).with_suffix("").parts
              if p != "__init__"]
    query = ".".join(["torch", *module, asked.tb_frame.f_code.co_name])
    return (f"{query}() at {caller.tb_frame.f_code.co_filename}:{caller.tb_lineno}: "
            f"{type(e).__name__}: {str(e).strip()[:200]}")


def platform_unanswered(e: BaseException) -> str | None:
    """Where exception `e` is vLLM's platform class raising NotImplementedError from its base (the innermost frame in
    vllm/platforms/interface.py: `num_compute_units`, `get_device_name`, ... on a platform that does not implement
    them; a host whose vLLM detected no platform answers none), the method and the platform, in words; None
    otherwise. The host's, not the backend's: nothing about the code under test."""
    if not isinstance(e, NotImplementedError) or e.__traceback__ is None:
        return None
    tb = e.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    if not tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith("vllm/platforms/interface.py"):
        return None
    platform = tb.tb_frame.f_locals.get("cls") or tb.tb_frame.f_locals.get("self")
    name = getattr(platform, "__name__", type(platform).__name__)
    return f"{name}.{tb.tb_frame.f_code.co_name}: NotImplementedError: {str(e).strip()[:160]}"


def _pinned_memory_asked(e: BaseException, tb) -> str | None:
    """Where a statement of vLLM's asking for pinned memory (`pin_memory` in its text: `t.pin_memory()`,
    `torch.zeros(..., pin_memory=True)`) raised a plain RuntimeError on a host without CUDA: torch's C++ refusing it
    (no pinned-memory allocator there), with no Python frame of torch's to tell it by. The statement, in words."""
    import torch

    if type(e) is not RuntimeError or torch.cuda.is_available():
        return None
    filename, first = tb.tb_frame.f_code.co_filename, tb.tb_lineno
    last = next((end for start, end, *_ in tb.tb_frame.f_code.co_positions()
                 if start == first and end is not None), first)  # the raising call's last line
    statement = " ".join(linecache.getline(filename, n).strip() for n in range(first, max(first, last) + 1))
    if "pin_memory" not in statement:
        return None
    return f"pinned memory at {filename}:{first} ({statement[:120]}): {type(e).__name__}: {str(e).strip()[:200]}"


def _module_getattr(tb) -> bool:
    """torch.nn.Module.__getattr__'s frame (a layer's attribute it does not have: a method this release lacks)."""
    import torch

    return tb.tb_frame.f_code is torch.nn.Module.__getattr__.__code__


def _ours(tb) -> bool:
    """A frame of attnfuzz's code that calls vLLM."""
    name = tb.tb_frame.f_code.co_filename
    return name.startswith(_OURS) and not name.startswith(_THEIRS)


def _attnfuzz(tb) -> bool:
    """A frame of attnfuzz's own (the code under test's side, stand-ins and injected bugs, excluded)."""
    name = tb.tb_frame.f_code.co_filename
    return name.startswith(_PACKAGES) and not name.startswith(_THEIRS)


def _where(tb) -> str:
    return f"{Path(tb.tb_frame.f_code.co_filename).relative_to(_ROOT)}:{tb.tb_lineno}"
