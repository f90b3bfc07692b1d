"""`attnfuzz gate`: the JUnit writer, the reproducer status rules, replays of small scripts standing in for
repro.py (attnfuzz's orchestration, not vLLM), campaign verdicts from recorded summaries, and one real gate
run over a reproducer that regressed."""

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from fuzzer import budgets
from fuzzer.artifacts.junit import JUnitCase, JUnitSuite, write_junit
from fuzzer.commands.gate import gate_specs, judge_campaign, junit_suites, replay, replay_outcome, reported_stand_ins
from fuzzer.errors import RecordError
from fuzzer.records import read_finding, release_of
from fuzzer.run.campaign_process import CampaignOutcome, CampaignSpec
from tests.conftest import attnfuzz


# -- JUnit ----------------------------------------------------------------------------------------------
def test_junit_counts_outcomes_and_strips_what_xml_cannot_hold(tmp_path):
    suites = [JUnitSuite("repros", [JUnitCase("a", "passed", 1.5, stdout="known: still there"),
                                    JUnitCase("b", "failed", 2.0, message="REGRESSION", details="\x1b[31mred\x1b[0m\x00")]),
              JUnitSuite("campaigns", [JUnitCase("c", "skipped", message="not here"), JUnitCase("d", "error", 3.0, "broke")],
                         {"vllm": "0.33.0"})]
    root = ET.parse(write_junit(suites, tmp_path / "j.xml", "gate")).getroot()
    assert root.tag == "testsuites" and (root.get("tests"), root.get("failures"), root.get("errors"),
                                         root.get("skipped")) == ("4", "1", "1", "1")
    repros, campaigns = root.findall("testsuite")
    assert repros.get("name") == "repros" and repros.get("time") == "3.500"
    b = repros.find("testcase[@name='b']/failure")
    assert b.get("message") == "REGRESSION" and b.text == "red?"
    assert repros.find("testcase[@name='a']/system-out").text == "known: still there"
    assert campaigns.find("testcase[@name='c']/skipped").get("message") == "not here"
    assert campaigns.find("testcase[@name='d']/error") is not None
    assert campaigns.find("properties/property[@name='vllm']").get("value") == "0.33.0"


def test_junit_rejects_an_unknown_outcome():
    with pytest.raises(ValueError, match="outcome 'ok'"):
        JUnitCase("x", "ok")


# -- status rules -----------------------------------------------------------------------------------------
def _repro(tmp_path, name="r1", rc=None, **meta) -> Path:
    d = tmp_path / name
    d.mkdir()
    record = {"id": name, "target": "vllm.index_remap", "status": "open", "inject": None,
              "host": {"vllm": "0.26.0"}, "verdicts": [{"check": "nan", "ok": False, "detail": "NaN out", "bug_class": "I"}]}
    (d / "finding.json").write_text(json.dumps({**record, **meta}))
    if rc is not None:
        (d / "repro.py").write_text(f"import sys, time\nprint('BUG: x' if {rc} == 1 else 'fine')\n"
                                    f"time.sleep(30) if {rc} == 99 else sys.exit({rc})\n")
    return d


def test_release_is_the_numeric_part():
    assert release_of("0.33.0+cpu") == release_of("v0.33.0") == "0.33.0"


@pytest.mark.parametrize("status, releases, installed, expects", [
    ("open", {}, "0.33.0", True),  # open: present wherever nothing else is recorded
    ("fixed", {}, "0.33.0", False),
    ("fixed", {}, "0.26.0", True),  # the release it was found on counts as present
    ("fixed", {"0.26.0": "absent"}, "0.26.0", False),  # ... unless recorded otherwise
    ("fixed", {"0.23.0": "present"}, "0.23.0+cpu", True),
    ("open", {"0.33.0": "absent"}, "0.33.0", False),
])
def test_which_releases_expect_the_bug(tmp_path, status, releases, installed, expects):
    rec = read_finding(_repro(tmp_path, status=status, releases=releases))
    assert rec.expects_bug(installed) is expects


def test_an_injected_bug_is_not_vllms_on_the_release_it_was_found_on(tmp_path):
    rec = read_finding(_repro(tmp_path, status="fixed", inject="remap-no-length-check"))
    assert not rec.expects_bug("0.26.0")


