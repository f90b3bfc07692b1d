"""`attnfuzz list`: the targets, the built-in mutants, and what this host can run.

By default it reads what each target declares (fuzzer/targets/declared.py) and imports neither vLLM nor torch:
a second or two, where importing vLLM alone takes 20-40 s on a 2-core host. What only vLLM can say (whether this
release has a target's modules and functions: its `unavailable()`) is then "not checked", and the output says so;
`--check` imports vLLM and asks every target.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from importlib.util import find_spec
from pathlib import Path

from fuzzer.env import host_info
from fuzzer.errors import ExitCode, UsageError
from fuzzer.mutants import MUTANTS, load
from fuzzer.run.host import host_targets, import_vllm
from fuzzer.targets.registry import TARGETS, declared

NOT_CHECKED = "not checked (--check)"


def add_parser(sub) -> None:
    p = sub.add_parser("list", help="targets, mutants and what this host can run")
    p.add_argument("--check", action="store_true",
                   help="import vLLM (20-40 s) and ask every target whether this host and release run it; without "
                        "it only what the targets declare is checked (their device and GPU needs, vLLM installed)")


def main(args, device: str) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)  # logs and pipes: never truncate names
    check = getattr(args, "check", False)
    if check:
        try:
            import_vllm()
        except UsageError as e:
            console.print(str(e))
    t = Table("target", "classes", "runs here", "what")
    checked = host_targets(device)[0] if check else {}
    for name in TARGETS:
        d = declared(name)
        why = checked[name] if check else declared_unavailable(d, device)
        t.add_row(name, d.bug_classes, "yes" if why is None else why if why == NOT_CHECKED else f"no: {why}",
                  d.summary)
    console.print(t)
    m = Table("mutant (--inject)", "class", "targets", "what")
    for name in MUTANTS:
        mod = load(name)
        m.add_row(name, mod.BUG_CLASS, ", ".join(mod.TARGETS), (mod.__doc__ or "").split(":")[0].replace("\n", " "))
    console.print(m)
    if check:
        h = host_info(device)
        console.print(f"host: {h.device} ({h.device_name}); vLLM {h.vllm}; torch {h.torch}; triton {h.triton}; "
                      f"Triton {'interpreted' if h.interpreted else 'compiled'}", highlight=False)
        return ExitCode.CLEAN
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    console.print(f"host: {device} ({device_name(device)}); vLLM {installed('vllm')}; torch {installed('torch')}; "
                  f"triton {installed('triton')}; Triton {'interpreted' if interpreted else 'compiled'}",
                  highlight=False)
    console.print(f"runs here: from what each target declares; '{NOT_CHECKED}': the target needs vLLM, which was "
                  f"not imported, so whether this release has what the target calls is not known. `attnfuzz list "
                  f"--check` imports vLLM (20-40 s) and asks each target.", highlight=False)
    return ExitCode.CLEAN


def declared_unavailable(d, device: str) -> str | None:
    """Why target `d` (its declarations) cannot run here as far as the host says without vLLM imported;
    NOT_CHECKED where only vLLM can say; None where nothing more is needed."""
    if device == "cuda" and (have := visible_gpus()) < d.cuda_gpus:
        return f"needs {d.cuda_gpus} GPUs; this host has {have}"
    if not d.needs_vllm:
        return None
    if find_spec("vllm") is None:  # finds the package without importing it
        return "vLLM is not installed (see README's set-up)"
    return NOT_CHECKED


def installed(distribution: str) -> str:
    """An installed distribution's version, from its metadata (nothing is imported)."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"


NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


def visible_gpus() -> int:
    """GPUs the driver lists, as CUDA_VISIBLE_DEVICES narrows them (torch is not imported to ask)."""
    found = len(list(NVIDIA_GPUS.iterdir())) if NVIDIA_GPUS.is_dir() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return found
    return min(found, len([v for v in visible.split(",") if v.strip()]))


def device_name(device: str) -> str:
    if device != "cuda":
        return platform.processor() or platform.machine()
    for info in sorted(NVIDIA_GPUS.glob("*/information")) if NVIDIA_GPUS.is_dir() else ():
        for line in info.read_text(errors="replace").splitlines():
            if line.startswith("Model:"):
                return line.partition(":")[2].strip()
    return "GPU"
