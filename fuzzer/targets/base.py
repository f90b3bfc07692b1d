"""The target interface: a thing in vLLM that attnfuzz can call with a case.

A target knows vLLM; nothing else does. It says which cases it can take (a Hypothesis strategy built
from `strategies`), runs one case and returns an `Observation`, and names the oracle that judges it.
Add a target: one file in this folder, one line in `fuzzer/targets/registry.py`.
"""

from __future__ import annotations

import time
import traceback
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, ClassVar

from fuzzer.errors import (DeviceQueryUnanswered, HarnessConfigError, RankError, StandInUnmodelled, VllmCallMoved,
                           first_line)
from fuzzer.observation import Observation
from fuzzer.repro_spec import ReproSpec
from fuzzer.support.interp.sanitizer import SANITIZER, speed_up_interpreter
from fuzzer.targets.guards import poison_free_memory
from fuzzer.targets.vllm_api import moved_call, platform_unanswered, unanswerable_device_query, vllm_version
from oracles.verdict import Verdict
from strategies.batches import CaseSpace
from strategies.case import Case
from strategies.profiles import Profile


@dataclass(frozen=True)
class RunPlan:
    """What one run narrows a target's cases to (`run --kv-cache-dtype`, `run --cudagraph`): an argument of
    `Target.cases()`, never written onto the target, whose class attributes stay the metadata every run reads.
    None: every value the target takes."""

    kv_cache_dtypes: tuple[str, ...] | None = None
    cudagraph_modes: tuple[str, ...] | None = None

    def kv_dtypes(self, target: Target | type[Target]) -> tuple[str, ...]:
        """The kv-cache dtypes this run draws on `target` (an instance or its class)."""
        return tuple(self.kv_cache_dtypes or target.kv_cache_dtypes)

    def graph_modes(self, target: Target | type[Target]) -> tuple[str, ...]:
        """The engines' CUDA-graph modes this run draws on `target`."""
        return tuple(self.cudagraph_modes or target.cudagraph_modes)


WHOLE = RunPlan()  # no narrowing: every case the target takes


