"""The errors of strategies/: floor 1, below fuzzer/errors.py, and importing nothing of fuzzer/ (which re-exports
them), so they are defined here rather than there."""

from __future__ import annotations


class CaseError(ValueError):
    """A malformed case; the message starts with the path of the offending field."""
