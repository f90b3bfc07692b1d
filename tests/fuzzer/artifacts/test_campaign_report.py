"""Campaign directories and their reports (fuzzer/artifacts/campaign_report.py): what is counted per case, campaign.json,
report.md and a self-contained report.html; `attnfuzz run --out` and `attnfuzz report` end to end."""

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from fuzzer.artifacts.campaign_report import (
    bin_label,
    expected_vs_got,
    load_campaign,
    margin_bin,
    render,
    write_campaign,
)
from fuzzer.env import HostInfo
from fuzzer.errors import RecordError
from fuzzer.observation import Observation
from fuzzer.records import Finding, read_finding
from fuzzer.search.campaign import CampaignResult
from fuzzer.search.caselog import CaseLog
from oracles.verdict import Verdict, passed
from strategies.case import Case
from tests.conftest import ROOT, attnfuzz

HOST = HostInfo("cpu", "x86_64", "0.33.0", "2.13.0+cpu", "3.9.0", "3.11.7", True)
SAVED = ROOT / "repros" / "flashmla-sparse-80e429b9"  # a saved finding with a numeric verdict


def case() -> Case:
    return Case.from_json((SAVED / "case.json").read_text())


def test_margin_bins_are_half_decades():
    assert margin_bin(1.0) == "0" and margin_bin(3.2) == "1" and margin_bin(0.99) == "-1" and margin_bin(0.05) == "-3"
    assert margin_bin(0.0) == "zero" and margin_bin(float("inf")) == "nonfinite" and margin_bin(float("nan")) == "nonfinite"
    assert margin_bin(1e-30) == "-16" and margin_bin(1e30) == "8"  # clamped
    assert [bin_label(k) for k in ("0", "1", "-3", "zero", "nonfinite")] == ["1e0", "3.2e0", "3.2e-2", "0", "inf/nan"]


def test_expected_vs_got_reads_the_oracles_wording():
    # oracles/attention_judge.py (got vs reference) and oracles/index.py (got, expected X)
    assert expected_vs_got("output off by 39.57x the tolerance (atol 0.0111, rtol 0.01); worst at token 0 head 0 "
                           "dim 358: 0 vs -0.7266") == ("worst at token 0 head 0 dim 358", "-0.7266", "0")
    assert expected_vs_got("row 3 (decode): 2 entries differ; first [3,5] = 1234, expected -1 (topk entry 5)")[1:] == ("-1", "1234")
    assert expected_vs_got("row 0 (prefill): valid count 5, expected 3")[1:] == ("3", "5")
    assert expected_vs_got("output shape (4, 16, 512), expected (4, 16, 128)")[1:] == ("(4, 16, 128)", "(4, 16, 512)")
    assert expected_vs_got("fp8_ds_mla entry of slot 70 reads back 1.5 at element 3, written 1.25 (2 elements off)") == (
        "fp8_ds_mla entry of slot 70 at element 3", "1.25", "1.5")
    assert expected_vs_got("49152 non-finite outputs; first token 0 head 0") is None


def test_case_log_counts_paths_margins_and_parts():
    log = CaseLog()
    obs = Observation("t", "cpu", real=("builder",), emulated=("flash_mla_sparse_fwd",),
                      notes={"paths": ["mqa", "bf16"], "shims": ["PIN_MEMORY=False"], "allocator_poisoned": True})
    log.add(case(), obs, [passed("output", margin=0.05)])
    obs2 = Observation("t", "cpu", notes={"paths": ["mqa", "fp8.mixed_batch"]})
    rec = log.add(case(), obs2, [Verdict("output", False, "off", margin=40.0, where="output"),
                                 Verdict("lse", False, "off", margin=float("inf"), where="lse")])
    assert rec["verdict"] == "output:output" and rec["paths"] == ["fp8.mixed_batch", "mqa"]
    assert rec["margins"] == {"output": 40.0, "lse": "inf"}
    assert log.coverage == {"mqa": 2, "bf16": 1, "fp8.mixed_batch": 1}
    assert log.first_seen == {"bf16": 1, "mqa": 1, "fp8.mixed_batch": 2}
    assert log.margins == {"output": {"-3": 1, "3": 1}, "lse": {"nonfinite": 1}}
    assert log.verdicts == {"ok": 1, "output:output": 1}
    assert (log.real, log.emulated, log.shims) == ({"builder": 1}, {"flash_mla_sparse_fwd": 1}, {"PIN_MEMORY=False": 1})
    assert log.allocator_poisoned == 1 and log.to_dict()["allocator_poisoned"] == 1  # results say it took effect


