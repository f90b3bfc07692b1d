"""The floors of README's layout: every attnfuzz import, those inside functions included, goes down a floor
(or stays inside its own package), and nothing imports in a cycle. Only targets, support and mutants import
vLLM."""

import ast
import collections
from pathlib import Path

from tests.conftest import ROOT

PACKAGES = ("strategies", "oracles", "fuzzer")
# The lower the number, the lower the floor. A module imports only from lower floors, or from its own package.
FLOORS = {
    "fuzzer": 3,  # the package itself (empty)
    "strategies": 1,
    "oracles": 2,
    "fuzzer.errors": 2.5,  # below every other leaf: all of them raise its errors
    "fuzzer.env": 3, "fuzzer.observation": 3, "fuzzer.budgets": 3, "fuzzer.repro_spec": 3,
    "fuzzer.support": 3, "fuzzer.mutants": 3,
    "fuzzer.records": 4,
    "fuzzer.targets": 5,
    "fuzzer.search": 6,
    "fuzzer.run": 7, "fuzzer.artifacts": 7,
    "fuzzer.commands": 8,
    "fuzzer.cli": 9,
}
VLLM_IMPORTERS = ("fuzzer.targets", "fuzzer.support", "fuzzer.mutants")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = p
    return mods


def _unit(module: str) -> str:
    """The FLOORS key a module belongs to (its package, or itself)."""
    return max((k for k in FLOORS if module == k or module.startswith(k + ".")), key=len)


def _imports(modules: dict[str, Path]):
    """(importer, imported module, line, import statement's top-level module) for every import in the tree."""
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")[: len(name.split(".")) - node.level + path.name.endswith("__init__.py")]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [module] + [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in modules]
            else:
                continue
            for t in targets:
                yield name, t, node.lineno


def test_imports_go_down_the_floors_and_never_cycle():
    modules = _modules()
    assert all(_unit(m) for m in modules)
    upward, graph = [], collections.defaultdict(set)
    for importer, imported, line in _imports(modules):
        if imported.split(".")[0] not in PACKAGES or imported not in modules or imported == importer:
            continue
        graph[importer].add(imported)
        a, b = _unit(importer), _unit(imported)
        if a != b and FLOORS[b] >= FLOORS[a]:
            upward.append(f"{modules[importer].relative_to(ROOT)}:{line}: {importer} ({a}, floor {FLOORS[a]}) "
                          f"imports {imported} ({b}, floor {FLOORS[b]})")
    assert not upward, "imports that do not go down a floor:\n" + "\n".join(upward)
    # Inside one package (e.g. fuzzer.run) imports may go sideways, but never around in a circle.
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [m, n]))
            if n not in state:
                visit(n, stack + [m])
        state[m] = 2

    for m in sorted(modules):
        if m not in state:
            visit(m, [])


def test_only_targets_support_and_mutants_import_vllm():
    modules = _modules()
    offenders = [f"{modules[m].relative_to(ROOT)}:{line}" for m, imported, line in _imports(modules)
                 if imported.split(".")[0] == "vllm" and not m.startswith(VLLM_IMPORTERS)]
    assert not offenders, "vLLM imported outside fuzzer/targets, fuzzer/support and fuzzer/mutants: " + ", ".join(offenders)


def test_support_modules_import_nothing_of_attnfuzz_but_support():
    """Reproducers ship fuzzer/support/ beside repro.py: it may import torch, triton, numpy, vLLM and itself."""
    modules = _modules()
    offenders = [f"{modules[m].relative_to(ROOT)}:{line}: {imported}" for m, imported, line in _imports(modules)
                 if m.startswith("fuzzer.support") and imported.split(".")[0] in PACKAGES
                 and not imported.startswith("fuzzer.support")]
    assert not offenders, "\n".join(offenders)


def test_attnfuzz_imports_sit_at_the_top_of_their_module():
    """An import inside a function hides a layering problem; the one reason to keep one is to delay
    `import vllm` (fuzzer.env must prepare the process first), and such a line says `# deferred: <why>`."""
    modules = _modules()
    inner = []
    for name, path in modules.items():
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                    if (module or "").split(".")[0] in PACKAGES and "# deferred:" not in lines[node.lineno - 1]:
                        inner.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not inner, "attnfuzz imports inside functions: " + ", ".join(inner)
