#!/usr/bin/env python3
"""What of a reproducer's attnfuzz_support.py its own run executes: runs `python repro.py` in a copy of DIR under a
line tracer, then prints per support module its lines, the lines of statements that never ran (outermost only)
and the support functions never called. The reproducer's exit code is printed as it ran.

  .venv/bin/python bench/support_coverage.py repros/<id> [--show MODULE]   (MODULE: list its unrun statements)
"""

import argparse
import ast
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import threading


def trace(directory: str, out: str) -> None:
    """In this process: run repro.py (cwd: its directory) and write the executed lines of each support module."""
    os.chdir(directory)
    sys.path.insert(0, directory)
    lines: dict[str, set[int]] = {}

    def tracer(frame, event, arg):
        if frame.f_code.co_filename.startswith("<attnfuzz_support"):
            lines.setdefault(frame.f_code.co_filename, set()).add(frame.f_lineno)
            return tracer
        return None

    sys.settrace(tracer)
    threading.settrace(tracer)
    sys.argv, code = ["repro.py"], 0
    try:
        runpy.run_path("repro.py", run_name="__main__")
    except SystemExit as e:
        code = e.code
    finally:
        sys.settrace(None)
        with open(out, "w") as f:
            json.dump({"exit": code, "lines": {k: sorted(v) for k, v in lines.items()}}, f)


def report(directory: str, ran_file: str, show: str | None) -> None:
    sys.path.insert(0, directory)
    import attnfuzz_support

    with open(ran_file) as f:
        data = json.load(f)
    print(f"repro.py exited {data['exit']}")
    total_unrun = total_uncalled = 0
    for name, source in attnfuzz_support.SUPPORT.items():
        ran = set(data["lines"].get(f"<attnfuzz_support: {name}>", []))
        text, tree = source.splitlines(), ast.parse(source)
        unrun, uncalled = [], []

        def walk(stmts, prefix=""):
            for s in stmts:
                if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if not set(range(s.body[0].lineno, s.end_lineno + 1)) & ran:
                        uncalled.append((s.end_lineno - s.lineno + 1, prefix + s.name))
                if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and s.lineno in ran:
                    walk(s.body, prefix + s.name + "." if isinstance(s, ast.ClassDef) else prefix)
                elif s.lineno not in ran and not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)):
                    unrun.append(s)
                else:
                    for field in ("body", "orelse", "finalbody"):
                        walk(getattr(s, field, None) or [], prefix)
                    for handler in getattr(s, "handlers", None) or []:
                        walk(handler.body, prefix)

        walk(tree.body)
        n_unrun = sum(s.end_lineno - s.lineno + 1 for s in unrun)
        n_uncalled = sum(n for n, _ in uncalled)
        total_unrun, total_uncalled = total_unrun + n_unrun, total_uncalled + n_uncalled
        print(f"{len(text):5d} {name}: {n_unrun} lines unrun; never called: "
              + (", ".join(f"{f} ({n})" for n, f in uncalled) or "none"))
        if show and show in name:
            for s in unrun:
                print(f"        L{s.lineno}-{s.end_lineno}: {text[s.lineno - 1].strip()[:100]}")
    print(f"in all: {total_unrun} lines unrun, {total_uncalled} in functions never called")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory")
    p.add_argument("--show", help="list the unrun statements of the support modules whose name contains this")
    p.add_argument("--trace-into", help=argparse.SUPPRESS)  # the child process: run and trace
    a = p.parse_args()
    if a.trace_into:
        trace(a.directory, a.trace_into)
        return
    with tempfile.TemporaryDirectory() as tmp:
        copy = shutil.copytree(a.directory, os.path.join(tmp, "repro"))
        ran = os.path.join(tmp, "ran.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), copy, "--trace-into", ran], check=False)
        report(copy, ran, a.show)


if __name__ == "__main__":
    main()