@pytest.mark.parametrize("expects, rc, outcome", [
    (True, 1, "known"), (True, 0, "now-passes"), (False, 0, "fixed"), (False, 1, "regressed"),
    (False, 2, "broken"), (True, None, "broken"), (False, -11, "broken"),
])
def test_replay_outcomes(expects, rc, outcome):
    assert replay_outcome(expects, rc) == outcome


@pytest.mark.parametrize("meta, field", [({"status": "gone"}, "'status'"), ({"target": 3}, "'target'"),
                                         ({"releases": {"0.33.0": "maybe"}}, "'releases'")])
def test_a_malformed_record_names_the_file_and_field(tmp_path, meta, field):
    d = _repro(tmp_path, **meta)
    with pytest.raises(RecordError, match=f"{d}/finding.json: field {field}"):
        read_finding(d)


@pytest.mark.parametrize("status, rc, outcome", [("fixed", 1, "regressed"), ("fixed", 0, "fixed"), ("open", 1, "known"),
                                                 ("open", 0, "now-passes"), ("open", 3, "broken"), ("open", 99, "broken")])
def test_replay_runs_repro_py_in_its_own_process(tmp_path, status, rc, outcome):
    rec = read_finding(_repro(tmp_path, status=status, rc=rc, releases={"0.26.0": "absent"}))
    r = replay(rec, "cpu", "0.33.0", {"vllm.index_remap": None}, tmp_path / "logs", timeout_s=3)
    assert r.outcome == outcome and r.expected == ("present" if status == "open" else "absent")
    assert r.returncode == (None if rc == 99 else rc)
    if outcome == "regressed":
        assert "NaN out" in r.detail and "BUG: x" in r.log


def test_a_replay_names_the_stand_ins_its_reproducer_ran_on(tmp_path):
    d = _repro(tmp_path, status="open")
    (d / "repro.py").write_text("import sys\nprint('stand-ins for ops this host lacks: concat_and_cache_mla, "
                                "flash_mla_sparse_fwd')\nprint('BUG: x')\nsys.exit(1)\n")
    r = replay(read_finding(d), "cpu", "0.33.0", {"vllm.index_remap": None}, tmp_path / "logs", timeout_s=5)
    assert r.outcome == "known" and r.emulated == ["concat_and_cache_mla", "flash_mla_sparse_fwd"]
    assert "(stand-ins: concat_and_cache_mla, flash_mla_sparse_fwd)" in r.detail
    assert reported_stand_ins("routes: mqa | stand-ins for ops this host lacks: none\n") == []


def test_replay_skips_what_this_host_cannot_run(tmp_path):
    # No repro.py: attnfuzz replays it, so the target must run here.
    rec = read_finding(_repro(tmp_path))
    r = replay(rec, "cpu", "0.33.0", {"vllm.index_remap": "no such kernel in 0.23.0"}, tmp_path / "logs", 5)
    assert r.outcome == "skipped" and "no such kernel" in r.detail
    # A repro.py runs whatever the target detection says (a moved module must show as broken) ...
    rec = read_finding(_repro(tmp_path, "r2", rc=1))
    r = replay(rec, "cpu", "0.33.0", {"vllm.index_remap": "no such kernel in 0.23.0"}, tmp_path / "logs", 5)
    assert r.outcome == "known"
    # ... but not a GPU one on a CPU host.
    rec = read_finding(_repro(tmp_path, "r3", rc=1, host={"vllm": "0.26.0", "device": "cuda"}))
    r = replay(rec, "cpu", "0.33.0", {"vllm.index_remap": None}, tmp_path / "logs", 5)
    assert r.outcome == "skipped" and "made on cuda" in r.detail


def test_a_reproducer_that_cannot_run_on_an_older_unrecorded_release_is_skipped_not_broken(tmp_path):
    # Made on 0.26.0, no record for 0.23.0: its call may not exist there yet.
    rec = read_finding(_repro(tmp_path, rc=2))
    r = replay(rec, "cpu", "0.23.0", {"vllm.index_remap": None}, tmp_path / "logs", 5)
    assert r.outcome == "skipped" and "older vLLM 0.23.0" in r.detail
    # On a release it names, or a newer one (drift), the same exit is broken.
    for installed, releases in (("0.23.0", {"0.23.0": "present"}), ("0.33.0", {})):
        rec = read_finding(_repro(tmp_path, f"r-{installed}", rc=2, releases=releases))
        assert replay(rec, "cpu", installed, {"vllm.index_remap": None}, tmp_path / "logs", 5).outcome == "broken"


