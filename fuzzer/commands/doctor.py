"""`attnfuzz doctor`: what this host can run, and why not: the vLLM it found (version and path), torch and Triton, the
GPUs, each target (as `attnfuzz list --check` asks them: their `unavailable()`), which compiled kernels are vLLM's own
and which are attnfuzz's stand-ins, and the sanitizers. Exit 0 when at least one target of vLLM runs here, 2 when
none does (nothing could be tested).
"""

from __future__ import annotations

import os
from importlib.util import find_spec
from pathlib import Path

from fuzzer.commands.list import NVIDIA_GPUS, installed
from fuzzer.errors import ExitCode, SanitizerUnavailable, UsageError
from fuzzer.run.compute_sanitizer import find_compute_sanitizer
from fuzzer.run.host import host_targets, import_vllm
from fuzzer.targets.registry import TARGETS, declared
from fuzzer.targets.vllm_api import kernels


def add_parser(sub) -> None:
    sub.add_parser("doctor", help="what this host can run and why not: vLLM, torch, Triton, GPUs, each target, "
                                  "real or stand-in kernels, sanitizers (exit 2: no target runs here)")


def main(args, device: str) -> int:
    out = []
    try:
        version = import_vllm()
        vllm = f"vLLM {version} at {Path(find_spec('vllm').origin).parent}"
    except UsageError as e:
        version, vllm = None, str(e)
    out += [vllm, f"torch {installed('torch')}, triton {installed('triton')}, device {device}"
            + (" (Triton interpreted)" if os.environ.get("TRITON_INTERPRET") == "1" else "")]
    gpus = host_gpus()
    out.append(f"GPUs: {len(gpus)}" + (f" ({', '.join(gpus)})" if gpus else "")
               + ("; this run uses none (--device cpu)" if gpus and device != "cuda" else ""))

    unavailable, _ = host_targets(device) if version else ({n: "vLLM is not importable here" for n in TARGETS}, {})
    of_vllm = [n for n in TARGETS if declared(n).needs_vllm]  # not the harness self-test: it tests no vLLM
    runs = [n for n in of_vllm if unavailable[n] is None]
    out.append(f"targets: {len(runs)} of {len(of_vllm)} run here")
    width = max(map(len, unavailable))
    out += [f"  {name:<{width}}  {'yes' if why is None else f'no: {why}'}" for name, why in unavailable.items()]

    out.append("kernels:")
    if version:
        out += [f"  {k.name}: {'real' if k.real else 'STAND-IN'} ({k.why})" for k in kernels(device)]
    else:
        out.append("  not known: vLLM is not importable here")
    out.append("sanitizers:")
    try:
        out.append(f"  compute-sanitizer: {find_compute_sanitizer()}"
                   + ("" if device == "cuda" else " (unused on the CPU: --device cuda)"))
    except SanitizerUnavailable as e:
        out.append(f"  compute-sanitizer: no ({e})")
    out.append("  Triton interpreter + attnfuzz's bounds checker: " + (
        "on (every Triton kernel interpreted, every load, store and atomic bounds-checked)"
        if os.environ.get("TRITON_INTERPRET") == "1" else "off (--device cpu turns it on)"))
    print("\n".join(out))
    if not runs:
        print("attnfuzz doctor: no target of vLLM runs here: nothing could be tested (exit 2)")
        return ExitCode.USAGE
    return ExitCode.CLEAN


def host_gpus() -> list[str]:
    """The GPUs the driver lists (their model names), whatever CUDA_VISIBLE_DEVICES says."""
    names = []
    for info in sorted(NVIDIA_GPUS.glob("*/information")) if NVIDIA_GPUS.is_dir() else ():
        model = next((ln.partition(":")[2].strip() for ln in info.read_text(errors="replace").splitlines()
                      if ln.startswith("Model:")), "GPU")
        names.append(model)
    return names
