"""Stand-in modules put up under the names vLLM imports, for the span of a `with` block only."""

from __future__ import annotations

import contextlib
import importlib.machinery
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


def stand_in_module(name: str, package: bool, origin: str) -> types.ModuleType:
    """An empty module named `name` (a package when `package`) saying it is attnfuzz's stand-in from `origin`."""
    module = types.ModuleType(name, f"attnfuzz's stand-in for {name}, from {origin}")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []
    return module
