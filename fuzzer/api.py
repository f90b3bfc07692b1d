"""attnfuzz as a library, for property tests in vLLM's own test suite (docs/library.md).

One import, `from fuzzer import api`, gives the pieces a campaign is made of, as Hypothesis strategies and plain
functions a test composes with `@given`:

- what a case is and how cases are drawn: `cases(target)` is the strategy a campaign draws on a registered target
  (its batches, traces, DCP splits or DeepSeek-V4 steps, with the knobs its swarms turn: `swarm=`, `swarms=True`);
  the composable strategies under it (`attention_cases` with `AttentionFeatures`, `index_cases`, `dsv4_space`, ...);
- the tensors a case materializes (`materialize_attention_inputs`, ...) and the engine-side ones vLLM's runner keeps
  (`paged_cache`, `cache_writer`, `common_attn_metadata`);
- the oracles that judge a call (`judge_attention`, `reference_for`, ...), and the registered target's own
  (`judge`), which fail the test with the finding and the path of the reproducer saved for it;
- `check(target, case)`: the case run through the target as a campaign runs it, and judged.

A failing case raises `FindingFailed` (an AssertionError), one subclass per failure signature, so that Hypothesis
shrinks each bug on its own; on Hypothesis's final replay of the shrunk case (or outside Hypothesis) the finding is
saved under `$ATTNFUZZ_STATE/findings` (default `.attnfuzz/findings`) with its reproducer, and the message names
the directory. A target that cannot run here raises `CouldNotTest`: the test fails with the reason, never passes.
Stand-ins for compiled ops this host lacks are said once per target and set of ops (`EmulatedWarning`).

Importing this module prepares the process for vLLM (`fuzzer.env.prepare_process`: on a CPU, Triton's interpreter
and no visible GPU), so it must come before anything imports vLLM; `ATTNFUZZ_DEVICE` (cpu or cuda) picks the
device, else the host's. `ATTNFUZZ_INJECT` (or the plugin's `--attnfuzz-inject`) names a built-in mutant applied
once the first target is prepared: process-wide and for good, for a red check of the test itself.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from hypothesis.control import current_build_context, currently_in_test_context

from fuzzer import mutants
from fuzzer.artifacts.finding_report import found_text
from fuzzer.artifacts.repro import write_repro
from fuzzer.env import STATE_DIR, host_info, prepare_process
from fuzzer.errors import CouldNotTest, EmulatedWarning, FindingFailed, MutantError, UsageError
from fuzzer.observation import Observation
from fuzzer.records import Finding
from fuzzer.run.host import import_vllm, make_target
from fuzzer.run.worker import run_and_judge
from fuzzer.targets.base import RunPlan, Target
from fuzzer.targets.harness import cache_writer, common_attn_metadata, new_token_slots, paged_cache
from fuzzer.targets.registry import TARGETS
from oracles.attention_judge import attention_tolerance, judge_attention, judge_layer, reference_for
from oracles.dcp import judge_dcp
from oracles.dsv4 import judge_dsv4
from oracles.index import judge_remap
from oracles.steps import judge_steps
from oracles.verdict import Verdict, primary
from strategies.batches import (
    AttentionFeatures,
    CaseSpace,
    IndexFeatures,
    attention_cases,
    attention_dcp_splits,
    attention_space,
    dcp_splits,
    index_cases,
    index_space,
)
from strategies.case import Case, Dcp, IndexCall, Request, TopkSpec
from strategies.dsv4_batches import V41_FEATURES, Dsv4Features, dsv4_space
from strategies.dsv4_tensors import Dsv4Inputs, materialize_dsv4_inputs
from strategies.profiles import PROFILES, Profile
from strategies.swarm import KNOBS, Knob, Swarm, coherent
from strategies.tensors import (
    HEAD_SIZE,
    KV_LORA_RANK,
    SM_SCALE,
    AttentionInputs,
    IndexInputs,
    LayerInputs,
    materialize_attention_inputs,
    materialize_index_inputs,
    materialize_layer_inputs,
    written_slots,
)
from strategies.traces import earlier_steps

__all__ = [
    # running and judging
    "device", "target", "targets", "check", "observe", "judge", "inject", "settings", "findings_dir",
    "CouldNotTest", "FindingFailed", "EmulatedWarning", "MUTANTS",
    # what a case is, and the strategies that draw it
    "cases", "case_space", "swarmed", "Case", "Request", "TopkSpec", "Dcp", "IndexCall", "CaseSpace",
    "AttentionFeatures", "IndexFeatures", "Dsv4Features", "V41_FEATURES", "attention_cases", "attention_space",
    "attention_dcp_splits", "dcp_splits", "index_cases", "index_space", "dsv4_space", "earlier_steps", "Profile",
    "PROFILES", "KNOBS", "Knob", "Swarm",
    # the tensors a case materializes, and the engine's
    "materialize_attention_inputs", "materialize_index_inputs", "materialize_layer_inputs", "materialize_dsv4_inputs",
    "AttentionInputs", "IndexInputs", "LayerInputs", "Dsv4Inputs", "written_slots", "paged_cache", "cache_writer",
    "common_attn_metadata", "new_token_slots", "HEAD_SIZE", "KV_LORA_RANK", "SM_SCALE",
    # the oracles
    "Verdict", "primary", "judge_attention", "judge_layer", "judge_steps", "judge_remap", "judge_dcp", "judge_dsv4",
    "reference_for", "attention_tolerance",
]



def _wanted_device() -> str | None:
    """ATTNFUZZ_DEVICE; else a process prepared for the CPU already (a conftest, a reproducer) stays on it; else None:
    what the host has."""
    if os.environ.get("ATTNFUZZ_DEVICE"):
        return os.environ["ATTNFUZZ_DEVICE"]
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


# Before anything imports vLLM (this module imports none of it): the device, and the process prepared for it.
DEVICE = prepare_process(_wanted_device())
INJECT_ENV = "ATTNFUZZ_INJECT"  # a built-in mutant applied once the first target is prepared
MUTANTS = tuple(mutants.MUTANTS)

# Per target, in this process: cases judged and when the first was (a finding's "after N cases (s)").
_judged: dict[str, list] = {}
_said: set[tuple[str, tuple[str, ...]]] = set()  # (target, ops) already said as emulated
EMULATED: dict[str, set[str]] = {}  # target -> every stand-in its checks ran on (the plugin's summary reads it)
_failures: dict[str, type[FindingFailed]] = {}
_first_failed: dict[tuple[str, str], tuple[int, float]] = {}  # (target, signature) -> (cases judged, seconds) then
_prepared: dict[str, Target] = {}
_injected: list[str] = []  # the mutant `inject` applied (what else patched vLLM in this process is not this module's)


def device() -> str:
    """The device this process was prepared for: "cpu" (Triton interpreted and bounds-checked, compiled ops
    replaced by attnfuzz's stand-ins) or "cuda"."""
    return DEVICE


def targets() -> tuple[str, ...]:
    """The registered targets' names (`attnfuzz list` says what each drives and what this host can run)."""
    return tuple(TARGETS)


def target(name: str) -> Target:
    """The registered target `name`, checked against this host and vLLM release and prepared (vLLM imported once;
    the release's API detected); then the mutant `ATTNFUZZ_INJECT` names applied, once per process. One object
    per name and process. CouldNotTest: it cannot run here (the reason)."""
    if name not in _prepared:
        try:
            import_vllm()
            _prepared[name] = make_target(name, DEVICE)
        except UsageError as e:
            raise CouldNotTest(str(e)) from e
        if os.environ.get(INJECT_ENV):
            inject(os.environ[INJECT_ENV])
    return _prepared[name]


def inject(mutant: str) -> str:
    """Apply a built-in mutant (`attnfuzz list` names them) to vLLM in this process: for good, process-wide, so
    only in a process of its own (`pytest --attnfuzz-inject MUTANT`, or ATTNFUZZ_INJECT). One mutant per process,
    applied once; the findings made after it name it and their reproducers carry it. A target prepared after it
    detects the release on patched code: prepare first."""
    if _injected and _injected[0] != mutant:
        raise CouldNotTest(f"mutant {mutant}: {_injected[0]} is applied in this process already (one per process)")
    if _injected:
        return mutant
    if mutant not in mutants.MUTANTS:
        raise CouldNotTest(f"mutant {mutant}: not a built-in mutant ({', '.join(mutants.MUTANTS)})")
    try:
        _injected.append(mutants.inject(mutant))
    except MutantError as e:
        raise CouldNotTest(str(e)) from e
    return mutant


def settings(**overrides) -> hypothesis_settings:
    """Hypothesis settings for cases that run vLLM: no deadline (an interpreted first case compiles nothing but
    takes seconds), no health check about slow or large draws; `overrides` as for `hypothesis.settings`."""
    return hypothesis_settings(**{"deadline": None, "suppress_health_check": [HealthCheck.too_slow,
                                                                              HealthCheck.data_too_large,
                                                                              HealthCheck.large_base_example],
                                  **overrides})


def findings_dir() -> Path:
    """Where a failing check saves its finding and reproducer: `$ATTNFUZZ_STATE/findings` (default
    `.attnfuzz/findings` under the working directory), as `attnfuzz run` saves them."""
    return (STATE_DIR / "findings").resolve()


# -- strategies ------------------------------------------------------------------------------------------------

def case_space(target_name: str, *, kv_cache_dtypes: tuple[str, ...] | None = None,
               cudagraph_modes: tuple[str, ...] | None = None, profile: str | Profile | None = None,
               max_steps: int | None = None) -> CaseSpace:
    """The cases a campaign draws on `target_name` on this release: the strategy under any swarm, and the knobs
    it turns (`CaseSpace.knobs`: knob -> its categories here). `kv_cache_dtypes`, `cudagraph_modes`: narrowed as
    `attnfuzz run --kv-cache-dtype/--cudagraph` narrows them; `profile`: case sizes ("cpu", "gpu", a Profile;
    default the device's); `max_steps`: steps per case for targets that run traces (1: single steps)."""
    t = target(target_name)
    for option, wanted, takes in (("kv_cache_dtypes", kv_cache_dtypes, t.kv_cache_dtypes),
                                  ("cudagraph_modes", cudagraph_modes, t.cudagraph_modes)):
        if wanted and not set(wanted) <= set(takes):
            raise ValueError(f"{option}={tuple(wanted)}: {target_name} takes {', '.join(takes) or 'none'}")
    p = profile if isinstance(profile, Profile) else PROFILES[profile or ("gpu" if DEVICE == "cuda" else "cpu")]
    if max_steps is not None:
        p = dataclasses.replace(p, max_steps=max_steps)
    return t.cases(p, RunPlan(kv_cache_dtypes=tuple(kv_cache_dtypes) if kv_cache_dtypes else None,
                              cudagraph_modes=tuple(cudagraph_modes) if cudagraph_modes else None))


def cases(target_name: str, *, swarm: Swarm | None = None, swarms: bool = False, **narrowing) -> st.SearchStrategy[Case]:
    """The strategy a campaign draws on `target_name` (`case_space`'s keywords narrow it). `swarm`: one swarm's
    pins (e.g. `Swarm((("decodes", "some"), ("prefills", "one")))`); `swarms=True`: each case draws its own swarm
    first (`swarmed`). Without either: the plain strategy. The target is prepared when the first case is drawn."""
    if swarm is not None and swarms:
        raise ValueError("swarm= pins one swarm, swarms=True draws one per case: not both")

    def build() -> st.SearchStrategy[Case]:
        space = case_space(target_name, **narrowing)
        return swarmed(space) if swarms else space.strategy(swarm)

    return st.deferred(build)


@st.composite
def swarmed(draw, space: CaseSpace) -> Case:
    """Swarm testing within one test: each case pins a random subset of the space's knobs, each to one of its
    categories (kept coherent: a pin's requirements pinned with it), then is drawn under that swarm. Shrinks toward
    no pins."""
    pins = {name: draw(st.sampled_from(values)) for name, values in space.knobs.items()
            if values and draw(st.booleans())}
    swarm = coherent(pins, space.knobs, random.Random(draw(st.integers(0, 2**16))))
    return draw(space.strategy(swarm))


# -- running and judging -----------------------------------------------------------------------------------------

def check(target_name: str, case: Case) -> tuple[Observation, list[Verdict]]:
    """Run `case` through the registered target as a campaign's case runs (every step of a trace, the cache poisoned,
    guard regions, on a CPU every interpreted access bounds-checked) and judge it with the target's oracle.
    Returns (observation, verdicts) when every check passes; FindingFailed otherwise."""
    __tracebackhide__ = True  # pytest shows the test's line, not attnfuzz's
    t = target(target_name)
    obs, verdicts = run_and_judge(t, case)
    _expect(t, case, obs, verdicts)
    return obs, verdicts


def observe(target_name: str, call: Callable[[], dict], *, emulated: tuple[str, ...] = ()) -> Observation:
    """What a test's own call of vLLM gave, observed as the target observes its calls: `call()` returns the
    outputs by name ({"out": ..., "lse": ...}, the names the target's oracle reads); an exception it raises is
    recorded, not raised, and on a CPU every out-of-bounds access of an interpreted kernel is recorded too.
    `emulated`: the stand-ins the call ran on (`prepare_host` returns them)."""
    obs = target(target_name).observe(call)
    obs.emulated = tuple(emulated)
    return obs


def judge(target_name: str, case: Case, obs: Observation) -> list[Verdict]:
    """The target's oracle on a test's own observation of `case`: the verdicts when every check passes,
    FindingFailed otherwise (its reproducer is the target's: the calls the target makes, on this case)."""
    __tracebackhide__ = True  # pytest shows the test's line, not attnfuzz's
    t = target(target_name)
    verdicts = t.oracle(case, obs)
    _expect(t, case, obs, verdicts)
    return verdicts


def _expect(t: Target, case: Case, obs: Observation, verdicts: list[Verdict]) -> None:
    __tracebackhide__ = True  # pytest shows the test's line, not attnfuzz's
    judged = _judged.setdefault(t.name, [0, time.monotonic()])
    judged[0] += 1
    _say_emulated(t.name, tuple(obs.emulated))
    failed = [v for v in verdicts if not v.ok]
    if not failed:
        return
    signature = primary(failed).signature
    in_hypothesis = currently_in_test_context()
    final = not in_hypothesis or current_build_context().is_final
    # "after N cases (s)": when this signature first failed in this process, not when its shrunk case was replayed
    first = _first_failed.setdefault((t.name, signature), (judged[0], time.monotonic() - judged[1]))
    finding = Finding(t.name, signature, case, failed, obs, host_info(DEVICE, tuple(obs.emulated)),
                      _injected[0] if _injected else None,
                      *first, shrunk=in_hypothesis and final)
    path = write_repro(finding, t, findings_dir()) if final else None
    # One exception type per signature: Hypothesis shrinks each bug on its own, as a campaign does.
    failure = _failures.setdefault(signature, type("FindingFailed", (FindingFailed,), {"signature": signature}))
    raise failure(found_text(finding, path), finding, path)


def _say_emulated(name: str, ops: tuple[str, ...]) -> None:
    if not ops:
        return
    EMULATED.setdefault(name, set()).update(ops)
    if (name, ops) not in _said:
        _said.add((name, ops))
        warnings.warn(EmulatedWarning(f"{name} ran on attnfuzz's stand-ins for ops this host lacks (emulated): "
                                      f"{', '.join(ops)}"), stacklevel=4)  # the test's call of check() or judge()
