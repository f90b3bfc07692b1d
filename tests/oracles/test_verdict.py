"""Every check name the oracles and the harness emit has a place in oracles/verdict.py's CHECKS table (its
priority picks a finding's primary symptom)."""

import ast

from oracles.verdict import CHECKS, Verdict, primary
from tests.conftest import ROOT

EMITTERS = {"Verdict": 0, "passed": 0, "RemapMismatch": 1}  # callable -> position of the check name


def _emitted() -> dict[str, str]:
    found = {}
    for pkg in ("oracles", "fuzzer"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call):
                    continue
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                pos = EMITTERS.get(name)
                args = node.args
                check = args[pos] if pos is not None and len(args) > pos else next(
                    (k.value for k in node.keywords if k.arg == "check"), None) if name == "Verdict" else None
                if isinstance(check, ast.Constant) and isinstance(check.value, str):
                    found[check.value] = f"{path.relative_to(ROOT)}:{node.lineno}"
    return found


def test_every_emitted_check_has_a_priority():
    emitted = _emitted()
    assert len(emitted) >= 15, emitted  # the walk sees the oracles' checks
    missing = {c: where for c, where in emitted.items() if c not in CHECKS}
    assert not missing, f"checks with no place in oracles/verdict.py CHECKS: {missing}"


def test_primary_follows_the_table():
    a, b = Verdict("output", False, "off"), Verdict("memory", False, "oob")
    assert primary([a, b]) is b