class Target(ABC):
    name: ClassVar[str]
    summary: ClassVar[str]
    bug_classes: ClassVar[str]  # letters of bug-classes.md this target can show
    oracle: ClassVar[Callable[[Case, Observation], list[Verdict]]]

    def __init__(self, device: str) -> None:
        self.device = device

    @abstractmethod
    def unavailable(self) -> str | None:
        """None when this host and vLLM release can run the target, else why not (in words)."""

    def prepare(self) -> None:
        """Detect what the installed vLLM offers; called once, before any mutant is injected."""

    # The attributes prepare() sets that cases() reads: a campaign whose cases run in a worker process plans
    # with what the worker's prepare() found, and never imports vLLM itself.
    PLANNED: ClassVar[tuple[str, ...]] = ()

    def plan_state(self) -> dict:
        return {name: getattr(self, name) for name in self.PLANNED}

    def adopt(self, plan: dict) -> None:
        for name in self.PLANNED:
            setattr(self, name, plan[name])

    @abstractmethod
    def cases(self, profile: Profile, plan: RunPlan = WHOLE) -> CaseSpace:
        """The cases this target takes on this vLLM release, as `plan` narrows them: a strategy per swarm, and
        the knobs it turns."""

    @abstractmethod
    def run(self, case: Case) -> Observation:
        """Run one case through vLLM's real code; never raise for what the code under test does."""

    @abstractmethod
    def repro_spec(self, finding) -> ReproSpec | None:
        """What a reproducer of `finding` needs, as data (fuzzer.repro_spec.ReproSpec): its tensors, constants and
        int literals, the support modules and vLLM calls it makes, the judge that checks the result; None: the
        target has no standalone reproducer. Only fuzzer.artifacts.repro renders."""

    # -- shared plumbing ---------------------------------------------------------------------------------
    def observe(self, call: Callable[[], dict], notes: dict | None = None) -> Observation:
        """Run `call` (which returns the outputs), capturing its exception and, on CPU, every
        out-of-bounds access the interpreter sanitizer saw."""
        obs = Observation(self.name, self.device, notes=dict(notes or {}), real=self.real_parts)
        start = time.perf_counter()
        if poison_free_memory(self.device):  # opt-in: what vLLM allocates and never writes then reads as NaN
            obs.notes["allocator_poisoned"] = True
        with memory_checked(self.device) as violations:
            try:
                # Judged where they are (the oracle moves what it needs): a GPU case's outputs reach tens of MB,
                # and a worker sends verdicts, not tensors. Other targets' oracles compare on the CPU.
                keep = (lambda v: v.detach()) if self.outputs_stay_on_device else (lambda v: v.detach().cpu())
                obs.outputs = {k: keep(v) for k, v in call().items() if v is not None}
            except AttributeError as e:
                harness_fault(self.name, e)  # raises, when the object that lacks the attribute is attnfuzz's
                call_fault(self.name, e)  # raises, when attnfuzz's call looked up what this vLLM does not have
                obs.error_type, obs.error = type(e).__name__, str(e)[:500]
                obs.notes["traceback"] = traceback.format_exc(limit=-8)
                lost, error = lost_device(e), e
            except Exception as e:  # the code under test raised: an observation, not our failure
                if getattr(type(e), "attnfuzz_refused", False):  # fuzzer.support.errors.StandInRefused (told by its
                    # class, whose module imports torch): a call form a stand-in does not model, so not tested
                    raise StandInUnmodelled(f"{self.name}: {e}") from e
                call_fault(self.name, e)  # raises, when attnfuzz's call into vLLM does not fit this release
                host_fault(self.name, e, self.device)  # raises, when vLLM asked a CPU host for a device
                obs.error_type, obs.error = type(e).__name__, first_line(e)[:500]
                obs.notes["traceback"] = traceback.format_exc(limit=-8)  # where vLLM raised, for the report
                lost, error = lost_device(e), e
            else:
                lost, error = False, None
            if self.device == "cuda":  # asynchronous CUDA errors surface here; the context may be gone after one
                import torch

                try:
                    torch.cuda.synchronize()
                except Exception as e:
                    lost = True  # the device fails every call now (after a launcher's plain RuntimeError too: Triton's)
                    error = error or e
                    if obs.error_type is None:
                        obs.error_type, obs.error = type(e).__name__, first_line(e)[:500]
            if lost:  # the case cost the process its CUDA context: a worker is replaced (fuzzer/run/worker.py)
                obs.notes["device_lost"] = True
                if out_of_device_memory(error):
                    obs.notes["out_of_memory"] = True
        obs.memory = list(violations)
        obs.seconds = time.perf_counter() - start
        return obs

    real_parts: ClassVar[tuple[str, ...]] = ()
    outputs_stay_on_device: ClassVar[bool] = False  # its oracle takes device tensors (no copy to the CPU per case)
    # Read-only metadata: a run narrows them through its RunPlan (`run --kv-cache-dtype`, `run --cudagraph`).
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = ()  # the cache dtypes its cases draw
    cudagraph_modes: ClassVar[tuple[str, ...]] = ("none",)  # the engines' CUDA-graph modes its cases draw
    # What it needs of the host, read without importing it (fuzzer/targets/declared.py: `attnfuzz list`): literals.
    needs_vllm: ClassVar[bool] = True  # False: it runs no vLLM (the harness self-test)
    cuda_gpus: ClassVar[int] = 1  # GPUs it needs on a CUDA host (a CPU host emulates what it needs)
    # Registered targets whose backend this one runs under another name (a module target on a backend's layer): a
    # known open bug of theirs, or of a target they are built over, is known here too (the gate's known_signature).
    runs_backend_of: ClassVar[tuple[str, ...]] = ()
    # Its "full" steps are captured and replayed as graphs (really on a GPU, emulated on a CPU), not run eagerly
    # under FULL's mode: a known bug that needs a replay (finding.json "needs": ["graph_replay"]) can meet it.
    replays_graphs: ClassVar[bool] = False



