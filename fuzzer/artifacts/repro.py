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

import inspect
import itertools
from pathlib import Path
from typing import Mapping

from fuzzer.artifacts import repro_judges, slicer
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

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if module.__name__ in SUPPORT:
            source, filename = SUPPORT[module.__name__], f"<attnfuzz_support: {module.__name__}>"
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # for tracebacks
            exec(compile(source, filename, "exec"), vars(module))


sys.meta_path.insert(0, _SupportFinder())
'''


def support_body(sources: dict[str, str]) -> str:
    """SUPPORT (each module's source as the reproducer needs it) and the finder that imports them."""
    entries = []
    for name, text in sources.items():
        if "'''" in text:
            raise ValueError(f"{name}: a support module's source may not hold ''' (it is inlined in r''' quotes)")
        entries.append(f"    {name!r}: r'''{text}''',")
    return ("import importlib.abc\nimport importlib.util\nimport linecache\nimport sys\n\n"
            "SUPPORT = {\n" + "\n".join(entries) + "\n}\n" + _SUPPORT_LOADER)


def support_file(sources: dict[str, str]) -> str:
    listed = "".join(f"  {m}\n" for m in sources)
    return ('"""attnfuzz\'s support code for repro.py beside it, generated: of each module below, the statements\n'
            "repro.py reaches, verbatim, importable under the module's own name once this file is imported (as\n"
            f"inside attnfuzz):\n{listed}"
            'Needs torch, numpy, triton and vLLM only."""\n\n' + support_body(sources))


# -- the script -----------------------------------------------------------------------------------------------

_CPU_ENV = """
# CPU: Triton's interpreter (an empty CUDA_VISIBLE_DEVICES keeps vLLM from swapping Triton for a placeholder)
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["TRITON_INTERPRET"] = "1"
"""

_EXITS = '''
def could_not_run(stage, e):  # exit 2: no answer from vLLM, so nothing about the bug
    traceback.print_exception(e, limit=-4)
    print(f"COULD NOT RUN ({stage}): {type(e).__name__}: {e} - this says nothing about the bug (exit 2)")
    return 2


def vllms_answer(e):  # judged, unless a name or signature this vLLM lacks (met in this script or in attnfuzz's
    # support code) or attnfuzz's bounds checker breaking (the error, or one it was raised from, passed through it)
    frames = [f.filename for f in traceback.extract_tb(e.__traceback__)]
    ours = frames[-1] == __file__ or frames[-1].startswith("<attnfuzz_support")
    chain, cause = [], e
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    chain = [f.filename for c in chain for f in traceback.extract_tb(c.__traceback__)]
    return not (isinstance(e, (ImportError, NameError)) or isinstance(e, (TypeError, AttributeError)) and ours
                or any("fuzzer.support.interp.sanitizer" in f for f in chain))
'''

_MAIN = """
def main():
    try:  # setting the step up: a failure here is not the bug's answer
{body}    except Exception as e:
        return could_not_run("the set-up", e)
    problems, error, found = [], None, []
    with {collect} as oob:
        try:
{call}        except Exception as e:
            if not vllms_answer(e):
                return could_not_run("the call", e)
            error = e  # vLLM raised: judged below
    problems += [v.describe() for v in oob] + found
{judge}{report}    for p in problems:
        print("BUG:", p)
    print("vLLM", __import__("vllm").__version__, "-", "bug present" if problems else "no bug: fixed")
    return 1 if problems else 0
"""

_LOAD_TENSORS = 'T = load_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tensors.safetensors"), device=DEVICE)'
_SANITIZER = "fuzzer.support.interp.sanitizer"
_ENTRY = '''
if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # in the check itself
        sys.exit(could_not_run("the check", e))
'''


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


def _line(call: Call, width: int = 100) -> str:
    """A Call as main()'s line (its arguments wrapped past `width`), its note as a comment above it."""
    head = f"{call.assign} = " if call.assign else ""
    args = _arguments(call.fn, call.args, call.fn.__name__).split(", ")
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
    given = dict(spec.judge.args, **({"error": "error"} if spec.judge.name == "index_contract" else {}))
    return f"{fn.__name__}({_arguments(fn, given, f'judge {spec.judge.name}')})"


