"""The exit-code contract (README, fuzzer/errors.py): 0 only when cases ran and nothing was found, 1 only for
findings, 2 when attnfuzz could not test (arguments, environment, outputs, a reproducer that could not run),
3 when a run was cut short; each probe below is a way a run once gave the wrong one."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, attnfuzz, python

RUN = ("run", "--target", "vllm.index_remap")
# A meta-path hook that makes vLLM's remap module unimportable, as if a release had moved it.
HIDE_REMAP = '''import importlib.abc, sys
class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm.v1.attention.backends.mla.sparse_utils":
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, _Hide())
'''


@pytest.mark.parametrize("argv, words", [
    (("--max-examples", "0"), "--max-examples 0: must be 1 or more"),
    (("--max-examples", "-5"), "--max-examples -5: must be 1 or more"),
    (("--time-budget", "0s"), "--time-budget 0s: must be more than 0"),
    (("--reruns", "-1"), "--reruns -1: must be 0 or more"),
    (("--case-timeout", "0s"), "--case-timeout 0s: at least 5s"),
    (("--profile", "huge"), "--profile 'huge': unknown"),
    (("--kv-cache-dtype", "fp8_ds_mla"), "vllm.index_remap takes no kv cache"),
    (("--inject", "softmax-masked-tile-nan"), "the mutant breaks vllm.triton_sparse, vllm.sparse_mla.all; on "
                                              "vllm.index_remap it would change nothing"),
])
def test_arguments_that_test_nothing_are_refused_before_vllm_loads(argv, words):
    start = time.monotonic()
    r = attnfuzz(*RUN, *argv, fresh=True)  # a new interpreter: nothing of vLLM imported before the CLI starts
    assert r.returncode == 2 and words in r.stderr, r.stderr
    assert "Failed to import from vllm" not in r.stderr  # refused before vLLM's import
    assert time.monotonic() - start < 30


def test_outputs_are_checked_before_the_first_case(tmp_path):
    (tmp_path / "afile").write_text("")
    r = attnfuzz(*RUN, "--out", str(tmp_path / "afile"))
    assert r.returncode == 2 and "exists and is not a directory" in r.stderr, r.stderr
    r = attnfuzz(*RUN, "--repros", str(tmp_path / "afile" / "repros"))  # root writes anywhere: a file in the way
    assert r.returncode == 2 and "--repros" in r.stderr and "cannot write there" in r.stderr, r.stderr


def test_device_cuda_without_a_gpu_is_a_usage_error():
    if Path("/dev/nvidia0").exists():
        pytest.skip("this host has a GPU")
    r = attnfuzz("--device", "cuda", *RUN, "--max-examples", "1", fresh=True)  # the device is chosen before vLLM loads
    assert r.returncode == 2 and "--device cuda: this host has no GPU driver" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.vllm
def test_an_inject_file_that_raises_names_its_file_and_line(tmp_path):
    bad = tmp_path / "bad_mutant.py"
    bad.write_text("import os\n\n{}['missing']\n")
    r = attnfuzz(*RUN, "--inject", str(bad), "--max-examples", "1")
    assert r.returncode == 2 and f"{bad}:3: KeyError" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.vllm
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_the_run_interrupted_and_says_so(tmp_path, sig):
    env = dict(os.environ, ATTNFUZZ_STATE=str(tmp_path / "state"))
    proc = subprocess.Popen([sys.executable, "-m", "fuzzer.cli", *RUN, "--time-budget", "10m", "--json",
                             str(tmp_path / "s.json"), "--repros", str(tmp_path / "r")], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    line = ""
    while time.time() < deadline and " cases, " not in line:  # the first progress line: a case has run
        line = proc.stderr.readline()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 3, err[-2000:]
    assert "KeyboardInterrupt" not in err and "Traceback" not in err
    assert f"INTERRUPTED by {sig.name}" in out
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["interrupted"] is True and s["interrupted_by"] == sig.name and s["examples"] >= 1


@pytest.mark.vllm
def test_a_reproducer_that_cannot_run_its_call_exits_2_and_the_gate_calls_it_broken(tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE_REMAP)
    env = dict(os.environ, PYTHONPATH=f"{hide}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    repro = ROOT / "repros" / "index-remap-7e944ef6"
    r = subprocess.run([sys.executable, "repro.py"], cwd=repro, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "COULD NOT RUN (the call): ModuleNotFoundError" in r.stdout, r.stdout + r.stderr
    assert "no bug: fixed" not in r.stdout
    corpus = tmp_path / "repros"  # the gate over this reproducer alone (the whole corpus is test_gate's)
    shutil.copytree(repro, corpus / repro.name)
    # The gate's own process needs no hiding: it runs the reproducer in a new interpreter, which reads PYTHONPATH.
    g = python("-m", "fuzzer.cli", "gate", "--no-campaigns", "--repros", str(corpus), "--out", str(tmp_path / "gate"),
               cwd=ROOT, env=env, timeout=900)
    assert g.returncode == 1, g.stdout + g.stderr
    assert "repro index-remap-7e944ef6: broken" in g.stdout and "COULD NOT RUN" in g.stdout


def test_a_finding_the_repros_directory_cannot_take_goes_to_the_state_directory(tmp_path, monkeypatch, capsys):
    from fuzzer.commands import run
    from fuzzer.env import HostInfo
    from fuzzer.observation import Observation
    from fuzzer.records import Finding
    from oracles.verdict import Verdict
    from tests.strategies.test_case import small_case

    monkeypatch.setattr(run, "STATE_DIR", tmp_path / "state")
    host = HostInfo("cpu", "x86_64", "0.33.0", "2.13", "3.9", "3.11", True)
    finding = Finding("vllm.index_remap", "memory:k", small_case(), [Verdict("memory", False, "oob")],
                      Observation("vllm.index_remap", "cpu"), host, None, 3, 1.0)
    blocked = tmp_path / "afile"
    blocked.write_text("")

    class NoRepro:  # a target that renders no reproducer: the finding's record and case are still written
        def repro_spec(self, finding):
            return None

    saved, unsaved = run.save_findings([finding], NoRepro(), blocked / "repros")
    assert not unsaved and saved[0][1] == tmp_path / "state" / "findings" / finding.id
    assert (saved[0][1] / "finding.json").is_file()
    assert f"{finding.id} saved under {tmp_path / 'state' / 'findings'} instead" in capsys.readouterr().err



def test_a_reproducer_whose_bounds_checker_breaks_says_it_could_not_run():
    """Triton 3.6's interpreter called the checker's masked load with one argument more than it took: the
    InterpreterError that came of it is attnfuzz's failure, never the bug's answer."""
    import ast
    import traceback

    source = (ROOT / "repros" / "index-remap-7e944ef6" / "repro.py").read_text()
    fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "vllms_answer")
    scope = {"traceback": traceback, "__file__": "repro.py"}
    exec(compile(ast.Module([fn], []), "repro.py", "exec"), scope)
    try:
        raise RuntimeError("InterpreterError(\"TypeError('InterpreterSanitizer.install.<locals>.create_masked_load() "
                           "takes 6 positional arguments but 7 were given')\")")
    except RuntimeError as e:
        assert scope["vllms_answer"](e) is False
    try:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    except RuntimeError as e:
        assert scope["vllms_answer"](e) is True
