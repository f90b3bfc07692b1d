"""Exit codes and the exceptions every layer raises; a leaf module, imported from anywhere.

0 tested and clean (at least one case ran, nothing found, not cut short), 1 findings, 2 could not test (usage,
environment, harness; a reproducer that could not run its call), 3 interrupted before it finished, nothing
found so far. Each command maps what it caught to one of them in one place (`fuzzer/cli.py`)."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    CLEAN = 0
    FOUND = 1
    USAGE = 2
    INTERRUPTED = 3


class UsageError(Exception):
    """Bad arguments or an environment that cannot test: exit 2, with this one-line message."""


class RecordError(UsageError):
    """A malformed on-disk record (finding.json, a run summary, campaign.json): names the file and field."""


class HarnessError(RuntimeError):
    """attnfuzz itself failed (not the code under test): the campaign stops with exit code 2."""


class HarnessFailure(RuntimeError):
    """attnfuzz's own code raised inside a worker process (its traceback is the message)."""


class HarnessConfigError(RuntimeError):
    """attnfuzz built vLLM's inputs incompletely for this release: a harness bug, never a finding."""


class WorkerError(RuntimeError):
    """A worker process could not be started or could not import what it needs: exit 2."""