def _header(finding, spec: ReproSpec, support: str | None) -> str:
    host, run = finding.host, sanitizer_run_line(finding)
    where = {None: "", "file": f"attnfuzz's support code it uses is in {SUPPORT_FILE} beside this file.\n",
             "inline": "attnfuzz's support code it uses is inlined near the top of this file.\n"}[support]
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
    of use; those of prepare and setup imported from the support file. Returns the shown ones with their
    sources, the import lines repro.py needs, and the support roots its support file must carry."""
    fns = list(dict.fromkeys(c.fn for c in spec.call))  # the vLLM calls: shown
    helpers = list(dict.fromkeys(c.fn for c in (*spec.prepare, *spec.setup) if c.fn not in fns))  # imported
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
    return list(zip(fns, shown)), _grouped([ln for ln, _ in bound.values()]), roots


def _grouped(lines: list[str], width: int = 100) -> list[str]:
    """Import lines, `from m import a` of one module joined (wrapped past `width`), plain imports first."""
    plain = sorted({ln for ln in lines if not ln.startswith("from ")})
    names: dict[str, list[str]] = {}
    for ln in lines:
        if ln.startswith("from "):
            module, name = ln[5:].split(" import ")
            names.setdefault(module, []).append(name)
    joined = []
    for module in sorted(names):
        line = f"from {module} import {', '.join(sorted(set(names[module])))}"
        if len(line) > width:
            line = f"from {module} import (\n" + "".join(f"    {n},\n" for n in sorted(set(names[module]))) + ")"
        joined.append(line)
    return plain + joined


def render(finding, spec: ReproSpec, standalone: bool = False) -> dict[str, str]:
    """The reproducer's files: repro.py, and attnfuzz_support.py beside it where it uses support code
    (`standalone`: inlined into repro.py instead)."""
    cpu = finding.host.device == "cpu"
    functions, support_imports, roots = _shown(spec)
    sources = slicer.slice_support(roots) if roots else {}
    body = [_line(c) for c in spec.prepare]
    if spec.bounds_checked:
        body.append("SANITIZER.install()  # bounds checks on every interpreted Triton load/store")
    if finding.inject:
        body.append("apply()  # the injected bug")
    body += [_LOAD_TENSORS if spec.tensors else "", *(_line(c) for c in spec.setup)]
    judge = spec.judge.name
    judge_lines = (f"problems += {_judge_call(spec)}\n" if judge == "index_contract" else
                   'if error is not None:\n    problems.append(f"raised {type(error).__name__}: {error}")\n'
                   f"else:\n    problems += {_judge_call(spec)}\n")
    report = "".join(f"print({label!r}, {expr})\n" for label, expr in spec.report.items())
    stdlib = sorted({"import os", "import sys", "import traceback", *([] if spec.bounds_checked else ["import contextlib"])})
    # Not vLLM: the bounds checker is installed before vLLM's kernels are imported (main() does both).
    imports = ["import torch", *(["from safetensors.torch import load_file"] if spec.tensors else []),
               *(["import attnfuzz_support  # noqa: F401 (serves the fuzzer.support modules below)"]
                 if sources and not standalone else []), *(ln for ln in support_imports if ln != "import torch")]
    guarded = ("try:  # torch, vLLM and attnfuzz's support code: a failure to import is not the bug's answer\n"
               + _indent("\n".join(imports), 4) + 'except Exception as e:\n    sys.exit(could_not_run("the imports", e))\n')
    inlined = (f"\n# ---- {SUPPORT_FILE}, inlined: attnfuzz's support code, the statements this script reaches ----\n"
               + support_body(sources) + "\n") if sources and standalone else ""
    module = ["\n".join(stdlib) + "\n", _CPU_ENV if cpu else "", _EXITS, inlined, guarded,
              "\n".join([f'DEVICE = "{"cpu" if cpu else "cuda"}"', *(f"{k} = {v!r}" for k, v in spec.constants.items()),
                         *_saw(finding.verdicts)]) + "\n",
              "\n".join(tensor_literal(k, t) for k, t in spec.literals.items()) + "\n" if spec.literals else ""]
    main = _MAIN.format(body=_indent("\n".join(b for b in body if b), 8),
                        call=_indent("\n".join(_line(c) for c in spec.call), 12),
                        judge=_indent(judge_lines, 4), report=_indent(report, 4),
                        collect="SANITIZER.collect()" if spec.bounds_checked else "contextlib.nullcontext([])")
    tail = []
    for module_name, group in itertools.groupby(functions, key=lambda f: f[0].__module__):
        path = module_name.replace(".", "/") + ".py"
        tail.append(f"\n# ---- the calls main() makes, as attnfuzz makes them ({path}, verbatim) ----\n\n"
                    + "\n\n".join(s.source.rstrip("\n") + "\n" for _, s in group))
    tail.append("\n# ---- the check (attnfuzz's fuzzer/artifacts/repro_judges.py, verbatim) ----\n\n"
                + "\n\n".join(inspect.getsource(fn) for fn in repro_judges.FUNCTIONS[judge]))
    if finding.inject:
        tail.append(f"\n# ---- the injected bug ({finding.inject}) ----\n{source(finding.inject)}")
    header = _header(finding, spec, None if not sources else "inline" if standalone else "file")
    script = "\n".join(p for p in [header, *module, main, *tail, _ENTRY] if p)
    return {"repro.py": script, **({SUPPORT_FILE: support_file(sources)} if sources and not standalone else {})}


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