# -- campaigns --------------------------------------------------------------------------------------------
def test_gate_specs_one_campaign_per_dtype_and_skips():
    unavailable = {"vllm.index_remap": None, "vllm.flashmla_sparse": None, "vllm.dcp_filter": "not in 0.23.0",
                   "selftest.fault": None}
    dtypes = {"vllm.flashmla_sparse": ("bfloat16", "fp8_ds_mla")}
    specs, skipped = gate_specs("cpu", unavailable, dtypes, seed=5, scale=0.5)
    assert [s.name for s in specs] == ["vllm.index_remap", "vllm.flashmla_sparse[bfloat16]",
                                       "vllm.flashmla_sparse[fp8_ds_mla]"]
    assert specs[0].max_examples == budgets.examples("cpu", "vllm.index_remap", "gate", 0.5) and specs[0].seed == 5
    assert [(s.name, s.outcome, s.reason) for s in skipped] == [("vllm.dcp_filter", "skipped", "not in 0.23.0")]
    assert "--kv-cache-dtype" in specs[1].argv("cpu", Path("/w")) and "--inject" not in specs[1].argv("cpu", Path("/w"))
    # The gate fails on a first new finding, so its campaigns stop there; known open bugs go as --known.
    specs, _ = gate_specs("cpu", unavailable, dtypes, seed=5, scale=0.5, known={"vllm.index_remap": ("memory:k",)})
    argv = " ".join(specs[0].argv("cpu", Path("/w")))
    assert "--max-findings 1" in argv and "--known memory:k" in argv and "--known" not in " ".join(specs[1].argv("cpu", Path("/w")))


def _outcome(tmp_path, rc, findings=(), summary=True):
    log = tmp_path / "log.txt"
    log.write_text("starting\nTraceback: boom\n")
    s = {"examples": 40, "seconds": 12.5, "findings": list(findings)} if summary else None
    return CampaignOutcome(CampaignSpec("vllm.index_remap", 40, 0), rc, 30.0, s, log)


FINDING = {"id": "index-remap-1234", "path": "/out/repros/index-remap-1234", "signature": "memory:k",
           "bug_classes": ["A"], "examples_to_find": 7, "seconds_to_find": 2.0,
           "verdicts": [{"check": "values", "ok": False, "detail": "wrong slot"},
                        {"check": "memory", "ok": False, "detail": "out-of-bounds store", "bug_class": "A"}]}


def test_campaign_verdicts_from_recorded_summaries(tmp_path):
    assert judge_campaign(_outcome(tmp_path, 0)).outcome == "passed"
    served = _outcome(tmp_path, 0)
    served.summary["emulated"] = {"flash_attn_varlen_func": 40}  # a stand-in served the campaign: named
    r = judge_campaign(served)
    assert r.emulated == ["flash_attn_varlen_func"] and "stand-ins: flash_attn_varlen_func" in r.figures
    (suite,) = [s for s in junit_suites([], [r], {}) if s.name == "campaigns"]
    assert "stand-ins: flash_attn_varlen_func" in suite.cases[0].stdout
    failed = judge_campaign(_outcome(tmp_path, 1, [FINDING]))
    assert failed.outcome == "failed" and "out-of-bounds store" in failed.reason  # the primary verdict's title
    assert "/out/repros/index-remap-1234" in failed.reason
    for rc, summary in ((2, True), (None, False), (1, True), (0, False)):  # usage error, timeout, rc vs summary
        broken = judge_campaign(_outcome(tmp_path, rc, summary=summary))
        assert broken.outcome == "error", (rc, summary)
    assert "boom" in judge_campaign(_outcome(tmp_path, 2)).reason


