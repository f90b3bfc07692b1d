"""Render a finding's reproducer from the data its target hands over (`target.repro_spec(finding)`).

One skeleton for every target: a docstring saying what was found where, the step's constants and int
tensors as literals, `main()` running the target's snippets (prepare, the injected bug, setup, the vLLM
call under the interpreter's bounds check on a CPU), the judge the spec names (fuzzer/artifacts/
repro_judges.py, copied verbatim), and an exit code: 1 while the bug is present, 0 once fixed. The script
needs torch and vLLM (+ safetensors, numpy, triton) only: the attnfuzz support modules the call uses
(`fuzzer.support.*`, with every support module they import) go to one generated file beside it,
attnfuzz_support.py, which imports them under their own names; `write_standalone` inlines that file instead,
for a bug report upstream. An injected mutant's source is inlined at the end: it *is* the bug.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import re
from pathlib import Path
from typing import Mapping

from fuzzer.artifacts import repro_harness, repro_judges, slicer
from fuzzer.artifacts.finding_dir import save_finding
from fuzzer.artifacts.finding_report import sanitizer_run_line
from fuzzer.mutants import source
from fuzzer.repro_spec import Call, ReproSpec

SUPPORT_FILE = "attnfuzz_support.py"


def compact_list(xs: list[int]) -> str:
    """A short Python expression for a list of ints: runs become `[v] * n` and `list(range(a, b))`."""
    parts, i, lit = [], 0, []

    def flush():
        if lit:
            parts.append("[" + ", ".join(map(str, lit)) + "]")
            lit.clear()

    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[i]:
            j += 1
        if j - i >= 3:
            flush(); parts.append(f"[{xs[i]}] * {j - i + 1}"); i = j + 1; continue  # noqa: E702
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        if j - i >= 3:
            flush(); parts.append(f"list(range({xs[i]}, {xs[j] + 1}))"); i = j + 1; continue  # noqa: E702
        lit.append(xs[i])
        i += 1
    flush()
    return " + ".join(parts) if parts else "[]"


def tensor_literal(name: str, t) -> str:
    """`name = torch.tensor(...)` of a 1-d or 2-d int tensor, on DEVICE."""
    dtype = str(t.dtype).removeprefix("torch.")
    if t.dim() == 1:
        return f"{name} = torch.tensor({compact_list(t.tolist())}, dtype=torch.{dtype}, device=DEVICE)"
    rows = ",\n    ".join(compact_list(r) for r in t.tolist())
    return (f"{name} = torch.tensor([\n    {rows},\n], dtype=torch.{dtype}, device=DEVICE)"
            f".reshape({t.shape[0]}, {t.shape[1]})")


# -- the support file ------------------------------------------------------------------------------------------

_SUPPORT_LOADER = '''
class _SupportFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports the modules of SUPPORT under their own names (their parent packages empty), ahead of any
    installed attnfuzz, so that they import each other as they do inside attnfuzz; the rest of attnfuzz's
    package is out of reach, installed or not."""

    def find_spec(self, name, path=None, target=None):
        if name in SUPPORT or any(m.startswith(name + ".") for m in SUPPORT):
            return importlib.util.spec_from_loader(name, self, is_package=name not in SUPPORT)
        if any(name.startswith(m.split(".")[0] + ".") for m in SUPPORT):  # the rest of attnfuzz: never
            raise ModuleNotFoundError(f"No module named {name!r}: a reproducer has only attnfuzz's support code",
                                      name=name)
        return None

    def exec_module(self, module):
        if module.__name__ in SUPPORT:
            source, filename = SUPPORT[module.__name__], f"<attnfuzz_support: {module.__name__}>"
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # for tracebacks
            exec(compile(source, filename, "exec"), vars(module))


