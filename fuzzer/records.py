"""The records a run leaves on disk, each read and written here and nowhere else.

- `finding.json` (a finding's directory, a campaign's pending findings): `Finding` is the live record a
  campaign makes; `FindingRecord` is what every consumer (gate, fleet, replay, selftest, report) reads back.
- the run summary (`run --json`, each fleet worker's summary.json, the fleet's own): `RunSummary`.
- `campaign.json` (`run --out`): `write_campaign_record` / `read_campaign_record`.

A malformed file raises `RecordError` naming the file and the field.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fuzzer.env import HostInfo
from fuzzer.errors import RecordError
from fuzzer.observation import Observation
from oracles.verdict import Verdict, primary
from strategies.case import Case

FINDING_STATUSES = ("open", "fixed")
RELEASE_OUTCOMES = ("present", "absent")
# What a known bug can need of a target before it counts as met there (finding.json "needs"; Declared.reaches).
FINDING_NEEDS = ("graph_replay",)
CAMPAIGN_SCHEMA = 1


def _read_json(path: Path) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise RecordError(f"{path}: {e.strerror or e}") from e
    except json.JSONDecodeError as e:
        raise RecordError(f"{path}: not JSON ({e})") from e
    if not isinstance(doc, dict):
        raise RecordError(f"{path}: expected a JSON object")
    return doc


def _write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")


# -- finding.json ----------------------------------------------------------------------------------------------

@dataclass
class Finding:
    """A failing case as the campaign that made it holds it (the observation and verdicts are live objects)."""
    target: str
    signature: str
    case: Case
    verdicts: list[Verdict]  # the failed ones
    observation: Observation
    host: HostInfo
    inject: str | None
    examples_to_find: int
    seconds_to_find: float
    has_repro: bool = True
    reruns: tuple[int, int] | None = None  # (times the signature came back, re-runs): flaky when fewer
    shrunk: bool = False  # Hypothesis shrank it (False: the first failing case, --no-shrink or cut short)

    @property
    def flaky(self) -> bool:
        return self.reruns is not None and self.reruns[0] < self.reruns[1]

    @property
    def host_out_of_memory(self) -> bool:
        """The CUDA context lost to "out of memory", and none of its re-runs on a fresh worker lost it again: the
        device was short (other processes on it, or what a sanitized worker had left), not the case. A case that runs
        out of memory every time stays a finding."""
        return (self.reruns is not None and self.reruns[0] == 0 and self.reruns[1] > 0
                and bool(self.observation.notes.get("out_of_memory")))

    @property
    def id(self) -> str:
        digest = hashlib.sha1(f"{self.signature}|{self.case.to_json(None)}".encode()).hexdigest()[:8]
        return f"{self.target.split('.')[-1].replace('_', '-')}-{digest}"

    @property
    def title(self) -> str:
        return primary(self.verdicts).detail

    def to_dict(self) -> dict:
        o = self.observation
        return {
            "id": self.id,
            "target": self.target,
            "signature": self.signature,
            "status": "open",
            "inject": self.inject,
            "bug_classes": sorted({v.bug_class for v in self.verdicts if v.bug_class}),
            "verdicts": [vars(v) for v in self.verdicts],
            "error": None if o.error_type is None else f"{o.error_type}: {o.error}",
            # where it raised: a crash finding's one clue when only finding.json comes back from a host
            "traceback": o.notes.get("traceback") if o.error_type is not None else None,
            "memory": [v.describe() for v in o.memory],
            "real": list(o.real),
            "emulated": list(o.emulated),
            "host": self.host.to_dict(),
            "examples_to_find": self.examples_to_find,
            "seconds_to_find": round(self.seconds_to_find, 2),
            "summary": self.case.summary(),
            "shrunk": self.shrunk,
            "found_on": {"vllm": self.host.vllm, "device": self.host.device},
            "reruns": None if self.reruns is None else {"reproduced": self.reruns[0], "of": self.reruns[1],
                                                        "flaky": self.flaky},
            "sanitizer": o.notes.get("sanitizer"),
        }

    @classmethod
    def from_record(cls, record: "FindingRecord", case: Case) -> "Finding":
        """A finding as it was saved (a resumed campaign's, a replayed one's): its observation holds only
        what finding.json keeps."""
        d = record.raw
        error_type, _, error = (d.get("error") or "").partition(": ")
        obs = Observation(record.target, record.host.get("device", "cpu"), error_type=error_type or None,
                          error=error or None, real=tuple(d.get("real", ())), emulated=tuple(d.get("emulated", ())),
                          notes={"resumed": True, **({"traceback": d["traceback"]} if d.get("traceback") else {})})
        host = HostInfo(**{k: tuple(v) if isinstance(v, list) else v for k, v in record.host.items()
                           if k in HostInfo.__dataclass_fields__})
        return cls(record.target, record.signature, case, list(record.failed), obs, host, record.inject,
                   record.examples_to_find, record.seconds_to_find, shrunk=bool(d.get("shrunk", False)))


def write_finding(path: Path, finding: Finding) -> None:
    _write_json(path, finding.to_dict())


def release_of(version: str) -> str:
    """'0.33.0' of '0.33.0', '0.33.0+cpu' or 'v0.33.0rc1'."""
    import re

    m = re.search(r"\d+(?:\.\d+)*", version)
    return m.group(0) if m else version


@dataclass(frozen=True)
class FindingRecord:
    """finding.json as read back. `releases` maps a vLLM release to what repro.py did there."""
    dir: Path  # the finding's directory
    id: str
    target: str
    signature: str
    status: str  # open | fixed
    releases: dict[str, str]
    inject: str | None
    bug_classes: tuple[str, ...]
    failed: tuple[Verdict, ...]
    host: dict
    examples_to_find: int
    seconds_to_find: float
    summary: str
    sanitizer: str | None
    raw: dict = field(repr=False, compare=False)
    needs: tuple[str, ...] = ()  # what a target must reach to meet this bug (FINDING_NEEDS), e.g. a graph replay

    @property
    def title(self) -> str:
        return primary(list(self.failed)).detail if self.failed else self.summary

    def expects_bug(self, vllm_version: str) -> bool:
        """Should repro.py show the bug on this release? Its record if it has one, else the status."""
        recorded = self.releases.get(release_of(vllm_version))
        return recorded == "present" if recorded else self.status == "open"


def verdicts_title(verdicts: list[dict]) -> str:
    """The primary failed check's detail, from verdicts as finding.json and run summaries hold them."""
    failed = [Verdict(**v) for v in verdicts if not v.get("ok", True)]
    return primary(failed).detail if failed else ""


