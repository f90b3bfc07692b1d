"""fuzzer/pytest_plugin.py: `pytest --attnfuzz TARGETS` collects one item per target and kv-cache dtype (and nothing
else unless paths are named), refuses options it cannot run, and judges each campaign as the gate does: clean
passes, a finding fails with its reproducer's directory, a known open bug found again passes, a campaign that could
not test is an error, in the terminal and in JUnit; with --attnfuzz-replay, each reproducer an item judged by the gate's
replay rules. The campaigns are recorded outcomes here; nightly, real ones:
`vllm.index_remap` for 30 s, green on the clean release and red with a mutant."""

import json
import os
import re
import xml.etree.ElementTree as ET
from importlib.metadata import PackageNotFoundError, entry_points, version
from pathlib import Path

import pytest

import fuzzer.pytest_plugin as plugin
from fuzzer.artifacts.finding_dir import save_finding
from fuzzer.env import HostInfo
from fuzzer.observation import Observation
from fuzzer.records import Finding
from fuzzer.run.campaign_process import CampaignOutcome
from oracles.verdict import Verdict
from strategies.case import Case, Request, TopkSpec
from tests.conftest import ROOT

pytest_plugins = ["pytester"]

try:  # the replays are judged for the installed release
    VLLM = version("vllm")
except PackageNotFoundError:
    VLLM = "0.33.0"

# Installed (`pip install`), pytest loads the plugin by its entry point; from a checkout, -p names it.
PLUGIN = () if any(ep.value == "fuzzer.pytest_plugin" for ep in entry_points(group="pytest11")) else \
    ("-p", "fuzzer.pytest_plugin")


def test_campaigns_are_items_one_per_target_and_kv_cache_dtype(pytester):
    pytester.makepyfile(test_other="def test_other(): pass")
    result = pytester.runpytest_inprocess(*PLUGIN, "--attnfuzz", "vllm.flashmla_sparse,vllm.index_remap",
                                          "--collect-only", "-q")
    result.stdout.fnmatch_lines(["attnfuzz::vllm.flashmla_sparse[[]bfloat16[]]",
                                 "attnfuzz::vllm.flashmla_sparse[[]fp8_ds_mla[]]", "attnfuzz::vllm.index_remap",
                                 "3 tests collected*"])
    assert "test_other" not in result.stdout.str()  # no paths named: the campaigns only
    result = pytester.runpytest_inprocess(*PLUGIN, "--attnfuzz", "vllm.index_remap", "--collect-only", "-q",
                                          "-k", "remap or other", "test_other.py")
    result.stdout.fnmatch_lines(["test_other.py::test_other", "attnfuzz::vllm.index_remap", "2 tests collected*"])


@pytest.mark.parametrize("options, message", [
    (("--attnfuzz", "vllm.nope"), "--attnfuzz: unknown target 'vllm.nope'"),
    (("--attnfuzz", "selftest.fault"), "selftest.fault is the harness's own fault target"),
    (("--attnfuzz", "vllm.index_remap", "--attnfuzz-budget", "soon"), "--attnfuzz-budget: not a duration"),
    (("--attnfuzz", "vllm.index_remap", "--attnfuzz-budget", "0s"), "must be more than 0 s"),
    (("--attnfuzz", "vllm.index_remap", "--attnfuzz-inject", "no-such-bug"), "not a built-in mutant"),
    # tests/conftest.py has hidden the GPUs (CUDA_VISIBLE_DEVICES empty): campaigns on cuda would see none
    (("--attnfuzz", "vllm.index_remap", "--attnfuzz-device", "cuda"), "CUDA_VISIBLE_DEVICES is empty"),
])
def test_options_it_cannot_run_are_usage_errors(pytester, options, message):
    result = pytester.runpytest_inprocess(*PLUGIN, *options)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.stderr.str()


CASE = Case(requests=(Request(1, 5),), num_decodes=1, block_size=64, block_table=((1,),), topk_width=128,
            topk=(TopkSpec(3),)).validate()
HOST = HostInfo("cpu", "x86_64", "0.33.0", "2.13", "3.9", "3.11", True)


