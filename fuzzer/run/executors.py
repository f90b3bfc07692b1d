"""Where a campaign's cases run. Each executor has `check(case) -> (observation, verdicts)`, `close()` and
`started` (worker processes started): the target in this process, in a worker process (`worker.py`: crash
isolation, compute-sanitizer), or natively with memcheck re-runs (`--sanitizer auto`)."""

from __future__ import annotations

from fuzzer.observation import Observation
from fuzzer.run.compute_sanitizer import EAGER_ONLY
from fuzzer.run.worker import WorkerExecutor, run_and_judge
from oracles.verdict import Verdict
from strategies.case import Case


class AutoSanitizedExecutor:
    """`--sanitizer auto`: cases run natively; a memcheck worker re-runs every failing case, every case that
    took a path not seen before (vLLM's route, the cache dtype, the fp8 path) and a sampled fraction, and its
    memory reports join that case's verdicts. A full-graph case is not re-run (EAGER_ONLY), and says so."""

    def __init__(self, native: WorkerExecutor, sanitized: WorkerExecutor, sample: float = 0.05, seed: int = 0):
        import random

        self.native, self.sanitized, self.sample = native, sanitized, sample
        self.rng = random.Random(seed)
        self.paths: set = set()
        self.rechecked = 0

    @property
    def started(self) -> int:
        return self.native.started + self.sanitized.started

    def start(self) -> dict:
        return self.native.start()

    @staticmethod
    def path_of(case: Case, obs: Observation) -> tuple:
        route = obs.notes.get("route", {})
        return (case.kv_cache_dtype, tuple(sorted((k, bool(v)) for k, v in route.items())),
                case.num_decodes > 0, case.num_tokens > case.num_decode_tokens)

    def check(self, case: Case) -> tuple[Observation, list[Verdict]]:
        obs, verdicts = self.native.check(case)
        path = self.path_of(case, obs)
        why = ("failed" if any(not v.ok for v in verdicts) else "new path" if path not in self.paths
               else "sampled" if self.rng.random() < self.sample else None)
        self.paths.add(path)
        if why is None:
            return obs, verdicts
        if case.cudagraph != "none":  # its capture would fail under memcheck, in attnfuzz's set-up
            obs.notes["memcheck_rerun"] = f"skipped ({why}, a full-graph case: {EAGER_ONLY})"
            return obs, verdicts
        self.rechecked += 1
        s_obs, s_verdicts = self.sanitized.check(case)
        memory = [v for v in s_verdicts if v.check == "memory" and not v.ok]
        obs.notes["memcheck_rerun"] = why
        if memory:
            obs.notes.update({k: s_obs.notes[k] for k in ("sanitizer", "sanitizer_log", "sanitizer_reports")
                              if k in s_obs.notes})
            verdicts = memory + [v for v in verdicts if not v.ok]
        return obs, verdicts

    def close(self) -> None:
        self.native.close()
        self.sanitized.close()


class InProcessExecutor:
    """The target in this process (tests, debugging): no isolation."""

    def __init__(self, target):
        self.target = target
        self.started = 0

    def check(self, case: Case) -> tuple[Observation, list[Verdict]]:
        return run_and_judge(self.target, case)

    def close(self) -> None:
        pass
