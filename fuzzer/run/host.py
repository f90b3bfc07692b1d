"""What this host can run: vLLM imported once per process, a target built and checked, every target's
availability. Shared by the commands that run cases (run, replay, list) and those that plan campaigns
(gate, selftest)."""

from __future__ import annotations

from fuzzer.errors import UsageError
from fuzzer.targets import vllm_api
from fuzzer.targets.base import Target, call_fault
from fuzzer.targets.registry import TARGETS


def import_vllm() -> str:
    """vLLM's version; once per process (7-20 s on the GPU host). UsageError when it is not importable."""
    try:
        return vllm_api.import_vllm()
    except Exception as e:
        raise UsageError(f"vLLM is not importable here ({type(e).__name__}: {e}); see README's set-up") from e


def make_target(name: str, device: str) -> Target:
    """The target, checked against this host and release, its release API detected (before any mutant)."""
    if name not in TARGETS:
        raise UsageError(f"unknown target {name!r}; known: {', '.join(TARGETS)}")
    target = TARGETS[name](device)
    why = target.unavailable()
    if why:
        raise UsageError(f"target {name} is not available here: {why}")
    try:
        target.prepare()
    except vllm_api.TargetUnavailable as e:  # what unavailable() did not look for: still this release's lack
        raise UsageError(f"target {name} is not available here: {e}") from e
    except Exception as e:
        call_fault(name, e)  # raises, where the set-up called vLLM as this release no longer takes it
        raise
    return target


def host_targets(device: str) -> tuple[dict[str, str | None], dict[str, tuple[str, ...]]]:
    """Each registered target -> why it cannot run here (None: it can), and its kv-cache dtypes."""
    unavailable, dtypes = {}, {}
    for name in TARGETS:
        try:
            cls = TARGETS[name]
        except Exception as e:  # a target whose module does not import here: that target cannot test, the rest can
            unavailable[name], dtypes[name] = f"its module does not import: {type(e).__name__}: {e}", ()
            continue
        target = cls(device)
        unavailable[name] = target.unavailable()
        dtypes[name] = tuple(target.kv_cache_dtypes)
    return unavailable, dtypes
