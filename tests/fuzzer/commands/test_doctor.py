"""`attnfuzz doctor` (issue 38 item 3): what this host can run and why not; exit 0 when a target of vLLM runs here, 2
when none does."""

from importlib.metadata import version

import pytest

from tests.conftest import attnfuzz, python

# vLLM made unimportable in a fresh interpreter, as on a host that lacks it; then the CLI.
WITHOUT_VLLM = '''import importlib.abc, sys
class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, _Hide())
from fuzzer.cli import main
sys.exit(main(sys.argv[1:]))
'''


@pytest.mark.vllm
def test_doctor_says_what_runs_here_and_what_is_a_stand_in():
    r = attnfuzz("doctor", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    out = r.stdout
    assert f"vLLM {version('vllm')} at " in out and "/vllm" in out and "torch 2." in out and "triton 3." in out
    assert "GPUs: " in out and "vllm.index_remap  " in out and "selftest.fault" in out
    for kernel in ("FlashMLA", "FA3", "FlashInfer", "DeepGEMM", "vLLM _C cache ops"):  # no GPU here: stand-ins
        assert f"  {kernel}" in out and "STAND-IN (tensors on the CPU" in out.split(f"  {kernel}", 1)[1].split("\n")[0]
    assert "compute-sanitizer: " in out and "Triton interpreter + attnfuzz's bounds checker: on" in out


def test_doctor_without_vllm_says_why_and_exits_2():
    r = python("-c", WITHOUT_VLLM, "doctor", fresh=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr[-3000:]
    assert "vLLM is not importable here" in r.stdout and "targets: 0 of " in r.stdout
    assert "no target of vLLM runs here" in r.stdout
