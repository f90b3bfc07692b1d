"""Verdicts: what an oracle concludes about one observation. Plain data, comparable and printable."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    check: str  # memory | contract | error | values | count | set | layout | nan | output
    ok: bool
    detail: str
    bug_class: str = ""  # the letter of ../shared/docs/bug-classes.md this symptom points at, if any
    margin: float | None = None  # error / tolerance (<= 1 passes), where the check is numeric
    where: str = ""  # a stable location for deduplication (kernel+argument, row kind, ...)

    @property
    def signature(self) -> str:
        return f"{self.check}:{self.where}" if self.where else self.check


def passed(check: str, detail: str = "", margin: float | None = None) -> Verdict:
    return Verdict(check, True, detail, margin=margin)


# Which failed check names a finding: an out-of-bounds access outranks what follows from it.
PRIORITY = ("memory", "crash", "hang", "contract", "error", "cache", "cache_write", "gather", "dcp_filter", "dcp_empty_shard", "dcp_rank_lse", "nan", "empty_row", "count", "set", "layout", "values", "output", "lse")


def primary(failed: list[Verdict]) -> Verdict:
    return min(failed, key=lambda v: PRIORITY.index(v.check) if v.check in PRIORITY else len(PRIORITY))