def test_a_known_open_bug_found_again_passes_and_is_reported(tmp_path):
    known = {("vllm.index_remap", "memory:k"): "index-remap-7e944ef6"}
    r = judge_campaign(_outcome(tmp_path, 1, [FINDING]), known)
    assert r.outcome == "passed" and r.known == ["memory:k (index-remap-7e944ef6)"] and "known open" in r.reason
    hit = _outcome(tmp_path, 0)
    hit.summary["known_hits"] = {"memory:k": 3}  # passed to the campaign as --known: counted, not saved
    r = judge_campaign(hit, known)
    assert r.outcome == "passed" and r.known == ["memory:k (index-remap-7e944ef6)"]
    other = dict(FINDING, signature="values:row")  # another symptom on the same target still fails
    assert judge_campaign(_outcome(tmp_path, 1, [FINDING, other]), known).outcome == "failed"


def test_a_clean_campaign_below_the_pair_coverage_minimum_fails(tmp_path):
    o = _outcome(tmp_path, 0)
    o.summary["coverage"] = {"pairs": 0.42, "triples": 0.1}
    r = judge_campaign(o, min_pairs=0.7)
    assert r.outcome == "failed" and "covered 0.42 of the pairs" in r.reason and "0.7" in r.reason
    assert judge_campaign(o, min_pairs=0.4).outcome == "passed"
    assert judge_campaign(_outcome(tmp_path, 0), min_pairs=0.7).outcome == "failed"  # no coverage recorded: not met
    assert judge_campaign(_outcome(tmp_path, 0), min_pairs=0).outcome == "passed"


def test_junit_of_a_failed_campaign_carries_title_and_repro_path(tmp_path):
    (repros, campaigns) = junit_suites([], [judge_campaign(_outcome(tmp_path, 1, [FINDING]))], {"vllm": "x"})
    (case,) = campaigns.cases
    assert case.outcome == "failed" and "out-of-bounds store" in case.message
    assert "/out/repros/index-remap-1234" in case.details


# -- end to end: the CLI ------------------------------------------------------------------------------------
@pytest.mark.vllm
def test_gate_fails_on_a_regressed_reproducer_and_writes_junit(tmp_path):
    (tmp_path / "repros").mkdir()
    _repro(tmp_path / "repros", "old-bug", rc=1, status="fixed", releases={"0.26.0": "absent"})
    _repro(tmp_path / "repros", "open-bug", rc=1, status="open")
    r = attnfuzz("gate", "--no-campaigns", "--repros", str(tmp_path / "repros"), "--junit", str(tmp_path / "g.xml"),
                 "--json", str(tmp_path / "g.json"), "--out", str(tmp_path / "out"))
    assert r.returncode == 1, r.stdout + r.stderr
    root = ET.parse(tmp_path / "g.xml").getroot()
    assert (root.get("tests"), root.get("failures")) == ("2", "1")
    assert "REGRESSION" in root.find(".//testcase[@name='old-bug (vllm.index_remap)']/failure").get("message")
    summary = json.loads((tmp_path / "g.json").read_text())
    assert not summary["passed"] and [x["outcome"] for x in summary["repros"]] == ["regressed", "known"]
    bad = attnfuzz("gate", "--no-campaigns", "--repros", str(tmp_path / "nowhere"))
    assert bad.returncode == 2 and "nowhere: no such directory" in bad.stderr


def test_budgets_scale_and_refuse_nonsense():
    assert budgets.examples("cpu", "vllm.index_remap", "gate", 0.001) == 1
    assert budgets.examples("cuda", "a.target.added.later", "selftest") == budgets.DEFAULT["cuda"].selftest
    with pytest.raises(ValueError, match="device 'tpu'"):
        budgets.examples("tpu", "vllm.index_remap", "gate")


def test_a_known_bug_of_a_backend_is_known_on_the_targets_built_over_it():
    """The 2026-12-05 H100 gate: the open fp8 RoPE-scale bug of vllm.flashinfer_sparse_sm90 (a committed reproducer)
    failed the gate through vllm.flashinfer_sparse_sm90.layer, whose MQA route runs the same forward_mqa."""
    from fuzzer.commands.gate import reached_through

    assert reached_through("vllm.flashinfer_sparse_sm90", "vllm.flashinfer_sparse_sm90.layer")
    assert reached_through("vllm.flashmla_sparse", "vllm.flashmla_sparse")
    assert not reached_through("vllm.flashmla_sparse.layer", "vllm.flashmla_sparse")
    assert not reached_through("vllm.flashmla_sparse", "vllm.flashmla_sparse_v2")


