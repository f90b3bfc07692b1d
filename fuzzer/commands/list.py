"""`attnfuzz list`: the targets, the built-in mutants, and what this host can run."""

from __future__ import annotations

import sys

from fuzzer.env import host_info
from fuzzer.errors import ExitCode, UsageError
from fuzzer.mutants import MUTANTS, load
from fuzzer.run.host import import_vllm
from fuzzer.targets.registry import TARGETS


def add_parser(sub) -> None:
    sub.add_parser("list", help="targets, mutants and what this host can run")


def main(args, device: str) -> int:
    from rich.console import Console
    from rich.table import Table


    console = Console(width=None if sys.stdout.isatty() else 200)  # logs and pipes: never truncate names
    try:
        import_vllm()
    except UsageError as e:
        console.print(str(e))
    t = Table("target", "classes", "runs here", "what")
    for name, cls in TARGETS.items():
        why = cls(device).unavailable()
        t.add_row(name, cls.bug_classes, "yes" if why is None else f"no: {why}", cls.summary)
    console.print(t)
    m = Table("mutant (--inject)", "class", "targets", "what")
    for name in MUTANTS:
        mod = load(name)
        m.add_row(name, mod.BUG_CLASS, ", ".join(mod.TARGETS), (mod.__doc__ or "").split(":")[0].replace("\n", " "))
    console.print(m)
    h = host_info(device)
    console.print(f"host: {h.device} ({h.device_name}); vLLM {h.vllm}; torch {h.torch}; triton {h.triton}; "
                  f"Triton {'interpreted' if h.interpreted else 'compiled'}")
    return ExitCode.CLEAN