sys.meta_path.insert(0, _SupportFinder())
'''


def _harness() -> str:
    """fuzzer/artifacts/repro_harness.py as the support file carries it (its docstring said by the heading)."""
    source = inspect.getsource(repro_harness)
    return source[source.index('"""', 3) + 3:].lstrip("\n")


def judges_source(judge: str) -> str:
    """fuzzer/artifacts/repro_judges.py cut to the judge a reproducer calls (with its helpers), without docstrings
    as the slicer leaves them out (the heading names the file)."""
    functions = [slicer.without_docstrings(inspect.getsource(fn)) for fn in repro_judges.FUNCTIONS[judge]]
    return ("# fuzzer/artifacts/repro_judges.py: the check this reproducer runs (docstrings: see there)\n\n"
            "from __future__ import annotations\n\nimport torch\n\n\n" + "\n\n".join(functions))


def support_body(sources: dict[str, str]) -> str:
    """The harness, SUPPORT (each module's source as the reproducer needs it) and the finder that imports them."""
    entries = []
    for name, text in sources.items():
        if "'''" in text:
            raise ValueError(f"{name}: a support module's source may not hold ''' (it is inlined in r''' quotes)")
        entries.append(f"    {name!r}: r'''{text}''',")
    return ("# ---- the harness repro.py runs under (fuzzer/artifacts/repro_harness.py, verbatim) ----\n\n"
            + _harness() + "\n\n# ---- attnfuzz's modules, served under their own names ----\n\n"
            "import importlib.abc\nimport importlib.util\nimport linecache\n\n"
            "SUPPORT = {\n" + "\n".join(entries) + "\n}\n" + _SUPPORT_LOADER)


def support_file(sources: dict[str, str]) -> str:
    return ('"""attnfuzz\'s support code for repro.py beside it, generated: the harness repro.py runs under (exit\n'
            "codes), and of each module in SUPPORT the statements repro.py reaches, importable under the module's own\n"
            'name once this file is imported (as inside attnfuzz). Needs torch, numpy, triton and vLLM only."""\n\n'
            + support_body(sources))


# -- the script -----------------------------------------------------------------------------------------------

_CPU_ENV = """# CPU: Triton's interpreter (an empty CUDA_VISIBLE_DEVICES keeps vLLM from swapping Triton for a placeholder)
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["TRITON_INTERPRET"] = "1"
"""

_HARNESS_IMPORT = '''try:  # the harness beside this file (exit codes; vllms_answer: which errors are vLLM's answer)
    from attnfuzz_support import run, stage, verdict, vllm_call, vllms_answer  # noqa: F401
except ImportError as e:
    print(f"COULD NOT RUN (the imports): {e} - this says nothing about the bug (exit 2)")
    sys.exit(2)
'''

_MAIN = """
def main():
    with stage("the set-up"):  # a failure here is not the bug's answer
{body}{found}    with vllm_call({checker}) as call:  # what vLLM raises is its answer (judged below); ours: exit 2
{call}    problems = call.problems{plus_found}  # call.problems: what {saw} saw
{judge}{report}    return verdict(problems)  # prints each problem; 1: the bug present, 0: fixed
"""

_LOAD_TENSORS = 'T = load_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tensors.safetensors"), device=DEVICE)'
_SANITIZER = "fuzzer.support.interp.sanitizer"
_ENTRY = '''
if __name__ == "__main__":
    run(main)  # exits with main()'s code; 2: the check itself failed
'''


