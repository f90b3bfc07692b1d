"""What the target tests share: a case run on a target and judged clean, the paths it reached, a campaign through the
CLI and its JSON summary, a saved reproducer run as if fixed and as saved."""

import functools
import json
from pathlib import Path

import pytest

from tests.conftest import attnfuzz, python, run_repro


@functools.cache
def prepared(name: str):
    """The registered target NAME on the CPU, prepared once a session; the test is skipped where it is unavailable."""
    from fuzzer.targets.registry import TARGETS

    t = TARGETS[name]("cpu")
    if t.unavailable():
        pytest.skip(t.unavailable())
    t.prepare()
    return t


def failures(t, case):
    """CASE on target T, judged: (the observation, the verdicts that failed)."""
    obs = t.run(case)
    return obs, [v for v in t.oracle(case, obs) if not v.ok]


def run_judged(t, case):
    """CASE on target T, judged: it ran without an error and every verdict passed. Returns (observation, verdicts)."""
    obs = t.run(case)
    verdicts = t.oracle(case, obs)
    assert obs.error is None and all(v.ok for v in verdicts), (t.name, case.summary(), obs.error, verdicts)
    return obs, verdicts


def assert_reached(obs, paths):
    """Every one of PATHS among the code paths the run noted."""
    assert set(paths) <= set(obs.notes["paths"]), sorted(obs.notes["paths"])


def campaign(tmp_path: Path, target: str, *args: str, exits: int = 0) -> dict:
    """`attnfuzz run --target TARGET ARGS` with a state directory of its own under TMP_PATH: it exits EXITS; its JSON
    summary."""
    run = attnfuzz("run", "--target", target, *args, "--json", str(tmp_path / "run.json"), state=tmp_path / "state")
    assert run.returncode == exits, run.stdout[-2000:] + run.stderr[-2000:]
    return json.loads((tmp_path / "run.json").read_text())


def clean_campaign(tmp_path: Path, target: str, examples: int, *args: str) -> dict:
    """A campaign of EXAMPLES cases that runs them all and finds nothing."""
    summary = campaign(tmp_path, target, "--max-examples", str(examples), *args)
    assert summary["examples"] == examples and not summary["findings"]
    return summary


def first_finding(tmp_path: Path, target: str, *args: str) -> dict:
    """A campaign that finds something (exit 1): its first finding."""
    return campaign(tmp_path, target, *args, exits=1)["findings"][0]


# Runs a reproducer's main() twice in one process (one vLLM import): first as if fixed (its injected bug left out),
# then as saved; the bug's patch stays in vLLM for the rest of the process, hence that order.
TWICE = """
import runpy, sys
sys.path.insert(0, sys.argv[1])
print("EXIT", [runpy.run_path(f"{sys.argv[1]}/{name}")["main"]() for name in ("fixed.py", "repro.py")])
"""


# The imports of attnfuzz a repro.py may make: its support modules and its judge, which attnfuzz_support.py serves.
SERVED = ("from fuzzer.support.", "import fuzzer.support.", "from fuzzer.artifacts.repro_judges import ")


def run_fixed_and_saved(d: Path, support: tuple[str, ...] = SERVED):
    """A saved finding's repro.py in D: attnfuzz's own code only as its support modules (imports starting with one of
    SUPPORT), which attnfuzz_support.py serves; run with the injected bug left out (fixed.py) it exits 0, as saved 1.
    Returns the run."""
    script = (d / "repro.py").read_text()
    assert not [ln for ln in script.splitlines()
                if ln.strip().startswith(("import fuzzer", "from fuzzer", "from oracles"))
                and not ln.strip().startswith(support)]
    (d / "fixed.py").write_text(script.replace("apply()  # the injected bug", "pass  # no injected bug"))
    run = python("-c", TWICE, str(d), cwd=d, timeout=600)
    assert run.returncode == 0 and "EXIT [0, 1]" in run.stdout, run.stdout + run.stderr[-3000:]
    return run


def run_saved_then_fixed(d: Path) -> None:
    """A saved finding's repro.py in D, each run a process of its own: as saved it exits 1; with the injected bug left
    out (fixed.py) 0, saying so."""
    run = run_repro(d)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    script = (d / "repro.py").read_text()
    (d / "fixed.py").write_text(script.replace("apply()  # the injected bug", "pass  # no injected bug"))
    run = python("fixed.py", cwd=d, timeout=300)
    assert run.returncode == 0 and "no bug: fixed" in run.stdout, run.stdout[-2000:] + run.stderr[-3000:]
