"""The floors of README's layout: every attnfuzz import, those inside functions included, goes down a floor
(or stays inside its own package), and nothing imports in a cycle. Only targets, support and mutants import
vLLM. A dynamic import of a name known where it is written (`importlib.import_module("a.b")`, `import_module(X)`
with `X = "a.b"` a module constant, `__import__("a.b")`) counts as `import a.b`."""

import ast
import collections
import functools
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
    "fuzzer.commands": 8, "fuzzer.api": 8,
    "fuzzer.cli": 9, "fuzzer.pytest_plugin": 9,
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


def _from_module(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The module a `from ... import` statement of module `name` (at `path`) imports from, relative ones resolved."""
    if not node.level:
        return node.module or ""
    base = name.split(".")[: len(name.split(".")) - node.level + path.name.endswith("__init__.py")]
    return ".".join(base + ([node.module] if node.module else []))


@functools.cache
def _constants(path: Path) -> dict[str, str]:
    """A module's top-level string constants (`NAME = "..."`, assigned once): what a dynamic import may name."""
    found: dict[str, list] = collections.defaultdict(list)
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            found[node.targets[0].id].append(node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            found[node.target.id].append(node.value)
    return {k: v[0].value for k, v in found.items()
            if len(v) == 1 and isinstance(v[0], ast.Constant) and isinstance(v[0].value, str)}


def _dynamic_imports(name: str, path: Path, tree: ast.Module, modules: dict[str, Path]):
    """(module, line) for each `importlib.import_module(S)`, `import_module(S)` (from importlib) and `__import__(S)`
    whose S is known where it is written: a string literal, a top-level string constant of this module, or one of an
    attnfuzz module this one imports (`from m import S`, `m.S`). A relative S resolves against this module's package
    (`package=__package__`)."""
    importlib_names, import_module_names = set(), {"__import__"}
    constant_names = dict(_constants(path))  # local name -> the string it holds
    module_aliases = {}  # local name -> an attnfuzz module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "importlib" or (a.name.startswith("importlib.") and not a.asname):
                    importlib_names.add(a.asname or "importlib")  # `import importlib.util` binds importlib too
                elif a.asname and a.name in modules:
                    module_aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            module = _from_module(name, path, node)
            for a in node.names:
                if module == "importlib" and a.name == "import_module":
                    import_module_names.add(a.asname or a.name)
                elif f"{module}.{a.name}" in modules:
                    module_aliases[a.asname or a.name] = f"{module}.{a.name}"
                elif module in modules and a.name in _constants(modules[module]):
                    constant_names[a.asname or a.name] = _constants(modules[module])[a.name]

    def known(arg: ast.expr) -> str | None:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
        if isinstance(arg, ast.Name):
            return constant_names.get(arg.id)
        if isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id in module_aliases:
            return _constants(modules[module_aliases[arg.value.id]]).get(arg.attr)
        return None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        f = node.func
        if not ((isinstance(f, ast.Name) and f.id in import_module_names)
                or (isinstance(f, ast.Attribute) and f.attr == "import_module" and isinstance(f.value, ast.Name)
                    and f.value.id in importlib_names)):
            continue
        module = known(node.args[0])
        if module is None:
            continue
        if module.startswith("."):
            level = len(module) - len(module.lstrip("."))
            base = package.split(".")[: len(package.split(".")) - level + 1]
            module = ".".join(base + ([module.lstrip(".")] if module.lstrip(".") else []))
        yield module, node.lineno


def _imports(modules: dict[str, Path]):
    """(importer, imported module, line) for every import in the tree, the dynamic ones known where they are
    written included."""
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = _from_module(name, path, node)
                targets = [module] + [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in modules]
            else:
                continue
            for t in targets:
                yield name, t, node.lineno
        for t, line in _dynamic_imports(name, path, tree, modules):
            yield name, t, line


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


def test_the_scanner_counts_dynamic_imports_known_where_they_are_written(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "names.py").write_text('MOD = "vllm.names_mod"\nTWICE = "vllm.a"\nTWICE = "vllm.b"\n')
    (pkg / "m.py").write_text('''
import importlib
import importlib as il
from importlib import import_module as im
from pkg import names
from pkg.names import MOD
import other

LOCAL = "vllm.local"


def f(x):
    importlib.import_module("vllm.literal")
    il.import_module("vllm.aliased")
    im("vllm.from_importlib")
    __import__("vllm.dunder")
    importlib.import_module(LOCAL)
    importlib.import_module(names.MOD)
    importlib.import_module(MOD + "")  # an expression: not known where it is written
    importlib.import_module(names.TWICE)  # assigned twice: not a constant
    importlib.import_module(x)
    importlib.import_module(f"vllm.{x}")
    importlib.import_module(".sibling", __package__)
    other.import_module("vllm.not_importlib")
''')
    modules = {"pkg": pkg / "__init__.py", "pkg.names": pkg / "names.py", "pkg.m": pkg / "m.py"}
    found = {(imported, line) for importer, imported, line in _imports(modules) if importer == "pkg.m"}
    static = {("importlib", 2), ("importlib", 3), ("importlib", 4), ("pkg", 5), ("pkg.names", 5), ("pkg.names", 6),
              ("other", 7)}
    dynamic = {("vllm.literal", 13), ("vllm.aliased", 14), ("vllm.from_importlib", 15), ("vllm.dunder", 16),
               ("vllm.local", 17), ("vllm.names_mod", 18), ("pkg.sibling", 23)}
    assert found == static | dynamic
