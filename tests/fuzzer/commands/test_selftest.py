"""`attnfuzz selftest`: which campaigns it plans, how it judges them (from recorded campaign summaries, not a
mocked vLLM: this is attnfuzz's orchestration), and one short real run of a fast mutant through the CLI."""

import json
import xml.etree.ElementTree as ET

import pytest

from fuzzer import budgets
from fuzzer.commands.selftest import failures, judge_clean, judge_mutant, known_open_bugs, markdown_table, plan
from fuzzer.mutants import MUTANTS, load
from fuzzer.run.campaign_process import CampaignOutcome, CampaignSpec
from tests.conftest import attnfuzz


def _outcome(tmp_path, rc, findings=(), target="vllm.index_remap", inject="remap-count-past-table"):
    log = tmp_path / "log.txt"
    log.write_text("worker started\nRuntimeError: the code this mutant patches is not there\n")
    summary = None if rc in (None, 2) else {"examples": 80, "seconds": 20.0, "findings": list(findings)}
    return CampaignOutcome(CampaignSpec(target, 80, 1, inject=inject), rc, 35.0, summary, log)


def _finding(classes, n, s=1.0):
    return {"id": "x", "path": "/p", "signature": "count:row", "bug_classes": classes, "examples_to_find": n,
            "seconds_to_find": s}


def test_a_mutant_is_found_by_a_finding_of_its_class(tmp_path):
    row = judge_mutant("remap-count-past-table", "B", _outcome(tmp_path, 1, [_finding(["C"], 3), _finding(["B"], 22, 5.3)]))
    assert (row.verdict, row.examples_to_find, row.seconds_to_find, row.found_classes) == ("found", 22, 5.3, ["B", "C"])
    assert row.ok


def test_a_finding_of_another_class_is_detected_but_flagged(tmp_path):
    row = judge_mutant("remap-count-past-table", "B", _outcome(tmp_path, 1, [_finding(["I"], 9), _finding(["C"], 3)]))
    assert (row.verdict, row.examples_to_find, row.found_classes) == ("found-as-other", 3, ["C", "I"])
    assert row.ok and "as class C, I, not B" in row.reason
    assert failures([row]) == [] and failures([row], strict_classes=True) == [row]


def test_nothing_found_is_a_miss(tmp_path):
    row = judge_mutant("remap-count-past-table", "B", _outcome(tmp_path, 0))
    assert row.verdict == "missed" and not row.ok and "no finding in 80 cases" in row.reason
    assert failures([row]) == [row]


def test_a_broken_campaign_is_an_error_not_a_miss(tmp_path):
    row = judge_mutant("remap-count-past-table", "B", _outcome(tmp_path, 2))
    assert row.verdict == "error" and "not there" in row.reason and not row.ok
    assert judge_mutant("m", "B", _outcome(tmp_path, None)).reason.startswith("timed out")


def test_clean_runs(tmp_path):
    assert judge_clean(_outcome(tmp_path, 0, inject=None)).verdict == "clean"
    row = judge_clean(_outcome(tmp_path, 1, [_finding(["I"], 4)], inject=None))
    assert row.verdict == "false-finding" and not row.ok and "/p" in row.reason
    assert judge_clean(_outcome(tmp_path, 2, inject=None)).verdict == "error"


def test_known_open_bugs_go_to_their_target_s_campaigns_as_known_and_are_listed_not_failed(tmp_path):
    """repros/' open bugs expected present on this release: `run --known` on every campaign of their target (a clean
    run does not fail on them, a mutant's campaign does not stop at them); a fixed one is not passed."""
    for rid, status, releases in (("a", "open", {"0.33.0": "present"}), ("b", "fixed", {"0.33.0": "absent"})):
        (tmp_path / rid).mkdir()
        (tmp_path / rid / "finding.json").write_text(json.dumps({
            "id": rid, "target": "vllm.index_remap", "signature": f"output:{rid}", "status": status,
            "releases": releases, "verdicts": []}))
    known = known_open_bugs(tmp_path, "0.33.0")
    assert known == {"vllm.index_remap": ("output:a",)}
    runs, _ = plan("cpu", {"vllm.index_remap": None}, 1, 1.0, ["remap-count-past-table"], targets=["vllm.index_remap"],
                   known=known)
    assert runs and all(spec.extra[-2:] == ("--known", "output:a") for _, _, spec in runs)
    o = _outcome(tmp_path, 0, inject=None)
    o.summary["known_hits"] = {"output:a": 3}
    row = judge_clean(o)
    assert row.verdict == "clean" and row.ok and "output:a x3" in row.reason


