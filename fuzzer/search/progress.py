"""Campaign progress on stderr: a live line on a terminal; elsewhere (CI logs, pipes) a line after the first
case and then at most every PIPED_EVERY_S seconds."""

from __future__ import annotations

import sys
import time

from rich.console import Console

PIPED_EVERY_S = 10.0


class Progress:
    def __init__(self, label: str, quiet: bool = False) -> None:
        self.label, self.quiet = label, quiet
        self.console = Console(stderr=True)
        self._status = None
        self._t0 = time.monotonic()
        self._last_line: float | None = None
        self._case_seconds = 0.0
        if not quiet and self.console.is_terminal:
            self._status = self.console.status(f"{label}: starting")
            self._status.start()

    def update(self, cases: int, findings: int, case_seconds: float) -> None:
        self._case_seconds += case_seconds
        if self.quiet:
            return
        now = time.monotonic()
        line = f"{self.label}: {cases} cases, {findings} finding(s), {cases / max(now - self._t0, 1e-9):.1f} cases/s"
        if self._status is not None:
            self._status.update(line)
        elif self._last_line is None or now - self._last_line >= PIPED_EVERY_S:
            print(line, file=sys.stderr, flush=True)
            self._last_line = now

    def done(self, result) -> None:
        if self._status is not None:
            self._status.stop()
