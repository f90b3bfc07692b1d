"""Where a command will write, checked before it runs anything: a report that cannot be written must not cost a
campaign first. Each check says why not in words, or None; the commands raise the usage error (exit 2)."""

from __future__ import annotations

import os
from pathlib import Path

from fuzzer.errors import UsageError


def unwritable(d: Path) -> str | None:
    """Why nothing can be written into directory `d` (made if missing), or None."""
    blocker = next((p for p in (d, *d.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        return f"{blocker} is a file, not a directory"
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".attnfuzz-write-check-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def unwritable_file(path: Path) -> str | None:
    """Why file `path` cannot be written (its directory made if missing), or None. An existing file is kept as it
    is (opened to append); one made by the check is removed."""
    path = Path(path)
    if path.is_dir():
        return "it is a directory"
    if why := unwritable(path.parent):
        return why
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def check_outputs(files: dict[str, Path | None] | None = None, dirs: dict[str, Path | None] | None = None) -> None:
    """UsageError naming the option, the path and the reason for the first output that cannot be written; `files`
    and `dirs` map an option (--json) to its path (None: not given)."""
    for option, path in (dirs or {}).items():
        if path is not None and path.exists() and not path.is_dir():
            raise UsageError(f"{option} {path}: exists and is not a directory")
        if path is not None and (why := unwritable(Path(path))):
            raise UsageError(f"{option} {path}: cannot write there ({why})")
    for option, path in (files or {}).items():
        if path is not None and (why := unwritable_file(Path(path))):
            raise UsageError(f"{option} {path}: cannot write there ({why})")