def test_plan_runs_each_mutant_on_every_target_it_names_that_runs_here():
    unavailable = {"vllm.index_remap": None, "vllm.dcp_filter": "no DCP filter in 0.23.0", "selftest.fault": None}
    runs, skipped = plan("cpu", unavailable, seed=1, scale=1.0, mutants=["remap-count-past-table"])
    assert [(m, c, s.target, s.inject) for m, c, s in runs] == [
        ("remap-count-past-table", "B", "vllm.index_remap", "remap-count-past-table"),
        (None, "", "vllm.index_remap", None)]  # the clean run; never one on selftest.fault
    assert runs[0][2].max_examples == budgets.SELFTEST_MUTANT_CAP  # it stops at its first finding
    assert runs[1][2].max_examples == budgets.BUDGETS["cpu"]["vllm.index_remap"].selftest
    assert [(r.mutant, r.target, r.verdict) for r in skipped] == [
        ("remap-count-past-table", "vllm.dcp_filter", "skipped"), (None, "vllm.dcp_filter", "skipped")]
    assert all(r.ok for r in skipped)


def test_plan_covers_every_builtin_mutant():
    runs, skipped = plan("cuda", {}, seed=1, scale=1.0, clean=False)  # no target known: all skipped
    assert not runs and {r.mutant for r in skipped} == set(MUTANTS)
    assert len(skipped) == sum(len(load(m).TARGETS) for m in MUTANTS)
    runs, skipped = plan("cpu", {"vllm.index_remap": None, "vllm.dcp_filter": None}, 1, 1.0,
                         ["remap-count-past-table"], targets=["vllm.dcp_filter"])
    assert [(m, s.target) for m, _, s in runs] == [("remap-count-past-table", "vllm.dcp_filter"),
                                                   (None, "vllm.dcp_filter")] and not skipped


def test_a_mutant_no_case_on_this_gpu_can_reach_is_skipped_with_its_reason(monkeypatch):
    """SM100's MXFP8 record: an H200 (SM90) draws none, so the mutant of its gather is skipped there, not missed."""
    import torch

    name, target = "dsv41-mxfp8-scales-not-interleaved", "vllm.dsv41.flashmla"
    for major, runs_it in ((9, False), (10, True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, major=major: (major, 0))
        runs, skipped = plan("cuda", {target: None}, 1, 1.0, [name], clean=False)
        assert bool(runs) == runs_it and (runs_it or "SM100" in skipped[0].reason), (major, skipped)
    runs, _ = plan("cpu", {target: None}, 1, 1.0, [name], clean=False)  # the stand-in reads the record
    assert runs


def test_markdown_table_has_a_row_per_campaign(tmp_path):
    clean = _outcome(tmp_path, 0, inject=None)
    clean.summary["emulated"] = {"flash_mla_sparse_fwd": 40, "concat_and_cache_mla": 40}  # stand-in op -> cases
    rows = [judge_mutant("remap-count-past-table", "B", _outcome(tmp_path, 1, [_finding(["B"], 22, 5.3)])),
            judge_clean(clean)]
    table = markdown_table(rows).splitlines()
    assert len(table) == 4 and "| found | 22 / 5.3 | B |" in table[2] and "clean run" in table[3]
    # Every result names the stand-ins a campaign ran on; "-" where it ran on the host's own ops only.
    assert rows[1].emulated == ["concat_and_cache_mla", "flash_mla_sparse_fwd"]
    assert "| concat_and_cache_mla, flash_mla_sparse_fwd |" in table[3] and "| - |" in table[2]


@pytest.mark.vllm
def test_selftest_finds_a_fast_mutant_end_to_end(tmp_path):
    """One real campaign: the DCP-ownership mutant on vLLM's DCP filter, a small budget (~10 cases)."""
    from fuzzer.targets.registry import TARGETS

    if TARGETS["vllm.dcp_filter"]("cpu").unavailable():
        pytest.skip("this vLLM release has no DCP filter")
    scale = 10 / budgets.BUDGETS["cpu"]["vllm.dcp_filter"].selftest
    r = attnfuzz("--device", "cpu", "selftest", "--mutant", "dcp-owner-ignores-interleave", "--no-clean",
                 "--targets", "vllm.dcp_filter",
                 "--budget-scale", str(scale), "--out", str(tmp_path / "out"), "--json", str(tmp_path / "s.json"),
                 "--junit", str(tmp_path / "s.xml"))
    assert r.returncode == 0, r.stdout + r.stderr
    (row,) = [x for x in json.loads((tmp_path / "s.json").read_text())["rows"] if x["verdict"] != "skipped"]
    # found under its class G, or first seen as the wrong slot's class B (docs/benchmarks.md lists both per seed)
    assert row["verdict"] in ("found", "found-as-other") and row["examples_to_find"] <= 10
    assert row["target"] == "vllm.dcp_filter"
    assert ET.parse(tmp_path / "s.xml").getroot().get("failures") == "0"
    assert "selftest PASSED" in r.stdout
    bad = attnfuzz("selftest", "--mutant", "no-such-mutant")
    assert bad.returncode == 2 and "not a built-in mutant" in bad.stderr
