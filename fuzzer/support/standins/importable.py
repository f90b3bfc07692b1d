"""Stand-in modules put up under the names vLLM imports, for the span of a `with` block only."""

from __future__ import annotations

import contextlib
import sys
import types


@contextlib.contextmanager
def importable_as(modules: dict[str, types.ModuleType]):
    """`modules` ({name: module}) importable under their names inside the block; after it, sys.modules holds
    under those names what it held before (nothing where it held nothing), so later imports see no stand-in."""
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, before in saved.items():
            if before is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = before
