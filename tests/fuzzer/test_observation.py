"""Every `notes` key a target, the harness or an oracle uses is declared in fuzzer/observation.py's Notes."""

import re

from fuzzer.observation import NOTE_KEYS
from tests.conftest import ROOT

USE = re.compile(r"notes(?:\.get\(|\[|\.setdefault\()\"(\w+)\"")


def test_every_notes_key_is_declared():
    used = {}
    for pkg in ("fuzzer", "oracles"):
        for path in (ROOT / pkg).rglob("*.py"):
            for m in USE.finditer(path.read_text()):
                used.setdefault(m.group(1), f"{path.relative_to(ROOT)}")
    assert len(used) >= 10, used
    undeclared = {k: where for k, where in used.items() if k not in NOTE_KEYS}
    assert not undeclared, f"notes keys not declared in fuzzer/observation.py Notes: {undeclared}"
