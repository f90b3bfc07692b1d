"""A `vllm.dsv4.rocm` / `vllm.dsv41.rocm` finding's reproducer: the V4 target's repro.py making the ROCm layer and
calling the builders and forward_mqa on the emulated arch (the host preparation the script shows) shows the injected
bug and passes without it."""

import pytest

from tests.conftest import python
from tests.fuzzer.mutants.test_dsv4_rocm_mutants import JOBS
from tests.fuzzer.targets.test_dsv4_flashmla import TWICE

pytestmark = pytest.mark.vllm


# V4's is nightly (28 s on the CI host); V4.1's keeps the render-and-run path of the shared class in CI.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.nightly) if n == "vllm.dsv4.rocm" else n
                                  for n in sorted(JOBS)])
def test_a_mutant_finding_gets_a_reproducer_that_shows_it_and_passes_without_it(tmp_path, name):
    from fuzzer.artifacts.repro import SUPPORT_FILE, write_repro
    from fuzzer.env import host_info
    from fuzzer.observation import Observation
    from fuzzer.records import Finding
    from fuzzer.targets.registry import get_target
    from oracles.verdict import Verdict

    t = get_target(name)("cpu")
    if t.unavailable():
        pytest.skip(t.unavailable())
    mutant, case, _ = JOBS[name][0]
    verdict = Verdict("output", False, "output off by 3x the tolerance", "N", where="output")
    finding = Finding(t.name, verdict.signature, case, [verdict], Observation(t.name, "cpu"), host_info("cpu"),
                      mutant, 1, 1.0)
    d = write_repro(finding, t, tmp_path / "repros")
    script = (d / "repro.py").read_text()
    support = (d / SUPPORT_FILE).read_text()
    assert "def apply(" in script and "emulated_arch" in support and "ROCMAiterMLAAttention" in support + script
    (d / "fixed.py").write_text(script.replace("apply()  # the injected bug", "pass  # no injected bug"))
    run = python("-c", TWICE, str(d), cwd=d, timeout=600)
    assert run.returncode == 0 and "EXIT [0, 1]" in run.stdout, run.stdout + run.stderr[-3000:]
    assert "no bug: fixed" in run.stdout and "BUG:" in run.stdout, run.stdout
