"""What each registered target declares at class level, read from its source file without importing it.

Importing a target imports torch (3 s on an idle 2-core host, far more on a loaded one) and checking one imports vLLM
(20-40 s); `attnfuzz list` and `run`'s argument checks need neither. A target's name, summary, bug classes, kv-cache
dtypes, CUDA-graph modes and what it needs of the host (`needs_vllm`, `cuda_gpus`) are plain literals on its class
or on a class it derives from, so they are read here with `ast`, inheritance followed as Python would (C3 order).
A declaration that is not a literal is read from the imported class instead (slow, never wrong); tests check that
every registered target reads statically and that what is read equals the imported class's attributes."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# The class attributes read here (fuzzer.targets.base.Target declares each with its default).
FIELDS = ("name", "summary", "bug_classes", "kv_cache_dtypes", "cudagraph_modes", "needs_vllm", "cuda_gpus",
          "runs_backend_of", "replays_graphs")
ROOTS = ("fuzzer", "strategies", "oracles")  # the packages whose classes are read (a base elsewhere declares none)


@dataclass(frozen=True)
class Declared:
    name: str
    module: str
    cls: str
    summary: str
    bug_classes: str
    kv_cache_dtypes: tuple[str, ...]
    cudagraph_modes: tuple[str, ...]
    needs_vllm: bool  # False: the target runs no vLLM (the harness self-test)
    cuda_gpus: int  # GPUs it needs on a CUDA host
    lineage: tuple[str, ...]  # "module:Class" of its class and each class it derives from (Python's MRO), itself first
    static: bool = True  # False: some declaration was not a literal and came from the imported class
    runs_backend_of: tuple[str, ...] = ()  # registered targets whose backend it runs (their known bugs are its own)
    replays_graphs: bool = False  # its "full" steps are replayed graphs, not eager runs

    @property
    def reaches(self) -> frozenset[str]:
        """What a known bug's finding.json may need (`needs`) that this target's cases can reach."""
        return frozenset({"graph_replay"} if self.replays_graphs and "full" in self.cudagraph_modes else ())

    def derives_from(self, other: Declared) -> bool:
        """issubclass(this target's class, other's class), without importing either."""
        return f"{other.module}:{other.cls}" in self.lineage


@dataclass(frozen=True)
class _Class:
    bases: tuple[str, ...]  # "module:Class" of the bases defined in attnfuzz's own modules (others define no FIELDS)
    attrs: dict  # FIELDS it assigns a literal to
    dynamic: frozenset[str]  # FIELDS it assigns something else to


@lru_cache(maxsize=None)
def _module_tree(module: str) -> tuple[ast.Module, str] | None:
    """The module's parsed source and its package, or None when it is not attnfuzz's own source file."""
    if module.split(".")[0] not in ROOTS:
        return None
    spec = importlib.util.find_spec(module)  # imports the parent packages only (fuzzer.targets: a docstring)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    package = module if spec.submodule_search_locations else module.rpartition(".")[0]
    return ast.parse(Path(spec.origin).read_text()), package


def _canonical(key: str) -> str | None:
    """The "module:Class" where the class named by `key` is defined (a re-export followed); None: not in attnfuzz's
    own source (abc.ABC and the like, which declare none of FIELDS)."""
    module, _, name = key.partition(":")
    parsed = _module_tree(module)
    if parsed is None:
        return None
    tree, package = parsed
    if any(isinstance(n, ast.ClassDef) and n.name == name for n in tree.body):
        return key
    imported = _imported(tree, package)
    return _canonical(imported[name]) if name in imported else None


def _imported(tree: ast.Module, package: str) -> dict[str, str]:
    """Local name -> "module:Name" for the module's `from ... import` statements."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for a in node.names:
                out[a.asname or a.name] = f"{base}:{a.name}"
    return out


@lru_cache(maxsize=None)
def _class(key: str) -> _Class:
    """The class at canonical `key`: its attnfuzz bases (canonical) and the FIELDS it assigns."""
    module, _, name = key.partition(":")
    tree, package = _module_tree(module)
    imported = _imported(tree, package)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    bases = []
    for b in node.bases:
        if isinstance(b, ast.Name):
            ref = _canonical(f"{module}:{b.id}") or (_canonical(imported[b.id]) if b.id in imported else None)
            if ref:
                bases.append(ref)
    attrs, dynamic = {}, set()
    for stmt in node.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            field, value = stmt.targets[0].id, stmt.value
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            field, value = stmt.target.id, stmt.value
        else:
            continue
        if field not in FIELDS:
            continue
        try:
            attrs[field] = ast.literal_eval(value)
        except ValueError:
            dynamic.add(field)
    return _Class(tuple(bases), attrs, frozenset(dynamic))


@lru_cache(maxsize=None)
def _mro(key: str) -> tuple[str, ...]:
    """C3 linearization over the attnfuzz classes (canonical keys), as Python orders them."""
    bases = list(_class(key).bases)
    seqs = [list(_mro(b)) for b in bases] + [bases]
    out = [key]
    while any(seqs):
        for seq in seqs:
            if seq and not any(seq[0] in s[1:] for s in seqs):
                head = seq[0]
                break
        else:
            raise TypeError(f"{key}: no consistent method resolution order")
        out.append(head)
        seqs = [s[1:] if s and s[0] == head else s for s in seqs]
    return tuple(out)


def read(ref: str) -> Declared:
    """The declarations of the target class at `ref` ("module:Class")."""
    key = _canonical(ref)
    if key is None:
        raise LookupError(f"{ref}: no such class in attnfuzz's source")
    lineage = _mro(key)
    values, dynamic = {}, set()
    for k in lineage:  # the first class in the MRO that sets a field wins
        c = _class(k)
        for field in FIELDS:
            if field in values or field in dynamic:
                continue
            if field in c.attrs:
                values[field] = c.attrs[field]
            elif field in c.dynamic:
                dynamic.add(field)
    if "runs_backend_of" not in dynamic:
        values.setdefault("runs_backend_of", ())  # (Target's default, for a base outside fuzzer.targets.base)
    if "replays_graphs" not in dynamic:
        values.setdefault("replays_graphs", False)
    missing = dynamic | (set(FIELDS) - values.keys())
    if missing:  # not literals (or not declared where they can be read): the imported class knows
        module, _, name = ref.partition(":")
        cls = getattr(importlib.import_module(module), name)
        values.update({f: getattr(cls, f) for f in missing})
    module, _, name = key.partition(":")
    return Declared(name=values["name"], module=module, cls=name, summary=values["summary"],
                    bug_classes=values["bug_classes"], kv_cache_dtypes=tuple(values["kv_cache_dtypes"]),
                    cudagraph_modes=tuple(values["cudagraph_modes"]), needs_vllm=bool(values["needs_vllm"]),
                    cuda_gpus=int(values["cuda_gpus"]), lineage=lineage, static=not missing,
                    runs_backend_of=tuple(values["runs_backend_of"]), replays_graphs=bool(values["replays_graphs"]))
