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
import importlib.util
import inspect
from pathlib import Path

from fuzzer.artifacts import repro_judges
from fuzzer.artifacts.finding_dir import save_finding
from fuzzer.artifacts.finding_report import sanitizer_run_line
from fuzzer.mutants import source
from fuzzer.repro_spec import ReproSpec

SUPPORT_FILE = "attnfuzz_support.py"
SUPPORT_PACKAGE = "fuzzer.support"


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

def _imported_modules(name: str) -> set[str]:
    """Every attnfuzz module `name` imports (in-function imports included), by its source."""
    tree = ast.parse(inspect.getsource(importlib.import_module(name)))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                base = ".".join([*name.split(".")[:-node.level], *([base] if base else [])])
            for a in node.names:  # `from package import module` names a module
                found.add(f"{base}.{a.name}" if _is_submodule(base, a.name) else base)
    return {m for m in found if m.split(".")[0] in ("fuzzer", "oracles", "strategies")}


def _is_submodule(package: str, name: str) -> bool:
    if package.split(".")[0] not in ("fuzzer", "oracles", "strategies"):
        return False
    spec = importlib.util.find_spec(package)
    return spec.submodule_search_locations is not None and importlib.util.find_spec(f"{package}.{name}") is not None


def support_modules(names) -> list[str]:
    """`names` and every support module they import, transitively; packages come along empty."""
    todo, seen = list(names), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        if not name.startswith(SUPPORT_PACKAGE + "."):
            raise ValueError(f"a reproducer's support module must be in {SUPPORT_PACKAGE}, not {name}")
        seen.add(name)
        for dep in _imported_modules(name):
            if not dep.startswith(SUPPORT_PACKAGE + ".") and dep != SUPPORT_PACKAGE:
                raise ValueError(f"{name} imports {dep}: support modules import nothing of attnfuzz but each other")
            if importlib.util.find_spec(dep).submodule_search_locations is None:  # packages: empty
                todo.append(dep)
    return sorted(seen)


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


def __getattr__(name):  # `from attnfuzz_support import flashmla_runtime`: the module of that name
    for module in SUPPORT:
        if module.rsplit(".", 1)[-1] == name:
            return importlib.import_module(module)
    raise AttributeError(name)
'''


def support_body(modules: list[str]) -> str:
    """SUPPORT (each module's source, verbatim) and the finder that imports them."""
    entries = []
    for name in modules:
        source = inspect.getsource(importlib.import_module(name))
        if "'''" in source:
            raise ValueError(f"{name}: a support module's source may not hold ''' (it is inlined in r''' quotes)")
        entries.append(f"    {name!r}: r'''{source}''',")
    return ("import importlib.abc\nimport importlib.util\nimport linecache\nimport sys\n\n"
            "SUPPORT = {\n" + "\n".join(entries) + "\n}\n" + _SUPPORT_LOADER)


def support_file(modules: list[str]) -> str:
    listed = "".join(f"  {m}\n" for m in modules)
    return ('"""attnfuzz\'s support code for repro.py beside it, generated. Each module verbatim from attnfuzz,\n'
            f"importable under its own name once this file is imported (as inside attnfuzz):\n{listed}"
            'Needs torch, numpy, triton and vLLM only."""\n\n' + support_body(modules))


# -- the script -----------------------------------------------------------------------------------------------

_CPU_ENV = """
# CPU: Triton's interpreter (an empty CUDA_VISIBLE_DEVICES keeps vLLM from swapping Triton for a placeholder)
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["TRITON_INTERPRET"] = "1"
"""

_MAIN = '''
def main():
    try:  # importing vLLM and setting the step up: a failure here is not the bug's answer
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


def vllms_answer(e):  # judged; not a module, name or signature (at this script's line) this vLLM lacks, nor attnfuzz's checker breaking
    here = traceback.extract_tb(e.__traceback__)[-1].filename == __file__
    return not (isinstance(e, (ImportError, NameError)) or isinstance(e, (TypeError, AttributeError)) and here
                or "InterpreterSanitizer" in str(e))


def could_not_run(stage, e):  # exit 2: no answer from vLLM, so nothing about the bug
    traceback.print_exception(e, limit=-4)
    print(f"COULD NOT RUN ({{stage}}): {{type(e).__name__}}: {{e}} - this says nothing about the bug (exit 2)")
    return 2
'''

_LOAD_TENSORS = 'T = load_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tensors.safetensors"), device=DEVICE)'


def _saw(verdicts) -> list[str]:
    """What attnfuzz saw, as comments: one line for one verdict."""
    lines = [f"{v.check}: {v.detail}" for v in verdicts]
    return [f"# What attnfuzz saw: {lines[0]}"] if len(lines) == 1 else ["# What attnfuzz saw:", *(f"#   {ln}" for ln in lines)]


def _indent(code: str, n: int) -> str:
    """`code`'s lines indented by n, each ending in a newline ("" for no code)."""
    lines = code.strip("\n").splitlines()
    return "".join((" " * n + ln if ln.strip() else "") + "\n" for ln in lines) if code.strip() else ""