def read_finding(path: Path) -> FindingRecord:
    """`path`: a finding.json or the directory holding one."""
    path = Path(path)
    if path.is_dir():
        path = path / "finding.json"
    d = _read_json(path)

    def need(key: str, kind, default: Any = ...) -> Any:
        value = d.get(key, default)
        if value is ...:
            raise RecordError(f"{path}: field {key!r} is missing")
        if value is not None and not isinstance(value, kind):
            names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise RecordError(f"{path}: field {key!r} must be {names}, not {type(value).__name__}")
        return value

    target = need("target", str)
    status = need("status", str, "open")
    if status not in FINDING_STATUSES:
        raise RecordError(f"{path}: field 'status' is {status!r}; expected one of {', '.join(FINDING_STATUSES)}")
    recorded = need("releases", dict, {})
    if any(v not in RELEASE_OUTCOMES for v in recorded.values()):
        raise RecordError(f"{path}: field 'releases' must map releases to \"present\" or \"absent\"")
    releases = {release_of(k): v for k, v in recorded.items()}
    host = need("host", dict, {}) or {}
    inject = need("inject", str, None)
    if host.get("vllm") and not inject:  # vLLM's own bug, seen on the release it was found on
        releases.setdefault(release_of(host["vllm"]), "present")
    try:
        verdicts = tuple(Verdict(**v) for v in need("verdicts", list, []))
    except TypeError as e:
        raise RecordError(f"{path}: field 'verdicts': {e}") from e
    needs = tuple(need("needs", list, []))
    if any(n not in FINDING_NEEDS for n in needs):
        raise RecordError(f"{path}: field 'needs' must list some of {', '.join(FINDING_NEEDS)}, not {list(needs)}")
    return FindingRecord(path.parent, need("id", str, path.parent.name), target, need("signature", str, ""), status,
                         releases, inject, tuple(need("bug_classes", list, [])),
                         tuple(v for v in verdicts if not v.ok), host, int(need("examples_to_find", int, 0)),
                         float(need("seconds_to_find", (int, float), 0.0)),
                         need("summary", str, ""), need("sanitizer", str, None), d, needs)