def _finding_dir(root: Path, target: str, signature: str) -> str:
    check, _, where = signature.partition(":")
    finding = Finding(target, signature, CASE, [Verdict(check, False, "out-of-bounds store of 4 bytes", "A", where=where)],
                      Observation(target, "cpu", emulated=("concat_and_cache_mla",)), HOST, None, 7, 2.5)
    return str(save_finding(finding, {"repro.py": "print('BUG')\n"}, root))


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    """Campaigns as recorded outcomes, by target: clean, a finding, a known open bug found again, could not test."""
    def run_campaign(spec, device, workdir, timeout_s):
        log = tmp_path / f"{spec.slug}.log"
        log.write_text("attnfuzz: target is not available here: no such kernel\n")
        findings = []
        if spec.target == "vllm.dcp_filter":
            findings = [{"path": _finding_dir(tmp_path / "found", spec.target, "memory:out_ptr"),
                         "signature": "memory:out_ptr", "bug_classes": ["A"], "examples_to_find": 7,
                         "verdicts": [{"check": "memory", "ok": False, "detail": "out-of-bounds store of 4 bytes"}]}]
        elif spec.target == "vllm.triton_sparse":
            findings = [{"path": "-", "signature": "output:output", "verdicts": []}]
        if spec.target == "vllm.indexer":
            return CampaignOutcome(spec, 2, 9.0, None, log)
        summary = {"examples": 12, "seconds": 3.0, "findings": findings, "emulated": {"concat_and_cache_mla": 12}}
        return CampaignOutcome(spec, 1 if findings else 0, 20.0, summary, log)

    monkeypatch.setattr(plugin, "run_campaign", run_campaign)
    repros = tmp_path / "repros" / "triton-sparse-1"
    repros.mkdir(parents=True)  # a known open bug of vllm.triton_sparse, expected present on every release
    (repros / "finding.json").write_text(json.dumps({
        "id": "triton-sparse-1", "target": "vllm.triton_sparse", "signature": "output:output", "status": "open",
        "host": {"vllm": "0.33.0"}, "verdicts": [{"check": "output", "ok": False, "detail": "off"}]}))
    return tmp_path


def test_each_campaign_is_judged_as_the_gate_judges_it(pytester, recorded):
    junit = recorded / "j.xml"
    result = pytester.runpytest_inprocess(*PLUGIN, "--attnfuzz", "vllm.index_remap,vllm.dcp_filter,vllm.triton_sparse",
                                          "--attnfuzz", "vllm.indexer", "--attnfuzz-budget", "30s",
                                          "--attnfuzz-repros", str(recorded / "repros"), f"--junitxml={junit}")
    result.assert_outcomes(passed=2, failed=1, errors=1)
    out = result.stdout.str()
    found = re.search(r"FOUND (\S+)  class A on vllm.dcp_filter, after 7 cases \(2.5 s\) on vLLM 0.33.0 "
                      r"\(cpu; stand-ins for ops this host lacks: concat_and_cache_mla\)", out)
    assert found and (Path(found.group(1)) / "repro.py").is_file(), out
    assert f"reproducer: cd {found.group(1)} && python repro.py" in out
    assert "shrink it: attnfuzz run --target vllm.dcp_filter --seed 0 --time-budget 30s" in out
    result.stdout.fnmatch_lines([("*COULD NOT TEST vllm.indexer[[]bfloat16[]] (exit 2 or a time-out: says nothing about "
                                  "vLLM): exited 2: attnfuzz: target is not available here: no such kernel"),
                                 ("*vllm.triton_sparse[[]bfloat16[]]: passed, 12 cases in 3.0 s (20 s with start-up), "
                                  "stand-ins: concat_and_cache_mla: known open bug(s) found again: output:output "
                                  "(triton-sparse-1)")])
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    assert {c.get("classname") for c in cases.values()} == {"attnfuzz"}
    assert cases["vllm.dcp_filter"].find("failure").get("message").startswith("vllm.dcp_filter: 12 cases")
    assert "COULD NOT TEST" in cases["vllm.indexer[bfloat16]"].find("error").get("message")
    assert cases["vllm.index_remap"].find("failure") is None and cases["vllm.index_remap"].find("error") is None
    emulated = cases["vllm.index_remap"].find("properties/property[@name='emulated']").get("value")
    assert emulated == "concat_and_cache_mla"


def test_a_mutant_goes_to_every_campaign_and_to_the_sessions_library_checks(pytester, recorded, monkeypatch):
    seen = []
    monkeypatch.setattr(plugin, "run_campaign", lambda spec, *a: seen.append(spec) or CampaignOutcome(
        spec, 0, 1.0, {"examples": 1, "findings": []}, recorded / "log"))
    monkeypatch.delenv("ATTNFUZZ_INJECT", raising=False)
    pytester.makepyfile(test_env="import os\ndef test_env():\n    assert os.environ['ATTNFUZZ_INJECT'] == 'remap-count-past-table'\n")
    result = pytester.runpytest_inprocess(*PLUGIN, "--attnfuzz", "vllm.index_remap", "--attnfuzz-inject",
                                          "remap-count-past-table", "test_env.py")
    result.assert_outcomes(passed=2)
    assert [s.inject for s in seen] == ["remap-count-past-table"] and "--inject" in seen[0].argv("cpu", recorded)
    assert "ATTNFUZZ_INJECT" not in os.environ  # the session's mutant ended with it


