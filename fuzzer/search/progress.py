"""Campaign progress on stderr: a live line on a terminal, a line every 50 cases elsewhere (CI logs)."""

from __future__ import annotations

import sys
import time

from rich.console import Console


class Progress:
    def __init__(self, label: str, quiet: bool = False) -> None:
        self.label, self.quiet = label, quiet
        self.console = Console(stderr=True)
        self._status = None
        self._t0 = time.monotonic()
        self._case_seconds = 0.0
        if not quiet and self.console.is_terminal:
            self._status = self.console.status(f"{label}: starting")
            self._status.start()

    def update(self, examples: int, findings: int, case_seconds: float) -> None:
        self._case_seconds += case_seconds
        if self.quiet:
            return
        elapsed = time.monotonic() - self._t0
        line = f"{self.label}: {examples} cases, {findings} finding(s), {examples / max(elapsed, 1e-9):.1f} cases/s"
        if self._status is not None:
            self._status.update(line)
        elif examples % 50 == 0:
            print(line, file=sys.stderr, flush=True)

    def done(self, result) -> None:
        if self._status is not None:
            self._status.stop()