# -- the run summary --------------------------------------------------------------------------------------------

@dataclass
class RunSummary:
    """What `attnfuzz run --json PATH` writes: one campaign (a fleet worker's too), or a fleet's merge."""
    target: str
    seed: int
    examples: int
    seconds: float
    findings: list[dict]  # finding.json's fields, each with the path it was saved at
    inject: str | None = None
    profile: str = ""
    kv_cache_dtypes: list[str] = field(default_factory=list)
    cases_per_second: float = 0.0
    isolation: str = "worker"
    sanitizer: str | None = None
    workers_started: int = 0
    checks: dict[str, int] = field(default_factory=dict)
    host: dict = field(default_factory=dict)
    emulated: dict[str, int] = field(default_factory=dict)  # stand-in op -> cases it served
    real: dict[str, int] = field(default_factory=dict)
    allocator_poisoned: int = 0
    interrupted: bool = False  # cut short (SIGINT, SIGTERM): the exit code says so too
    interrupted_by: str | None = None
    shrink_cases: int = 0  # cases run while shrinking findings, on top of `examples`
    rerun_cases: int = 0  # findings' re-runs
    startup_seconds: float = 0.0  # from the command's start to the campaign's (imports, vLLM's set-up)
    search: str = "swarm"  # swarm or plain (fuzzer/search/campaign.py)
    # shares of the possible pairs and triples of knob categories the cases covered, vLLM paths seen, pairs of a
    # path and a knob category (fuzzer/search/combinations.py); a fleet's merge: the lowest of its workers
    coverage: dict = field(default_factory=dict)
    # where the campaign's wall time went, in seconds per stage (fuzzer/search/caselog.py STAGES)
    stage_seconds: dict = field(default_factory=dict)
    # `run --known`: cases per known open bug's signature, each a case that failed as that bug (not saved)
    known_hits: dict[str, int] = field(default_factory=dict)
    # cases not tested for the host's fault (Finding.host_out_of_memory): the run exits 2
    host_faults: list[str] = field(default_factory=list)
    # a fleet's merge only (None elsewhere, and left out of the file):
    database: str | None = None
    workers: list[dict] | None = None  # per worker: seed, GPU, exit, cases, seconds, log
    duplicates_merged: int | None = None
    known: list[dict] | None = None  # findings already in the signature index: counted, not saved again
    pending: list[dict] | None = None  # findings only a killed worker holds: its next run saves them
    mps: str | None = None  # `--mps`: "started" (the fleet's own daemon) or "already serving"

    _FLEET_ONLY = ("database", "workers", "duplicates_merged", "known", "pending", "mps")

    def write(self, path: Path) -> None:
        doc = asdict(self)
        for key in self._FLEET_ONLY:
            if doc[key] is None:
                del doc[key]
        _write_json(path, doc)

    @classmethod
    def read(cls, path: Path) -> "RunSummary":
        d = _read_json(path)
        missing = [k for k in ("target", "seed", "examples", "seconds", "findings") if k not in d]
        if missing:
            raise RecordError(f"{path}: field {missing[0]!r} is missing")
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


# -- campaign.json ----------------------------------------------------------------------------------------------

def write_campaign_record(path: Path, doc: dict) -> None:
    _write_json(path, dict(doc, schema=CAMPAIGN_SCHEMA))


def read_campaign_record(path: Path) -> dict:
    doc = _read_json(path)
    if doc.get("schema") != CAMPAIGN_SCHEMA:
        raise RecordError(f"{path}: field 'schema' is {doc.get('schema')!r}; this attnfuzz reads {CAMPAIGN_SCHEMA}")
    for key in ("target", "host", "examples", "coverage", "margins", "findings"):
        if key not in doc:
            raise RecordError(f"{path}: field {key!r} is missing")
    return doc
