"""What a campaign keeps on disk while it runs, so that a killed campaign loses nothing: each finding the
moment it is made (pending, until it is saved for good) and the case it is running (the journal). Both live
in the state directory, and the next campaign of the same target takes them back."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from fuzzer.errors import RecordError
from fuzzer.records import Finding, read_finding, write_finding
from strategies.case import Case, CaseError


class Pending:
    """`<dir>/<hash of target, injected bug and signature>/`: case.json and finding.json of one finding,
    rewritten as it shrinks. A campaign takes back only its own kind's: same target, same injected bug (a
    campaign of another mutant on the same target leaves them for their own campaign's next run)."""

    def __init__(self, directory: Path, target: str, inject: str | None = None) -> None:
        self.dir, self.target, self.inject = Path(directory), target, inject

    def _path(self, signature: str) -> Path:
        return self.dir / hashlib.sha1(f"{self.target}|{self.inject or ''}|{signature}".encode()).hexdigest()[:12]

    def save(self, finding: Finding) -> Path:
        d = self._path(finding.signature)
        d.mkdir(parents=True, exist_ok=True)
        (d / "case.json").write_text(finding.case.to_json() + "\n")
        write_finding(d / "finding.json", finding)
        return d

    def load(self) -> list[Finding]:
        """This target's pending findings as they were saved (a half-written one is skipped)."""
        found = []
        for path in sorted(self.dir.glob("*/finding.json")) if self.dir.exists() else ():
            try:
                record = read_finding(path)
                case = Case.from_json((path.parent / "case.json").read_text())
            except (RecordError, CaseError, OSError, ValueError):
                continue  # half-written when the campaign died
            if record.target == self.target and (record.inject or None) == (self.inject or None):
                found.append(Finding.from_record(record, case))
        return found

    def clear(self, findings: list[Finding]) -> None:
        """Called once these findings are saved for good."""
        for f in findings:
            shutil.rmtree(self._path(f.signature), ignore_errors=True)


class Journal:
    """The case a campaign is running, written before it runs; removed once it has a result."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def write(self, case: Case) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(case.to_json() + "\n")

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)

    def read(self) -> Case | None:
        if not self.path.exists():
            return None
        try:
            return Case.from_json(self.path.read_text())
        except (CaseError, OSError, ValueError):
            return None  # a half-written journal entry