class _Tags(HTMLParser):
    """Balanced tags and no external resources: the page must open on its own."""
    VOID = {"meta", "br", "line", "rect", "polyline", "path", "circle", "img", "input", "hr"}

    def __init__(self):
        super().__init__()
        self.stack, self.errors, self.svgs = [], [], 0

    def handle_starttag(self, tag, attrs):
        self.svgs += tag == "svg"
        for k, v in attrs:
            if k in ("src",) or (k == "href" and v and v.startswith(("http:", "https:", "//"))):
                self.errors.append(f"external {k}={v}")
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.svgs += tag == "svg"

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()


def _campaign_dir(tmp_path: Path, inside: bool) -> Path:
    finding = Finding.from_record(read_finding(SAVED), Case.from_json((SAVED / "case.json").read_text()))
    result = CampaignResult("vllm.flashmla_sparse", examples=2, seconds=1.5, findings=[finding],
                            checks={"output:ok": 1, "output:FAIL": 1}, workers_started=1)
    result.cases.add(case(), Observation("t", "cpu", notes={"paths": ["mqa", "bf16"]}), [passed("output", margin=0.2)])
    result.cases.add(case(), Observation("t", "cpu", notes={"paths": ["mqa"]}), finding.verdicts)
    out = tmp_path / "campaign"
    repro = out / "repros" / finding.id if inside else tmp_path / "elsewhere" / finding.id
    repro.mkdir(parents=True)
    for name in ("case.json", "finding.json", "report.md"):
        (repro / name).write_text((SAVED / name).read_text())
    write_campaign(out, result, host=HOST, seed=7, inject=None, profile="cpu", findings_saved=[repro],
                   options={"max_examples": 2, "isolation": "worker", "sanitizer": None})
    return out


@pytest.mark.parametrize("inside", [True, False])
def test_campaign_directory_and_reports(tmp_path, inside):
    out = _campaign_dir(tmp_path, inside)
    doc = json.loads((out / "campaign.json").read_text())
    assert doc["target"] == "vllm.flashmla_sparse" and doc["seed"] == 7 and doc["host"]["vllm"] == "0.33.0"
    assert doc["coverage"] == {"mqa": 2, "bf16": 1} and len(doc["cases"]) == 2
    (f,) = doc["findings"]
    assert f["path"] == ("repros/" if inside else "findings/") + f["id"]  # outside DIR: copied in
    assert (out / f["path"] / "case.json").is_file()
    md, page = render(out)
    text = md.read_text()
    for section in ("## Findings (1)", "## Path coverage", "## Error margins", "## Real vs stand-in", "- expected: -0.7266",
                    "+ got:      0", f"]({f['path']}/repro.py)", "`mqa` | 2 | 100%", "Never taken here"):
        assert section in text, section
    html = page.read_text()
    tags = _Tags()
    tags.feed(html)
    assert not tags.errors and tags.stack == [], (tags.errors, tags.stack)
    assert tags.svgs == 2  # the output-margin histogram and the coverage growth chart
    assert "expected: -0.7266" in html and f'href="{f["path"]}/repro.py"' in html


def test_report_errors_name_the_file_and_field(tmp_path):
    with pytest.raises(RecordError, match="campaign.json: no such file"):
        load_campaign(tmp_path)
    (tmp_path / "campaign.json").write_text(json.dumps({"schema": 1, "target": "x"}))
    with pytest.raises(RecordError, match="field 'host' is missing"):
        load_campaign(tmp_path)


@pytest.mark.vllm
def test_run_out_then_report_end_to_end(tmp_path):
    out = tmp_path / "c"
    # The plain search: a swarm's index cases include the remap's widest tiling (4,224 entries a row), 10-20 s a
    # case under the interpreter, and this test is about the campaign directory, not the search.
    r = attnfuzz("run", "--target", "vllm.index_remap", "--seed", "1", "--max-examples", "6", "--isolation", "none",
                 "--search", "plain", "--repros", str(tmp_path / "repros"), "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads((out / "campaign.json").read_text())
    assert doc["examples"] >= 6 and len(doc["cases"]) == doc["examples"]
    assert doc["coverage"]["remap"] == doc["examples"]  # every case converts through vLLM's remap
    assert all("remap" in c["paths"] for c in doc["cases"])
    (out / "report.html").unlink()
    r = attnfuzz("report", str(out))
    assert r.returncode == 0 and (out / "report.html").is_file(), r.stdout + r.stderr
    assert attnfuzz("report", str(tmp_path / "none")).returncode == 2
