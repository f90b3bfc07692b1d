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
# SIGINT and SIGTERM take one path (fuzzer/interrupt.py): CI runs SIGTERM, the nightly job both
@pytest.mark.parametrize("sig", [pytest.param(signal.SIGINT, marks=pytest.mark.nightly), signal.SIGTERM])
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


def _without_remap(tmp_path) -> dict:
    """An environment whose Python can't import the remap kernel's module (HIDE_REMAP as its sitecustomize)."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE_REMAP)
    return dict(os.environ, PYTHONPATH=f"{hide}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


@pytest.mark.vllm
def test_a_reproducer_that_cannot_run_its_call_exits_2(tmp_path):
    env = _without_remap(tmp_path)
    repro = ROOT / "repros" / "index-remap-7e944ef6"
    r = subprocess.run([sys.executable, "repro.py"], cwd=repro, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "COULD NOT RUN (the call): ModuleNotFoundError" in r.stdout, r.stdout + r.stderr
    assert "no bug: fixed" not in r.stdout


@pytest.mark.vllm
@pytest.mark.nightly  # ~50 s; CI keeps exit 2 -> broken in test_gate's test_replay_outcomes
def test_the_gate_calls_a_reproducer_that_cannot_run_its_call_broken(tmp_path):
    env = _without_remap(tmp_path)
    repro = ROOT / "repros" / "index-remap-7e944ef6"
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



# The committed reproducer's own vllms_answer on its own support file's checker, called by Triton's interpreter with
# fewer arguments than it takes, the error re-raised as the interpreter re-raises it; then a CUDA fault.
JUDGE_A_BROKEN_CHECKER = '''import runpy
from triton.runtime import interpreter
repro = runpy.run_path("repro.py", run_name="repro")
repro["SANITIZER"].install()
try:
    try:
        interpreter.InterpreterBuilder.create_masked_load(None, 1, 2)
    except TypeError as inner:
        raise RuntimeError(f"InterpreterError({inner!r})") from inner
except RuntimeError as e:
    print("checker broke:", type(e.__cause__).__name__, repro["vllms_answer"](e))
try:
    raise RuntimeError("CUDA error: an illegal memory access was encountered")
except RuntimeError as e:
    print("kernel fault:", repro["vllms_answer"](e))
'''


def test_a_reproducer_whose_bounds_checker_breaks_says_it_could_not_run():
    """Triton 3.6's interpreter once called the checker's masked load with one argument more than it took: the
    error that came of it is attnfuzz's failure (raised by the checker as CheckerBroke), never the bug's answer;
    a kernel's fault stays vLLM's answer."""
    r = python("-c", JUDGE_A_BROKEN_CHECKER, cwd=ROOT / "repros" / "index-remap-7e944ef6", fresh=True,
               env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "checker broke: CheckerBroke False" in r.stdout and "kernel fault: True" in r.stdout, r.stdout


# -- issue 35: signals at any moment, start-up included; every command refuses what cannot work before it works --

def _handles(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (its /proc SigCgt mask); False once it is gone."""
    try:
        caught = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caught.split()[1], 16) >> (sig - 1) & 1)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"  # a zombie is dead
    except OSError:
        return False


