"""What of attnfuzz's support code a reproducer reaches, and nothing more.

A reproducer shows the support functions it calls (their source, copied into repro.py) and ships the rest of
what they use in its support file. `slice_support(roots)` follows, from (module, name) roots, every top-level
definition those names need in `fuzzer.support.*` (module-level names, `alias.attr` on imported support
modules, imports inside functions, `importlib.import_module("fuzzer.support...")`) and returns each module's
source cut down to those statements, in their own order. A support module's top-level statement that defines
nothing (a registration call) is always kept, with what it needs. A slice leaves out docstrings and comment-only
lines (a heading names the file they are in; a body that is a docstring only becomes `pass`): the reproducer's
support file is read for what it runs.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import inspect
import io
import textwrap
import tokenize
import types
from dataclasses import dataclass, field

SUPPORT_PACKAGE = "fuzzer.support"
_WHOLE = "*"  # a root that needs every statement of its module (the module object itself is used)


def is_support(module: str) -> bool:
    return module == SUPPORT_PACKAGE or module.startswith(SUPPORT_PACKAGE + ".")


def _is_package(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.submodule_search_locations is not None


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom in `module` names."""
    if not node.level:
        return node.module or ""
    package = module if _is_package(module) else module.rsplit(".", 1)[0]
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


@dataclass
class _Refs:
    """What one statement (or function) refers to: plain names, and uses of support modules."""

    names: set[str] = field(default_factory=set)
    needs: set[tuple[str, str]] = field(default_factory=set)  # (support module, name or _WHOLE)


def _skip_annotations(tree: ast.AST) -> None:
    """Drop annotations (never evaluated under `from __future__ import annotations`)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
            for a in [*node.args.args, *node.args.posonlyargs, *node.args.kwonlyargs, node.args.vararg, node.args.kwarg]:
                if a is not None:
                    a.annotation = None


def _submodules(module: str, node: ast.ImportFrom) -> dict[str, str]:
    """{name bound: support module} for `from fuzzer.support.package import submodule` in `module`."""
    base = _resolve(module, node)
    return {a.asname or a.name: f"{base}.{a.name}" for a in node.names
            if is_support(f"{base}.{a.name}") and _is_package(base) and importlib.util.find_spec(f"{base}.{a.name}")}


def module_aliases(module: str, tree: ast.Module) -> dict[str, str]:
    """{name: support module} for the support modules a module's top-level imports bind."""
    aliases = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            aliases.update(_submodules(module, node))
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if is_support(a.name) and a.asname})
    return aliases


def references(module: str, tree: ast.AST, lazy_annotations: bool, outer: dict[str, str] | None = None) -> _Refs:
    """The names `tree` loads and the support modules' members it uses (imports inside it resolved; `outer`:
    the module's own aliases of support modules)."""
    if lazy_annotations:
        _skip_annotations(tree)
    refs, aliases = _Refs(), dict(outer or {})
    for node in ast.walk(tree):  # imports first: aliases of support modules within this statement
        if isinstance(node, ast.ImportFrom):
            base, subs = _resolve(module, node), _submodules(module, node)
            aliases.update(subs)
            refs.needs |= {(full, "") for full in subs.values()}  # the import needs the module, whatever it uses
            if is_support(base):
                refs.needs |= {(base, a.name) for a in node.names if (a.asname or a.name) not in subs}
        elif isinstance(node, ast.Import):
            for a in node.names:
                if is_support(a.name):
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:  # `import fuzzer.support.x`: used as a dotted chain; keep the module whole
                        refs.needs.add((a.name, _WHOLE))
    attr_bases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            refs.needs.add((aliases[node.value.id], node.attr))
            attr_bases.add(id(node.value))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and is_support(node.args[0].value)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"):
            refs.needs.add((node.args[0].value, _WHOLE))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            if node.id in aliases and id(node) not in attr_bases:
                refs.needs.add((aliases[node.id], _WHOLE))
            else:
                refs.names.add(node.id)
    return refs