def _judge_call(spec: ReproSpec) -> str:
    """`judge_<name>(...)` on the spec's expressions, in the function's parameter order."""
    fn = repro_judges.FUNCTIONS[spec.judge.name][-1]
    params = inspect.signature(fn).parameters
    given = dict(spec.judge.args, **({"error": "error"} if spec.judge.name == "index_contract" else {}))
    if unknown := set(given) - set(params):
        raise ValueError(f"judge {spec.judge.name}: no parameter {', '.join(sorted(unknown))}")
    if missing := [p for p, v in params.items() if p not in given and v.default is inspect.Parameter.empty]:
        raise ValueError(f"judge {spec.judge.name}: no expression for {', '.join(missing)}")
    args, keyword = [], False
    for p in (p for p in params if p in given):
        keyword = keyword or given[p] != p  # positional while each expression is the parameter's own name
        args.append(f"{p}={given[p]}" if keyword else p)
    return f"{fn.__name__}({', '.join(args)})"


def _header(finding, spec: ReproSpec, support: str | None) -> str:
    host, run = finding.host, sanitizer_run_line(finding)
    where = {None: "", "file": f"attnfuzz's support code it uses is in {SUPPORT_FILE} beside this file.\n",
             "inline": "attnfuzz's support code it uses is inlined at the end of this file.\n"}[support]
    return (f'#!/usr/bin/env python3\n"""attnfuzz reproducer {finding.id}: {finding.title[:150]}\n\n'
            f"Found by attnfuzz target `{finding.target}` on vLLM {host.vllm}, {host.device} ({host.device_name})"
            + (f", with the injected bug `{finding.inject}` (inlined below)" if finding.inject else "") + ".\n"
            + spec.about.strip("\n") + "\n" + where
            + "Run:  python repro.py   (torch + vLLM only; exit 1: bug present, 0: fixed, 2: could not run the call)\n"
            + (f"This is a memory error that compute-sanitizer sees; run it so:\n  {run}\n"
               "Run plainly, the script may look clean on the GPU: it prints that command.\n" if run else "")
            + '"""\n'
            + (f'print("attnfuzz: this bug shows under compute-sanitizer:  {run}")\n' if run else ""))


def render(finding, spec: ReproSpec, standalone: bool = False) -> dict[str, str]:
    """The reproducer's files: repro.py, and attnfuzz_support.py beside it where it uses support code
    (`standalone`: inlined into repro.py instead)."""
    cpu = finding.host.device == "cpu"
    support = dict(spec.support)
    if spec.bounds_checked:
        support.setdefault("sanitizer", "fuzzer.support.interp.sanitizer")
    modules = support_modules(support.values()) if support else []
    body = []
    if support:
        names = ", ".join(m.rsplit(".", 1)[-1] + ("" if a == m.rsplit(".", 1)[-1] else f" as {a}")
                          for a, m in sorted(support.items(), key=lambda am: am[1].rsplit(".", 1)[-1]))
        body.append(f"from attnfuzz_support import {names}  # attnfuzz's (see the docstring)")
    body.append(spec.prepare)
    if spec.bounds_checked:
        body.append("sanitizer.SANITIZER.install()  # bounds checks on every interpreted Triton load/store")
    if finding.inject:
        body.append("apply()  # the injected bug")
    body += [_LOAD_TENSORS if spec.tensors else "", spec.setup]
    body = "\n".join(b.strip("\n") for b in body if b.strip())
    judge = spec.judge.name
    judge_lines = (f"problems += {_judge_call(spec)}\n" if judge == "index_contract" else
                   'if error is not None:\n    problems.append(f"raised {type(error).__name__}: {error}")\n'
                   f"else:\n    problems += {_judge_call(spec)}\n")
    imports = ["import os", "import sys", "import traceback", *spec.imports, *([] if spec.bounds_checked else ["import contextlib"])]
    imports = sorted(set(imports), key=lambda ln: (ln.startswith("from"), ln))
    module = ["\n".join(imports) + "\n", _CPU_ENV if cpu else "",
              "import torch\n" + ("from safetensors.torch import load_file\n" if spec.tensors else ""),
              "\n".join([f'DEVICE = "{"cpu" if cpu else "cuda"}"', *(f"{k} = {v!r}" for k, v in spec.constants.items()),
                         *_saw(finding.verdicts)]) + "\n",
              "\n".join(tensor_literal(k, t) for k, t in spec.literals.items()) + "\n" if spec.literals else ""]
    main = _MAIN.format(body=_indent(body, 8), call=_indent(spec.call, 12), judge=_indent(judge_lines, 4),
                        report=_indent(spec.report, 4),
                        collect="sanitizer.SANITIZER.collect()" if spec.bounds_checked else "contextlib.nullcontext([])")
    tail = ["\n" + "\n\n".join(inspect.getsource(fn) for fn in repro_judges.FUNCTIONS[judge])]
    if finding.inject:

        tail.append(f"\n# ---- the injected bug ({finding.inject}) ----\n{source(finding.inject)}")
    if modules and standalone:
        tail.append(f"\n# ---- {SUPPORT_FILE}, inlined: attnfuzz's support code, each module verbatim ----\n"
                    + support_body(modules) + '\n\nsys.modules["attnfuzz_support"] = sys.modules[__name__]\n')
    script = "\n".join(p for p in [_header(finding, spec, None if not modules else "inline" if standalone else "file"),
                                    *module, main, *tail, '\nif __name__ == "__main__":\n    try:\n        sys.exit(main())\n    except Exception as e:  # in the check itself\n        sys.exit(could_not_run("the check", e))\n'] if p)
    return {"repro.py": script, **({SUPPORT_FILE: support_file(modules)} if modules and not standalone else {})}


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