def _until(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _start(tmp_path, *argv) -> subprocess.Popen:
    """The CLI in a new interpreter, as a user (or a CI job that times out) starts it; once it returns, attnfuzz's own
    SIGTERM handler is in (Python has none of its own): the process is importing its commands."""
    env = dict(os.environ, ATTNFUZZ_STATE=str(tmp_path / "state"))
    proc = subprocess.Popen([sys.executable, "-m", "fuzzer.cli", *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _until(lambda: _handles(proc.pid, signal.SIGTERM) or proc.poll() is not None, "the signal handlers")
    return proc


@pytest.mark.parametrize("sig, phase", [(signal.SIGINT, "imports"), (signal.SIGTERM, "worker start")])
def test_a_signal_in_start_up_ends_the_run_interrupted_and_every_output_says_so(tmp_path, sig, phase):
    """Once: SIGINT in start-up gave a 28-line KeyboardInterrupt traceback and exit 130, SIGTERM (a CI timeout) exit
    143 and nothing printed, and neither wrote --json or --out."""
    proc = _start(tmp_path, *RUN, "--max-examples", "5", "--json", str(tmp_path / "s.json"), "--out",
                  str(tmp_path / "out"), "--repros", str(tmp_path / "r"))
    workers = []
    if phase == "worker start":  # the worker is importing vLLM; this process waits for it to report ready
        _until(lambda: _children(proc.pid) or proc.poll() is not None, "the worker process")
        workers = _children(proc.pid)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, out + err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert f"INTERRUPTED by {sig.name} in start-up, before the first case" in out, out
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["interrupted"] is True and s["interrupted_by"] == sig.name and s["examples"] == 0
    assert json.loads((tmp_path / "out" / "campaign.json").read_text())["interrupted"] == sig.name
    for report in ("report.md", "report.html"):
        text = (tmp_path / "out" / report).read_text()
        assert "INTERRUPTED" in text and f"by {sig.name} in start-up" in text, report
        assert "every case passed every check" not in text, report
    _until(lambda: not [w for w in workers if _alive(w)], "the starting worker's end", timeout=5)


def test_a_second_signal_kills_at_once(tmp_path):
    proc = _start(tmp_path, *RUN, "--max-examples", "5", "--json", str(tmp_path / "s.json"))
    proc.send_signal(signal.SIGTERM)
    _until(lambda: not _handles(proc.pid, signal.SIGTERM), "the default action back for the next signal")
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM and not (tmp_path / "s.json").exists()


@pytest.mark.parametrize("command", ["gate", "selftest"])
def test_a_signal_in_start_up_ends_gate_and_selftest_interrupted_and_every_output_says_so(tmp_path, command):
    outputs = ["--json", str(tmp_path / "s.json"), "--junit", str(tmp_path / "j.xml"), "--out", str(tmp_path / "o")]
    if command == "selftest":
        outputs += ["--markdown", str(tmp_path / "t.md")]
    proc = _start(tmp_path, command, "--targets", "vllm.index_remap", "--repros", str(tmp_path / "none"), *outputs,
                  *(["--no-repros"] if command == "gate" else []))
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, out + err
    assert "Traceback" not in err, err
    assert f"{command} INTERRUPTED by SIGTERM" in out, out
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["interrupted"] is True and s["interrupted_by"] == "SIGTERM" and s["passed"] is False
    import xml.etree.ElementTree as ET

    error = ET.parse(tmp_path / "j.xml").getroot().find(".//testcase[@name='interrupted']/error")
    assert error is not None and f"the {command} was interrupted by SIGTERM" in error.get("message")
    if command == "selftest":
        assert (tmp_path / "t.md").read_text().startswith("**INTERRUPTED by SIGTERM**")


def test_after_a_signal_no_campaign_starts_and_a_running_one_is_told_to_wind_down(tmp_path, monkeypatch):
    from fuzzer import interrupt
    from fuzzer.commands.gate import judge_campaign
    from fuzzer.run import campaign_process
    from fuzzer.run.campaign_process import CampaignOutcome, CampaignSpec, run_campaigns

    monkeypatch.setattr(interrupt, "_received", "SIGTERM")  # as the handler records it (no handler changed here)
    assert run_campaigns([CampaignSpec("vllm.index_remap", 5, 0)], "cpu", tmp_path, 60) == []
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    start = time.monotonic()
    assert campaign_process._wait(sleeper, 600) == -signal.SIGTERM and time.monotonic() - start < 10
    log = tmp_path / "log.txt"
    log.write_text("")
    cut = CampaignOutcome(CampaignSpec("vllm.index_remap", 40, 0), 3, 9.0, {"examples": 4, "findings": []}, log)
    r = judge_campaign(cut, interrupted="SIGTERM")
    assert r.outcome == "interrupted" and "interrupted by SIGTERM" in r.reason  # not an error, not a pass
    assert judge_campaign(cut).outcome == "error"


def test_the_report_of_an_interrupted_campaign_says_so(tmp_path):
    from fuzzer.artifacts.campaign_report import render, write_campaign
    from fuzzer.env import HostInfo
    from fuzzer.search.campaign import CampaignResult

    host = HostInfo("cpu", "x86_64", "0.33.0", "2.13", "3.9", "3.11", True)
    write_campaign(tmp_path, CampaignResult("vllm.index_remap", examples=7, interrupted="SIGINT"), host=host, seed=0,
                   inject=None, profile="cpu", options={}, findings_saved=[])
    for report in render(tmp_path):
        text = report.read_text()
        assert "INTERRUPTED" in text and "by SIGINT after 7 case(s): the search did not finish" in text, report
        assert "every case passed every check" not in text, report


@pytest.mark.parametrize("argv, words", [
    (("gate", "--no-repros", "--no-campaigns"), "--no-repros with --no-campaigns: nothing to test"),
    (("gate", "--budget-scale", "nan"), "--budget-scale nan: must be a finite number more than 0"),
    (("gate", "--budget-scale", "inf"), "--budget-scale inf: must be a finite number more than 0"),
    (("gate", "--budget-scale", "0"), "--budget-scale 0.0: must be a finite number more than 0"),
    (("gate", "--budget-scale", "-2"), "--budget-scale -2.0: must be a finite number more than 0"),
    (("selftest", "--budget-scale", "nan"), "--budget-scale nan: must be a finite number more than 0"),
])
def test_gate_and_selftest_refuse_arguments_that_cannot_test(argv, words):
    r = attnfuzz(*argv)
    assert r.returncode == 2 and words in r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and " on cpu (" not in r.stdout  # refused before anything ran


@pytest.mark.parametrize("argv, option", [
    (("gate", "--no-repros", "--junit", "{blocked}/g.xml"), "--junit"),
    (("gate", "--no-repros", "--json", "{dir}"), "--json"),
    (("selftest", "--markdown", "{blocked}/t.md"), "--markdown"),
    (("selftest", "--junit", "{dir}"), "--junit"),
])
def test_gate_and_selftest_check_their_outputs_before_the_first_campaign(tmp_path, argv, option):
    (tmp_path / "afile").write_text("")
    argv = [a.format(blocked=tmp_path / "afile", dir=tmp_path) for a in argv]
    start = time.monotonic()
    r = attnfuzz(*argv, "--targets", "vllm.index_remap", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and f"{option} " in r.stderr and "cannot write there" in r.stderr, r.stdout + r.stderr
    assert " on cpu (" not in r.stdout and time.monotonic() - start < 60


def _finding(tmp_path, **change) -> Path:
    d = tmp_path / "finding"
    shutil.copytree(ROOT / "repros" / "index-remap-7e944ef6", d)
    record = json.loads((d / "finding.json").read_text())
    (d / "finding.json").write_text(json.dumps({**record, **change}))
    return d


@pytest.mark.parametrize("change, words", [
    ({"inject": "no-such-mutant"}, "its injected mutant 'no-such-mutant' is missing"),
    ({"inject": "/nowhere/deleted_mutant.py"}, "its injected mutant '/nowhere/deleted_mutant.py' is missing"),
    ({"target": "vllm.renamed_target"}, "target 'vllm.renamed_target' is not one this attnfuzz knows"),
])
def test_a_replay_that_cannot_say_anything_of_the_bug_exits_2_naming_what_is_missing(tmp_path, change, words):
    """Once: a finding whose mutant was gone gave a traceback and exit 1, "bug present"."""
    r = attnfuzz("replay", str(_finding(tmp_path, **change)))
    assert r.returncode == 2 and words in r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "still failing" not in r.stdout


@pytest.mark.vllm
def test_a_replay_on_a_release_without_the_targets_api_exits_2_naming_it(tmp_path):
    env = _without_remap(tmp_path)
    r = subprocess.run([sys.executable, "-m", "fuzzer.cli", "replay", str(ROOT / "repros" / "index-remap-7e944ef6")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # a new interpreter: hidden
    assert r.returncode == 2, r.stdout + r.stderr
    assert ("target vllm.index_remap is not available here: cannot import "
            "vllm.v1.attention.backends.mla.sparse_utils") in r.stderr and "Traceback" not in r.stderr


def test_report_checks_its_directory_and_outputs_first(tmp_path):
    r = attnfuzz("report", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "nowhere: no such directory" in r.stderr, r.stderr
    r = attnfuzz("report", str(tmp_path))
    assert r.returncode == 2 and "campaign.json: no such file" in r.stderr, r.stderr
    (tmp_path / "campaign.json").write_text("{}")
    (tmp_path / "report.md").mkdir()
    r = attnfuzz("report", str(tmp_path))
    assert r.returncode == 2 and "report.md: cannot write there (it is a directory)" in r.stderr, r.stderr


# -- issue 35, item 5: two distinct failures replayed from the example database under --no-shrink -----------------

# An --inject file: selftest.fault's oracle fails one way on cases of two requests, another on three or more.
TWO_BUGS = '''from fuzzer.targets.selftest import SelftestFault
from oracles.verdict import Verdict, passed


def _two_bugs(case, obs):
    n = len(case.requests)
    if n == 2:
        return [Verdict("output", False, "bug A: two requests", where="two-requests")]
    if n >= 3:
        return [Verdict("output", False, "bug B: three or more requests", where="many-requests")]
    return [passed("selftest", "one request")]


SelftestFault.oracle = staticmethod(_two_bugs)
'''


@pytest.mark.vllm
@pytest.mark.parametrize("extra", [(), ("--max-findings", "1")])
def test_two_stored_failures_without_shrinking_are_saved_printed_and_exit_1(tmp_path, monkeypatch, extra):
    """Once: a BaseExceptionGroup traceback, exit 1, nothing under --repros, no --json, both findings left
    unannounced in .attnfuzz/pending/ (Hypothesis's replay of each failure before it reports them stopped the
    campaign past --max-examples, once per failure, and grouped the stops)."""
    monkeypatch.setenv("ATTNFUZZ_FAULT", "hang:1000000")  # selftest.fault's own faults: never
    bugs = tmp_path / "two_bugs.py"
    bugs.write_text(TWO_BUGS)
    state = tmp_path / "state"
    run = ("run", "--target", "selftest.fault", "--inject", str(bugs), "--no-shrink", "--reruns", "0", "--quiet")
    first = attnfuzz(*run, "--max-examples", "40", "--repros", str(tmp_path / "first"), state=state)  # stores both
    assert first.returncode == 1 and first.stdout.count("FOUND") == 2, first.stdout + first.stderr[-3000:]
    r = attnfuzz(*run, "--max-examples", "2", *extra, "--repros", str(tmp_path / "repros"), "--json",
                 str(tmp_path / "s.json"), state=state)
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "ExceptionGroup" not in r.stderr
    s = json.loads((tmp_path / "s.json").read_text())
    assert sorted(f["signature"] for f in s["findings"]) == ["output:many-requests", "output:two-requests"]
    printed = r.stdout.replace("\n", "")  # rich folds long lines
    assert r.stdout.count("FOUND") == 2 and "2 finding(s)" in printed
    for f in s["findings"]:
        assert f"FOUND {tmp_path / 'repros' / f['id']}" in printed and f["shrunk"] is False
        report = (tmp_path / "repros" / f["id"] / "report.md").read_text()
        assert "not shrunk (the campaign ran without shrinking, --no-shrink): the case as first found" in report
        assert "shrunk to:" not in report
    assert not list((state / "pending" / "selftest.fault").glob("*/finding.json"))


def test_a_target_module_that_does_not_import_is_skipped_and_a_gate_of_only_it_could_not_test(tmp_path):
    """A target whose own module fails to import (a broken checkout, a stand-in missing) is that target's lack, named,
    never a traceback with exit 1; and a gate whose every campaign was skipped tested nothing: exit 2, not 0."""
    script = tmp_path / "gate.py"
    script.write_text(
        "import sys\n"
        "from fuzzer.targets import registry\n"
        "registry.REGISTERED['vllm.broken'] = 'fuzzer.targets.no_such_module:Broken'\n"
        "from fuzzer.cli import main\n"
        f"sys.exit(main(['gate', '--targets', 'vllm.broken', '--no-repros', '--out', {str(tmp_path / 'g')!r}, "
        f"'--json', {str(tmp_path / 'g.json')!r}]))\n")
    done = python(str(script), cwd=ROOT)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "vllm.broken: skipped (its module does not import: ModuleNotFoundError" in done.stdout
    assert "COULD NOT TEST" in done.stdout and not json.loads((tmp_path / "g.json").read_text())["passed"]
