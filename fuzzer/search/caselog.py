"""What a campaign counts, case by case, as its cases run: vLLM's paths (coverage), error margins, verdicts,
real and emulated parts. The search steers by it; `run --out` writes it into campaign.json."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from fuzzer.search.combinations import Combinations
from oracles.verdict import primary

# A campaign's stages, in the order a case passes them (campaign.json's `stage_seconds`).
STAGES = {
    "search": "Hypothesis: drawing cases, its engine and example database (the batch's time outside the cases)",
    "transport": "the journal, and the round trip to the worker process (pickling, the socket, its device sync)",
    "harness": "the target around vLLM's calls: inputs materialized, cache and buffers set up, results checked",
    "calls": "the observed calls: the cache write and vLLM's build and forward, every step of a trace",
    "oracle": "the reference and the verdicts",
    "record": "counting the case (coverage, margins, knob combinations) and steering the search",
}
MAX_RECORDS = 20_000  # per-case records kept in campaign.json; counts and histograms cover every case


def margin_bin(m: float) -> str:
    """Half-decade bins of an error margin (error / tolerance; <= 1 passes): "k" is [10^(k/2), 10^((k+1)/2))."""
    if math.isnan(m) or math.isinf(m):
        return "nonfinite"
    if m <= 0:
        return "zero"
    return str(max(-16, min(8, math.floor(2 * math.log10(m)))))


def bin_label(key: str) -> str:
    if key in ("zero", "nonfinite"):
        return {"zero": "0", "nonfinite": "inf/nan"}[key]
    k = int(key)
    lo = 10 ** (k / 2)
    return ("<" if k == -16 else "≥" if k == 8 else "") + (f"{lo:.0e}" if k % 2 == 0 else f"{lo:.1e}").replace("e+0", "e").replace("e-0", "e-")


def bin_order(key: str) -> int:
    return -99 if key == "zero" else 99 if key == "nonfinite" else int(key)


@dataclass
class CaseLog:
    """Everything a campaign directory says about its cases, gathered as they run."""

    coverage: Counter = field(default_factory=Counter)  # path -> cases that took it
    path_sets: Counter = field(default_factory=Counter)  # the whole set of paths of a case -> cases
    first_seen: dict = field(default_factory=dict)  # path -> the case number that took it first
    margins: dict = field(default_factory=dict)  # check -> Counter(margin bin -> cases)
    verdicts: Counter = field(default_factory=Counter)  # "ok" or the failing signature -> cases
    real: Counter = field(default_factory=Counter)  # vLLM parts that ran for real -> cases
    emulated: Counter = field(default_factory=Counter)  # compiled ops replaced by attnfuzz stand-ins -> cases
    shims: Counter = field(default_factory=Counter)
    allocator_poisoned: int = 0  # cases run with the caching allocator's free memory poisoned (fuzzer/targets/guards.py)
    records: list = field(default_factory=list)
    dropped: int = 0  # records past MAX_RECORDS (still counted above)
    combinations: Combinations | None = None  # pairs and triples of knob categories covered (the campaign sets it)
    swarm: str | None = None  # the pins of the batch now running ("-": none; None: the plain search)
    # Where the campaign's wall time went, in seconds (STAGES says what each stage is).
    stage_seconds: Counter = field(default_factory=Counter)

    def add(self, case, obs, verdicts) -> dict:
        n = sum(self.verdicts.values()) + 1
        paths = sorted(obs.notes.get("paths", ()))
        self.coverage.update(paths)
        self.path_sets[" + ".join(paths) or "-"] += 1
        for p in paths:
            self.first_seen.setdefault(p, n)
        worst: dict[str, float] = {}
        for v in verdicts:
            if v.margin is not None and not (v.check in worst and worst[v.check] >= v.margin):
                worst[v.check] = float(v.margin)
        for check, m in worst.items():
            self.margins.setdefault(check, Counter())[margin_bin(m)] += 1
        failed = [v for v in verdicts if not v.ok]
        signature = primary(failed).signature if failed else "ok"
        self.verdicts[signature] += 1
        self.real.update(obs.real)
        self.emulated.update(obs.emulated)
        self.shims.update(obs.notes.get("shims", ()))
        self.allocator_poisoned += bool(obs.notes.get("allocator_poisoned"))
        record = {"n": n, "summary": case.summary(), "kv_cache_dtype": case.kv_cache_dtype, "heads": case.heads,
                  "num_blocks": case.num_blocks, "block_size": case.block_size,
                  "steps": len(case.steps), "seconds": round(obs.seconds, 4), "paths": paths,
                  "margins": {k: (round(m, 6) if math.isfinite(m) else str(m)) for k, m in worst.items()},
                  "verdict": signature}
        if self.combinations is not None:  # which knobs the case turned away from their plain category
            features = self.combinations.add(case, paths)
            knobs = self.combinations.knobs
            record["on"] = sorted(f"{k}={v}" for k, vs in features.items() if k in knobs for v in vs if v != knobs[k][0])
            record["swarm"] = self.swarm
        if len(self.records) < MAX_RECORDS:
            self.records.append(record)
        else:
            self.dropped += 1
        return record

    def time_case(self, obs, check: float, record: float) -> None:
        """Split one case's time: `check` (the journal and the executor's round trip) and `record` as the campaign
        measured them; the target, the oracle and the observed calls as they were measured where the case ran."""
        ran = obs.notes.get("stage_seconds", {})
        target, oracle = ran.get("target", 0.0), ran.get("oracle", 0.0)
        calls = obs.seconds + sum(s.seconds for s in obs.steps)
        self.stage_seconds.update({"calls": calls, "harness": max(0.0, target - calls), "oracle": oracle,
                                   "transport": max(0.0, check - target - oracle), "record": record})
        if self.records and not self.dropped:  # the case's record (added by `add`) gets its whole time too
            self.records[-1]["case_seconds"] = round(check + record, 4)

    def to_dict(self) -> dict:
        return {"stage_seconds": {k: round(self.stage_seconds[k], 3) for k in STAGES if k in self.stage_seconds},
                "coverage": dict(self.coverage.most_common()), "path_sets": dict(self.path_sets.most_common()),
                "first_seen": self.first_seen, "margins": {k: dict(v) for k, v in self.margins.items()},
                "verdicts": dict(self.verdicts.most_common()), "real": dict(self.real), "emulated": dict(self.emulated),
                "shims": dict(self.shims), "allocator_poisoned": self.allocator_poisoned,
                "combinations": self.combinations.summary() if self.combinations is not None else None,
                "records_dropped": self.dropped, "cases": self.records}