def _repro(root: Path, id: str, exits: int, **record) -> None:
    """A reproducer of vllm.index_remap whose repro.py exits `exits`; `record`: its finding.json's status, releases,
    host."""
    d = root / id
    d.mkdir(parents=True)
    (d / "finding.json").write_text(json.dumps({
        "id": id, "target": "vllm.index_remap", "signature": "memory:out_ptr", "status": "open",
        "host": {"vllm": VLLM, "device": "cpu"}, "verdicts": [{"check": "memory", "ok": False,
                                                                   "detail": "out-of-bounds store"}], **record}))
    (d / "repro.py").write_text(f"import sys\nprint('repro {id}')\nsys.exit({exits})\n")


def test_replays_are_items_one_per_reproducer_judged_by_the_gates_rules(pytester, tmp_path):
    """--attnfuzz-replay: each reproducer replayed as the gate replays it, for the installed vLLM: a
    known bug still there and a fixed one still gone pass, one expected present that now passes passes and says so, a
    fixed bug back fails, a reproducer that cannot run its call errs, one made on a GPU is skipped on a CPU."""
    repros = tmp_path / "repros"
    _repro(repros, "known", 1)
    _repro(repros, "now-passes", 0)
    _repro(repros, "fixed", 0, status="fixed", releases={VLLM: "absent"})
    _repro(repros, "regressed", 1, status="fixed", releases={"0.23.0": "present", VLLM: "absent"})
    _repro(repros, "broken", 2)
    _repro(repros, "gpu", 1, host={"vllm": VLLM, "device": "cuda"})
    junit = tmp_path / "j.xml"
    common = (*PLUGIN, "--attnfuzz-replay", "--attnfuzz-repros", str(repros), "--attnfuzz-device", "cpu",
              "--attnfuzz-out", str(tmp_path / "out"))
    result = pytester.runpytest_inprocess(*common, "--collect-only", "-q")
    result.stdout.fnmatch_lines(["attnfuzz::replay[[]broken[]]", "attnfuzz::replay[[]fixed[]]", "*6 tests collected*"])
    result = pytester.runpytest_inprocess(*common, f"--junitxml={junit}", "-rs")
    result.assert_outcomes(passed=3, failed=1, errors=1, skipped=1)
    result.stdout.fnmatch_lines([  # in order: errors, failures, the attnfuzz summary, pytest's skips
        "*COULD NOT TEST replay broken (vllm.index_remap): BROKEN: the reproducer could not run its call (exit 2)*",
        f"*REGRESSION: a fixed bug is back on vLLM {VLLM}: out-of-bounds store*",
        f"*reproducer: cd {repros / 'regressed'} && python repro.py*",
        f"replay known: known (*): known bug, still present on vLLM {VLLM}*",
        f"replay now-passes: now-passes (*): expected present on vLLM {VLLM}, now passes: good news; record it in "
        "finding.json*",
        "*replay gpu: not runnable here: made on cuda; this host runs cpu*"])
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    assert cases["replay[regressed]"].find("failure") is not None
    assert cases["replay[broken]"].find("error") is not None
    outcome = cases["replay[fixed]"].find("properties/property[@name='outcome']").get("value")
    assert outcome == "fixed" and cases["replay[fixed]"].find("failure") is None
    assert (tmp_path / "out" / "repro-logs" / "known.log").read_text() == "repro known\n"


def test_replay_without_reproducers_is_a_usage_error(pytester, tmp_path):
    result = pytester.runpytest_inprocess(*PLUGIN, "--attnfuzz-replay", "--attnfuzz-repros", str(tmp_path / "none"))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--attnfuzz-repros: --repros" in result.stderr.str() and "no such directory" in result.stderr.str()


# -- nightly: real campaigns ------------------------------------------------------------------------------------

@pytest.mark.nightly
@pytest.mark.parametrize("inject", [None, "remap-count-past-table"])
def test_a_real_campaign_green_on_the_release_and_red_with_a_mutant(pytester, monkeypatch, inject):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    junit = pytester.path / "j.xml"
    result = pytester.runpytest_subprocess(
        *PLUGIN, "--attnfuzz", "vllm.index_remap", "--attnfuzz-budget", "30s", f"--junitxml={junit}",
        "--attnfuzz-out", str(pytester.path / "out"), *(("--attnfuzz-inject", inject) if inject else ()),
        "-p", "no:cacheprovider", timeout=900)
    case = next(ET.parse(junit).getroot().iter("testcase"))
    assert case.get("classname") == "attnfuzz" and case.get("name") == "vllm.index_remap" + (f"+{inject}" if inject else "")
    if inject is None:
        result.assert_outcomes(passed=1)
        return
    result.assert_outcomes(failed=1)
    found = re.search(r"FOUND (\S+)  class \S+ on vllm.index_remap, injected bug remap-count-past-table", result.stdout.str())
    assert found and (Path(found.group(1)) / "repro.py").is_file(), result.stdout.str()
    assert case.find("failure") is not None