def _defined(stmt: ast.stmt) -> set[str]:
    """The module-level names a top-level statement binds."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {stmt.name}
    names = set()
    for node in ast.walk(stmt):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not stmt:
            names.add(node.name)  # defined under an if/try at top level
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


class _Module:
    def __init__(self, name: str):
        self.name = name
        self.source = inspect.getsource(importlib.import_module(name))
        self.lines = self.source.splitlines(keepends=True)
        tree = ast.parse(self.source)
        self.lazy = any(isinstance(s, ast.ImportFrom) and s.module == "__future__" for s in tree.body)
        self.stmts = tree.body
        self.aliases = module_aliases(name, tree)
        self.defines = [_defined(s) for s in self.stmts]
        self._refs: dict[int, _Refs] = {}
        tokens = tokenize.generate_tokens(io.StringIO(self.source).readline)
        self.comment_lines = {t.start[0] for t in tokens  # a comment alone on its line
                              if t.type == tokenize.COMMENT and not self.lines[t.start[0] - 1][: t.start[1]].strip()}

    def refs(self, i: int) -> _Refs:
        if i not in self._refs:
            self._refs[i] = references(self.name, _copy(self.stmts[i]), self.lazy, self.aliases)
        return self._refs[i]

    def always(self) -> list[int]:
        """Statements kept in any slice: the docstring, `from __future__`, registration calls."""
        keep = []
        for i, s in enumerate(self.stmts):
            docstring = i == 0 and isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
            future = isinstance(s, ast.ImportFrom) and s.module == "__future__"
            if docstring or future or (isinstance(s, ast.Expr) and not docstring):
                keep.append(i)
        return keep


def _copy(stmt: ast.stmt) -> ast.AST:
    return ast.parse(ast.unparse(stmt))


def slice_support(roots) -> dict[str, str]:
    """{support module: its source cut to what `roots` ((module, name) pairs; name "*" for all) reach}."""
    modules: dict[str, _Module] = {}
    kept: dict[str, set[int]] = {}
    imported: dict[tuple[str, int], set[str]] = {}  # a top-level `from support.x import a, b`: the names needed
    todo = list(roots)

    def want(module: str, i: int, name: str = "") -> None:
        stmt = modules[module].stmts[i]
        if isinstance(stmt, ast.ImportFrom) and is_support(_resolve(module, stmt)) and name:
            # Only the names needed of a support module's members: the rest of the statement is dropped.
            new = name not in imported.setdefault((module, i), set())
            imported[module, i].add(name)
            kept[module].add(i)
            if new:
                base = _resolve(module, stmt)
                alias = next(a for a in stmt.names if (a.asname or a.name) == name)
                full = f"{base}.{alias.name}"
                todo.append((full, "") if _is_package(base) and importlib.util.find_spec(full) else (base, alias.name))
            return
        if i in kept[module]:
            return
        kept[module].add(i)
        refs = modules[module].refs(i)
        todo.extend(refs.needs)
        todo.extend((module, n) for n in refs.names)

    while todo:
        module, name = todo.pop()
        if not is_support(module):
            continue
        if module not in modules:
            if _is_package(module) and module != SUPPORT_PACKAGE and name not in (_WHOLE, ""):
                sub = f"{module}.{name}"  # `from fuzzer.support.standins import flashmla_ops`
                if importlib.util.find_spec(sub) is not None:
                    todo.append((sub, _WHOLE))
                    continue
            modules[module] = _Module(module)
            kept[module] = set()
            for i in modules[module].always():
                want(module, i)
        mod = modules[module]
        for i, names in enumerate(mod.defines):
            if name == _WHOLE:
                for n in names or [""]:
                    want(module, i, n)
            elif name in names:
                want(module, i, name)
    return {name: _render(modules[name], kept[name], {i: ns for (m, i), ns in imported.items() if m == name})
            for name in sorted(modules)}


def _docstring(node: ast.AST) -> ast.Expr | None:
    body = node.body if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else None
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[0]
    return None


def _docstring_lines(stmt: ast.AST, lines: list[str], comment_lines: set[int]) -> dict[int, str]:
    """{line number (1-based): what it becomes ("" to leave it out)} for `stmt`'s docstrings and comment-only lines,
    and the blank lines right after a docstring; a docstring that is a whole body (an exception class's) becomes
    `pass`. A docstring on its definition's line stays."""
    end = stmt.end_lineno
    out = {n: "" for n in range(stmt.lineno, end + 1) if n in comment_lines}
    for node in ast.walk(stmt):
        doc = _docstring(node)
        if doc is None or doc.lineno == node.lineno:
            continue
        out.update({n: "" for n in range(doc.lineno, doc.end_lineno + 1)})
        if len(node.body) == 1:
            out[doc.lineno] = " " * doc.col_offset + "pass\n"
        after = doc.end_lineno + 1
        while after <= end and not lines[after - 1].strip():
            out[after] = ""
            after += 1
    return out


def without_docstrings(source: str) -> str:
    """`source` (one definition) without its docstrings and comment-only lines, as a slice leaves them out."""
    lines = source.splitlines(keepends=True)
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    comments = {t.start[0] for t in tokens if t.type == tokenize.COMMENT and not lines[t.start[0] - 1][: t.start[1]].strip()}
    tree = ast.parse(source)
    changed = {}
    for stmt in tree.body:
        changed.update(_docstring_lines(stmt, lines, comments))
    return "".join(changed.get(n, line) for n, line in enumerate(lines, start=1))


def _import_line(node: ast.ImportFrom, width: int = 120) -> str:
    """`from m import a, b` wrapped in parentheses past `width`."""
    line = ast.unparse(node)
    if len(line) <= width:
        return line
    head, names = line.split(" import ", 1)
    lines, cur = [], f"{head} import ("
    for k, name in enumerate(names.split(", ")):
        piece = name + (", " if k < len(node.names) - 1 else ")")
        if len(cur) + len(piece.rstrip()) > width:
            lines.append(cur.rstrip())
            cur = "    "
        cur += piece
    return "\n".join([*lines, cur])


_SIMPLE = (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr)


def _render(mod: _Module, keep: set[int], imported: dict[int, set[str]]) -> str:
    """The kept statements in their order, without docstrings and comment-only lines (the heading says where they
    are); a blank line around definitions, none between simple statements."""
    path = mod.name.replace(".", "/") + ".py"
    parts: list[tuple[bool, str]] = []  # (a simple statement, its text)
    for i, s in enumerate(mod.stmts):
        if i == 0 and _docstring(ast.Module(body=[s], type_ignores=[])) is not None:
            continue  # the module's docstring: the heading names the file
        if i in imported:  # a support import, cut to the names the slice needs
            names = [a for a in s.names if (a.asname or a.name) in imported[i]]
            parts.append((True, _import_line(ast.ImportFrom(module=s.module, names=names, level=s.level))))
        elif i in keep:
            start = min([s.lineno, *(d.lineno for d in getattr(s, "decorator_list", []))])
            changed = _docstring_lines(s, mod.lines, mod.comment_lines)
            text = "".join(changed.get(n, mod.lines[n - 1]) for n in range(start, s.end_lineno + 1))
            parts.append((isinstance(s, _SIMPLE), text.rstrip("\n")))
    reached = f"{len(keep)} of its {len(mod.stmts)}" if len(keep) < len(mod.stmts) else "all its"
    out = [f"# {path}: {reached} top-level statements (docstrings, comment lines: see there)"]
    for k, (simple, text) in enumerate(parts):
        if k == 0 or not (simple and parts[k - 1][0]):
            out.append("")
        out.append(text)
    return "\n".join(out) + "\n"


# -- the functions a reproducer shows ----------------------------------------------------------------------------

@dataclass
class Shown:
    """What repro.py needs to define a support function's copy: its source, and the import lines that give it
    the names it uses, and the support roots those imports reach."""

    source: str
    imports: list[tuple[str, str, object]]  # (import line, the name it binds, the object)
    roots: set[tuple[str, str]]


def shown(fn: types.FunctionType, others: set[str]) -> Shown:
    """`fn`'s source as repro.py shows it; `others`: the names of the functions shown beside it."""
    module = fn.__module__
    if not is_support(module):
        raise ValueError(f"a reproducer shows support functions only, not {module}.{fn.__qualname__}")
    if fn.__qualname__ != fn.__name__:
        raise ValueError(f"{module}.{fn.__qualname__}: a shown function is a module-level function")
    source = textwrap.dedent(inspect.getsource(fn))
    tree = ast.parse(source)
    lazy = getattr(fn.__globals__.get("annotations"), "compiler_flag", None) is not None  # __future__'s
    outer = module_aliases(module, ast.parse(inspect.getsource(inspect.getmodule(fn))))
    refs = references(module, tree, lazy, outer)
    imports, roots = [], set(refs.needs)
    params = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
    for name in sorted(refs.names - others - params):
        if name not in fn.__globals__:
            if hasattr(builtins, name) or _local(tree, name):
                continue
            raise ValueError(f"{module}.{fn.__name__} uses {name!r}, which its module does not define")
        value = fn.__globals__[name]
        if isinstance(value, types.ModuleType):
            # A support module its module's imports bind: `references` took the members used (whole if used bare).
            if is_support(value.__name__) and outer.get(name) != value.__name__:
                roots.add((value.__name__, _WHOLE))
            line = f"import {value.__name__}" if value.__name__ == name else f"import {value.__name__} as {name}"
        else:
            roots.add((module, name))
            line = f"from {module} import {name}"
        imports.append((line, name, value))
    return Shown(source, imports, roots)


def _local(tree: ast.AST, name: str) -> bool:
    """Whether `name` is bound inside the function (a local, a loop or comprehension variable, an import)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)) and node.id == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name).split(".")[0] == name
                                                                   for a in node.names):
            return True
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.ExceptHandler) and node.name == name:
            return True
    return False
