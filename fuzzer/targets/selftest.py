"""`selftest.fault`: a target that proves the campaign survives what a backend can do to its process.

Not a vLLM target: it runs no vLLM code and is listed only so that the isolation machinery (worker
replacement, the watchdog, the journal, flaky labels) can be exercised end to end, in CI and on the GPU host.
ATTNFUZZ_FAULT lists `fault:N` pairs (default "segfault:3"): on the N-th case a campaign sends it (counted
across worker replacements, in a file under the state directory) it does that fault:

  illegal-address  a Triton kernel stores far outside its tensor (GPU: the CUDA context is lost)
  segfault         the process gets SIGSEGV        abort   abort()        hang   sleeps forever
  oom              allocates until the OS or the allocator gives up
  device-lost      raises the error a lost CUDA context raises (torch's AcceleratorError, "CUDA error: out of
                   memory"), on any device
Every other case passes.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from fuzzer.env import STATE_DIR
from fuzzer.targets.base import WHOLE, RunPlan, Target
from oracles.verdict import Verdict, passed
from strategies.batches import IndexFeatures, index_space

FAULTS = ("illegal-address", "segfault", "abort", "hang", "oom", "device-lost")


def _judge(case, obs) -> list[Verdict]:
    if obs.error_type is not None:
        return [Verdict("error", False, f"{obs.error_type}: {obs.error}", where=obs.error_type)]
    return [passed("selftest", "no fault on this case")]


class SelftestFault(Target):
    name = "selftest.fault"
    summary = "harness self-test: faults on chosen cases (ATTNFUZZ_FAULT=segfault:3,hang:6); runs no vLLM"
    bug_classes = ""
    oracle = staticmethod(_judge)
    needs_vllm = False

    @staticmethod
    def plan() -> dict[int, str]:
        plan = {}
        for item in os.environ.get("ATTNFUZZ_FAULT", "segfault:3").split(","):
            fault, _, at = item.strip().partition(":")
            if fault not in FAULTS or not at.isdigit():
                raise ValueError(f"ATTNFUZZ_FAULT item {item!r}: want fault:N with fault one of {', '.join(FAULTS)}")
            plan[int(at)] = fault
        return plan

    def unavailable(self) -> str | None:
        try:
            self.plan()
        except ValueError as e:
            return str(e)
        return None

    def cases(self, profile, plan: RunPlan = WHOLE):
        return index_space(profile, IndexFeatures())

    def _count(self) -> int:

        path = Path(os.environ.get("ATTNFUZZ_FAULT_COUNTER", STATE_DIR / "selftest-fault-count"))
        n = int(path.read_text()) + 1 if path.exists() else 1
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(n))
        return n

    def run(self, case):
        fault = self.plan().get(self._count())
        return self.observe(lambda: self._fault(fault) if fault else {})

    def _fault(self, fault: str) -> dict:
        if fault == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
        elif fault == "abort":
            os.abort()
        elif fault == "hang":
            while True:
                time.sleep(60)
        elif fault == "oom":
            hog = []
            while True:
                hog.append(bytearray(1 << 30))
        elif fault == "illegal-address":
            _illegal_store(self.device)
        elif fault == "device-lost":  # what torch raises once the context is gone; the worker must be replaced
            import torch

            raise torch.AcceleratorError("CUDA error: out of memory")
        return {}


    def repro_spec(self, finding) -> None:
        return None  # no vLLM call to reproduce: `attnfuzz replay` re-runs the case


def _illegal_store(device: str) -> None:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def store_far(out_ptr, offset):
        tl.store(out_ptr + offset + tl.arange(0, 16), tl.full((16,), 7, tl.int32))

    out = torch.zeros(16, dtype=torch.int32, device=device)
    store_far[(1,)](out, 1 << 40)  # a terabyte past the tensor
    if device == "cuda":
        torch.cuda.synchronize()