def test_a_known_bug_of_a_backend_is_known_on_a_target_declaring_it_runs_that_backend():
    """vllm.dsv32.attention.flashinfer_sm90 runs DeepSeek-V3.2's module on FlashInfer SM90's layer
    (`runs_backend_of`): that backend's open padded-rows bug is known there, FLASHMLA_SPARSE's and FA's are not."""
    from fuzzer.commands.gate import known_signature

    target = "vllm.dsv32.attention.flashinfer_sm90"
    assert known_signature("vllm.flashinfer_sparse_sm90", "padded_rows:padded_rows", target) == "padded_rows:padded_rows"
    assert known_signature("vllm.flashinfer_sparse_sm90.layer", "output:output", target) == "output:output"
    assert known_signature("vllm.flashmla_sparse", "output:output", target) is None
    assert known_signature("vllm.flashattn_sparse", "output:output", "vllm.dsv32.attention.flashattn") == "output:output"
    assert known_signature("vllm.flashinfer_sparse_sm90", "output:output", "vllm.dsv32.attention.flashattn") is None
    assert known_signature("vllm.flashinfer_sparse_sm90", "output:output", "vllm.dsv32.attention") is None


def test_a_known_bug_of_a_backend_is_known_where_it_runs_side_by_side():
    """vllm.sparse_mla.all names each backend's verdicts after it: FlashInfer SM90's open padding-rows bug comes
    back there as padded_rows:FLASHINFER_MLA_SPARSE_SM90:padded_rows, and must count as known, not new."""
    from fuzzer.commands.gate import SIDE_BY_SIDE, known_signature
    from fuzzer.targets.registry import TARGETS

    assert known_signature("vllm.flashinfer_sparse_sm90", "padded_rows:padded_rows", "vllm.sparse_mla.all") == \
        "padded_rows:FLASHINFER_MLA_SPARSE_SM90:padded_rows"
    assert known_signature("vllm.flashinfer_sparse_sm90", "output:output", "vllm.flashinfer_sparse_sm90.layer") == \
        "output:output"
    assert known_signature("vllm.flashmla_sparse.layer", "output:output", "vllm.sparse_mla.all") is None
    assert known_signature("vllm.rocm_aiter_sparse", "padded_rows:padded_rows", "vllm.sparse_mla.all") == \
        "padded_rows:ROCM_AITER_MLA_SPARSE:padded_rows"
    members = TARGETS["vllm.sparse_mla.all"].BACKENDS
    assert SIDE_BY_SIDE["vllm.sparse_mla.all"] == {cls.name: backend for backend, cls in members.items()}


def test_a_known_graph_replay_bug_is_known_only_where_graphs_are_replayed(tmp_path):
    """FlashInfer SM90's open NaN under replayed full graphs (finding.json "needs": ["graph_replay"]) is known on
    its backend's target, which replays them, but not on targets that run FULL eagerly or never draw it: there a
    NaN is a bug of its own (a module mutant leaving rows unwritten must not pass as the graph bug)."""
    import json

    from fuzzer.commands.gate import known_signature
    from fuzzer.errors import RecordError
    from fuzzer.records import read_finding
    from fuzzer.targets.registry import declared

    rec = read_finding(Path(__file__).resolve().parents[3] / "repros" / "flashinfer-sparse-sm90-8079906f")
    assert rec.needs == ("graph_replay",)
    assert "graph_replay" in declared("vllm.flashinfer_sparse_sm90").reaches
    assert known_signature(rec.target, rec.signature, "vllm.flashinfer_sparse_sm90", rec.needs) == "nan:nan"
    for eager in ("vllm.flashinfer_sparse_sm90.layer", "vllm.dsv32.attention.flashinfer_sm90", "vllm.sparse_mla.all"):
        assert known_signature(rec.target, rec.signature, eager, rec.needs) is None, eager
    bad = json.loads((rec.dir / "finding.json").read_text()) | {"needs": ["a_bigger_gpu"]}
    (tmp_path / "finding.json").write_text(json.dumps(bad))
    with pytest.raises(RecordError, match="field 'needs'"):
        read_finding(tmp_path)