def harness_fault(target: str, e: AttributeError) -> None:
    """Raise a HarnessConfigError when the object `e` found lacking an attribute is one attnfuzz handed vLLM, told by
    the object's type (`e.obj`, set by Python's attribute lookup), never by the message: a config namespace
    (SimpleNamespace: attnfuzz built it without a field this vLLM reads) or torch's op namespace (this host's vLLM
    build lacks a compiled op, and attnfuzz has no stand-in for it). Anything else is the code under test's own
    AttributeError: an observation."""
    import torch

    if isinstance(e.obj, SimpleNamespace):
        raise HarnessConfigError(f"{target}: the config namespace lacks what this vLLM reads: {e}") from e
    if isinstance(e.obj, torch._ops._OpNamespace):
        raise HarnessConfigError(f"{target}: this host's vLLM lacks a compiled op and attnfuzz has no stand-in for "
                                 f"it: {e}") from e


def call_fault(target: str, e: BaseException) -> None:
    """Raise a VllmCallMoved when `e` says that attnfuzz's call into vLLM does not fit this release
    (`vllm_api.moved_call`: by the exception's type and the frame that raised it): nothing was judged, and the
    campaign could not test. Anything else is the code under test's answer: an observation."""
    if (moved := as_moved(target, e)) is not None:
        raise moved from e


def host_fault(target: str, e: BaseException, device: str) -> None:
    """Raise a DeviceQueryUnanswered when, on a CPU host, `e` is torch refusing a device query vLLM made
    (`vllm_api.unanswerable_device_query`): attnfuzz lacks the CPU shim that answers it, so the case was not tested;
    on any host, when it is vLLM's platform class saying it has no answer (`vllm_api.platform_unanswered`: a
    platform vLLM did not detect, or the CPU platform asked for a GPU's figure)."""
    if device == "cpu" and (why := unanswerable_device_query(e)) is not None:
        raise DeviceQueryUnanswered(f"{target} on vLLM {vllm_version()}: vLLM asked this CPU host for a device and "
                                 f"attnfuzz has no CPU answer for it (a shim in the backend's runtime): {why}") from e
    if (why := platform_unanswered(e)) is not None:
        raise DeviceQueryUnanswered(f"{target} on vLLM {vllm_version()}: vLLM's platform on this host does not "
                                    f"answer what the backend asked: {why}") from e


def as_moved(target: str, e: BaseException) -> VllmCallMoved | None:
    """`e` as the VllmCallMoved it is (or, raised outside `observe`, says it is); None where it says no such thing."""
    if isinstance(e, VllmCallMoved):
        return e
    if (why := moved_call(e)) is None:
        return None
    return VllmCallMoved(f"{target} on vLLM {vllm_version()}: a call into vLLM does not fit this release (a name, a "
                         f"keyword or the shape of what it returns moved): {why}")


def lost_device(e: BaseException, device: str | None = None) -> bool:
    """Whether the exception `e` cost this process its CUDA context, told by its type: torch raises every CUDA error
    as an AcceleratorError (torch >= 2.8; the stand-ins raise it too), and a RankError says whether a rank's
    error was one. With `device` "cuda", also a device that no longer synchronizes: a kernel launcher's plain
    RuntimeError (Triton's) leaves a context that fails every call after it."""
    import torch

    if isinstance(e, getattr(torch, "AcceleratorError", ())) or isinstance(e, RankError) and e.device_lost:
        return True
    if device == "cuda":
        try:
            torch.cuda.synchronize()
        except Exception:
            return True
    return False


def out_of_device_memory(e: BaseException | None) -> bool:
    """Whether `e` is the device running out of memory: PyTorch's allocator says so by type (OutOfMemoryError); a CUDA
    call's cudaErrorMemoryAllocation reaches Python only as an AcceleratorError whose text is that code's
    cudaGetErrorString (torch keeps no error code on it)."""
    import torch

    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, getattr(torch, "AcceleratorError", ())) and "CUDA error: out of memory" in str(e))


@contextmanager
def memory_checked(device: str):
    if device != "cpu":
        yield []  # native GPU runs: compute-sanitizer's job (fuzzer/run/compute_sanitizer), not ours
        return

    speed_up_interpreter()  # a campaign's many cases; a reproducer's one case goes without (fewer lines to read)
    with SANITIZER.install().collect() as found:
        yield found