def _checker(spec: ReproSpec, sources: dict[str, str]) -> str:
    """What main() collects bounds-check reports from: SANITIZER (installed: every interpreted Triton load and store
    checked, and the stand-ins' own checks); else VIOLATIONS where the support code carried reports into it (a
    stand-in's own checks, the interpreted kernels unchecked); else nothing."""
    if spec.bounds_checked:
        return "SANITIZER"
    sliced = ast.parse(sources.get(_SANITIZER, ""))
    kept = {t.id for n in sliced.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    return "VIOLATIONS" if "VIOLATIONS" in kept else ""


def _saw(verdicts) -> list[str]:
    """What attnfuzz saw, as comments: one line for one verdict."""
    lines = [f"{v.check}: {v.detail}" for v in verdicts]
    return [f"# What attnfuzz saw: {lines[0]}"] if len(lines) == 1 else ["# What attnfuzz saw:", *(f"#   {ln}" for ln in lines)]


def _indent(code: str, n: int) -> str:
    """`code`'s lines indented by n, each ending in a newline ("" for no code)."""
    lines = code.strip("\n").splitlines()
    return "".join((" " * n + ln if ln.strip() else "") + "\n" for ln in lines) if code.strip() else ""


def _arguments(fn, given: Mapping[str, str], what: str) -> str:
    """`fn`'s arguments from `given` (parameter -> expression), in its parameter order: positional while each
    expression is the parameter's own name, by keyword after."""
    params = inspect.signature(fn).parameters
    if (unknown := set(given) - set(params)) and not any(v.kind is v.VAR_KEYWORD for v in params.values()):
        raise ValueError(f"{what}: no parameter {', '.join(sorted(unknown))}")
    if missing := [p for p, v in params.items() if p not in given and v.default is inspect.Parameter.empty
                   and v.kind not in (v.VAR_POSITIONAL, v.VAR_KEYWORD)]:
        raise ValueError(f"{what}: no expression for {', '.join(missing)}")
    args, keyword = [], False
    for p in (p for p in params if p in given):
        keyword = keyword or given[p] != p or params[p].kind is inspect.Parameter.KEYWORD_ONLY
        args.append(f"{p}={given[p]}" if keyword else p)
    return ", ".join([*args, *(f"{p}={given[p]}" for p in given if p in unknown)])


def _expression(value) -> str:
    """A Call's argument as main() writes it: an expression, a support function passed by its name, or a tuple of
    them."""
    if isinstance(value, tuple):
        return "(" + ", ".join(_expression(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return value if isinstance(value, str) else value.__name__


def _line(call: Call, width: int = 100) -> str:
    """A Call as main()'s line (its arguments wrapped past `width`), its note as a comment above it."""
    head = f"{call.assign} = " if call.assign else ""
    given = {p: _expression(v) for p, v in call.args.items()}
    args = _arguments(call.fn, given, call.fn.__name__).split(", ")
    lines, line = [], f"{head}{call.fn.__name__}("
    for k, arg in enumerate(args):
        piece = arg + (", " if k < len(args) - 1 else ")")
        if len(line) + len(piece.rstrip()) > width and line.strip().endswith(","):
            lines.append(line.rstrip())
            line = "    "
        line += piece
    if not args or args == [""]:
        line = f"{head}{call.fn.__name__}()"
    return (f"# {call.note}\n" if call.note else "") + "\n".join([*lines, line])


def _judge_call(spec: ReproSpec) -> str:
    """`judge_<name>(...)` on the spec's expressions, in the function's parameter order."""
    fn = repro_judges.FUNCTIONS[spec.judge.name][-1]
    given = dict(spec.judge.args, **({"error": "call.error"} if spec.judge.name == "index_contract" else {}))
    return f"{fn.__name__}({_arguments(fn, given, f'judge {spec.judge.name}')})"


def _header(finding, spec: ReproSpec, support: str) -> str:
    host, run = finding.host, sanitizer_run_line(finding)
    where = {"file": f"The harness, attnfuzz's support code it uses and the check are in {SUPPORT_FILE} beside it.\n",
             "inline": "The harness, attnfuzz's support code it uses and the check are inlined above.\n"}[support]
    return (f'#!/usr/bin/env python3\n"""attnfuzz reproducer {finding.id}: {finding.title[:150]}\n\n'
            f"Found by attnfuzz target `{finding.target}` on vLLM {host.vllm}, {host.device} ({host.device_name})"
            + (f", with the injected bug `{finding.inject}` (inlined below)" if finding.inject else "") + ".\n"
            + spec.about.strip("\n") + "\n" + where
            + "Run:  python repro.py   (torch + vLLM only; exit 1: bug present, 0: fixed, 2: could not run the call)\n"
            + (f"This is a memory error that compute-sanitizer sees; run it so:\n  {run}\n"
               "Run plainly, the script may look clean on the GPU: it prints that command.\n" if run else "")
            + '"""\n'
            + (f'print("attnfuzz: this bug shows under compute-sanitizer:  {run}")\n' if run else ""))


def _shown(spec: ReproSpec):
    """The functions main() calls: those of the vLLM calls (`spec.call`) shown in repro.py, each once in order
    of use; those of prepare and setup, and those passed as arguments, imported from the support file. Returns
    the shown ones with their sources, the import lines repro.py needs, and the support roots its support file
    must carry."""
    fns = list(dict.fromkeys(c.fn for c in spec.call))  # the vLLM calls: shown
    passed = [f for c in (*spec.prepare, *spec.setup, *spec.call) for v in c.args.values() if not isinstance(v, str)
              for f in (v if isinstance(v, tuple) else (v,))]
    helpers = list(dict.fromkeys(f for f in (*(c.fn for c in (*spec.prepare, *spec.setup)), *passed)
                                 if f not in fns))  # imported
    names = {fn.__name__ for fn in (*fns, *helpers)}
    if len(names) != len(fns) + len(helpers):
        raise ValueError("a reproducer calls two support functions of one name")
    for fn in helpers:
        if not slicer.is_support(fn.__module__):
            raise ValueError(f"a reproducer calls support functions only, not {fn.__module__}.{fn.__qualname__}")
    shown = [slicer.shown(fn, names) for fn in fns]
    imports = [i for s in shown for i in s.imports]
    imports += [(f"from {fn.__module__} import {fn.__name__}", fn.__name__, fn) for fn in helpers]
    roots = {r for s in shown for r in s.roots} | {(fn.__module__, fn.__name__) for fn in helpers}
    if spec.bounds_checked:
        imports.append((f"from {_SANITIZER} import SANITIZER", "SANITIZER", None))
        roots.add((_SANITIZER, "SANITIZER"))
    bound: dict[str, tuple[str, object]] = {}
    for line, name, value in imports:  # one meaning per name in repro.py (one object imported by two modules: once)
        first = bound.setdefault(name, (line, value))
        if first[0] != line and first[1] is not value:
            raise ValueError(f"two shown functions mean different things by {name!r}: {first[0]!r}, {line!r}")
    return list(zip(fns, shown)), [ln for ln, _ in bound.values()], roots


def _grouped(lines: list[str], width: int = 116) -> list[str]:
    """Import lines, `from m import a` of one module joined (wrapped past `width`), plain imports first."""
    plain = sorted({ln for ln in lines if not ln.startswith("from ")})
    names: dict[str, list[str]] = {}
    for ln in lines:
        if ln.startswith("from "):
            module, name = ln[5:].split(" import ")
            names.setdefault(module, []).append(name)
    joined = []
    for module in sorted(names):
        line, wrapped = f"from {module} import ", []
        for k, name in enumerate(sorted(set(names[module]))):
            if k and len(line) + len(name) + 2 > width:
                wrapped.append(line.rstrip())
                line = " " * 4
            line += name + ", "
        wrapped.append(line.removesuffix(", "))
        joined.append(wrapped[0] if len(wrapped) == 1 else
                      wrapped[0].replace(" import ", " import (", 1) + "\n" + "\n".join(wrapped[1:]) + ")")
    return plain + joined


def render(finding, spec: ReproSpec, standalone: bool = False) -> dict[str, str]:
    """The reproducer's files: repro.py, and attnfuzz_support.py beside it (the harness, the support code it uses
    and the check; `standalone`: inlined into repro.py instead)."""
    cpu = finding.host.device == "cpu"
    functions, support_imports, roots = _shown(spec)
    sources = slicer.slice_support(roots) if roots else {}
    checker = _checker(spec, sources)
    if checker == "VIOLATIONS":
        support_imports.append(f"from {_SANITIZER} import VIOLATIONS")
    judge = spec.judge.name
    fn = repro_judges.FUNCTIONS[judge][-1]
    if not standalone:  # served beside repro.py (standalone: the check's source closes the script)
        sources["fuzzer.artifacts.repro_judges"] = judges_source(judge)
        support_imports.append(f"from fuzzer.artifacts.repro_judges import {fn.__name__}")
    support_imports = _grouped(support_imports)
    body = [_line(c) for c in spec.prepare]
    if spec.bounds_checked:
        body.append("SANITIZER.install()  # bounds checks on every interpreted Triton load/store")
    if finding.inject:
        body.append("apply()  # the injected bug")
    body += [_LOAD_TENSORS if spec.tensors else "", *(_line(c) for c in spec.setup)]
    judge_lines = (f"problems += {_judge_call(spec)}\n" if judge == "index_contract" else
                   "if call.error is not None:\n    problems.append(call.raised)\n"
                   f"else:\n    problems += {_judge_call(spec)}\n")
    report = "".join(f"print({label!r}, {expr})\n" for label, expr in spec.report.items())
    uses_found = any(re.search(r"\bfound\b", _expression(e)) for c in (*spec.call, spec.judge) for e in c.args.values())
    stdlib = ["import os"] * (cpu or bool(spec.tensors)) + ["import sys"] * (not standalone)
    # Not vLLM: the bounds checker is installed before vLLM's kernels are imported (main() does both).
    plain = sorted({"import torch", *(ln for ln in support_imports if not ln.startswith("from "))})
    imports = [*plain, *(["from safetensors.torch import load_file"] if spec.tensors else []),
               *(ln for ln in support_imports if ln.startswith("from "))]
    guarded = ("with stage(\"the imports\"):  # torch, vLLM and attnfuzz's support code\n"
               + _indent("\n".join(imports), 4))
    harness = (f"\n# ---- {SUPPORT_FILE}, inlined: the harness, attnfuzz's support code this script reaches ----\n\n"
               + support_body(sources) + "\n") if standalone else _HARNESS_IMPORT
    module = ["\n".join(stdlib) + "\n" if stdlib else "", _CPU_ENV if cpu else "", harness, guarded,
              "\n".join([f'DEVICE = "{"cpu" if cpu else "cuda"}"', *(f"{k} = {v!r}" for k, v in spec.constants.items()),
                         *_saw(finding.verdicts)]) + "\n",
              "\n".join(tensor_literal(k, t) for k, t in spec.literals.items()) + "\n" if spec.literals else ""]
    main = _MAIN.format(body=_indent("\n".join(b for b in body if b), 8),
                        call=_indent("\n".join(_line(c) for c in spec.call), 8),
                        judge=_indent(judge_lines, 4), report=_indent(report, 4),
                        checker=checker,
                        saw={"VIOLATIONS": "the stand-ins' bounds checks"}.get(checker, "the bounds checker"),
                        found="    found = []  # what the calls' own checks see\n" if uses_found else "",
                        plus_found=" + found" if uses_found else "")
    tail = []
    for module_name, group in itertools.groupby(functions, key=lambda f: f[0].__module__):
        path = module_name.replace(".", "/") + ".py"
        tail.append(f"\n# ---- the calls main() makes, as attnfuzz makes them ({path}, verbatim) ----\n\n"
                    + "\n\n".join(s.source.rstrip("\n") + "\n" for _, s in group))
    if standalone:
        tail.append("\n# ---- the check (attnfuzz's fuzzer/artifacts/repro_judges.py, verbatim) ----\n\n"
                    + "\n\n".join(inspect.getsource(fn) for fn in repro_judges.FUNCTIONS[judge]))
    if finding.inject:
        tail.append(f"\n# ---- the injected bug ({finding.inject}) ----\n{source(finding.inject)}")
    header = _header(finding, spec, "inline" if standalone else "file")
    script = "\n".join(p for p in [header, *module, main, *tail, _ENTRY] if p)
    return {"repro.py": script, **({} if standalone else {SUPPORT_FILE: support_file(sources)})}


def write_repro(finding, target, root: Path) -> Path:
    """`root/<id>/`: the finding's record and its reproducer (repro.py, attnfuzz_support.py, tensors)."""
    spec = target.repro_spec(finding)
    if spec is None:  # the target renders no reproducer (selftest)
        return save_finding(finding, {}, Path(root))
    return save_finding(finding, render(finding, spec), Path(root), dict(spec.tensors))


def write_standalone(finding, target, out_dir: Path) -> Path:
    """`out_dir/repro.py` with the support code inlined, and the tensors it loads beside it: one script for a
    bug report upstream. Returns the script's path."""
    spec = target.repro_spec(finding)
    if spec is None:
        raise ValueError(f"{finding.target} renders no reproducer")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "repro.py").write_text(render(finding, spec, standalone=True)["repro.py"])
    if spec.tensors:
        from safetensors.torch import save_file

        save_file({k: v.detach().cpu().contiguous() for k, v in spec.tensors.items()}, str(out_dir / "tensors.safetensors"))
    return out_dir / "repro.py"
