"""End to end through the CLI, against the installed vLLM's real Python and Triton code (CPU, interpreted).

Each campaign runs in a fresh process: mutants patch vLLM process-wide.
"""

import json
import os
from pathlib import Path

import pytest

from tests.conftest import attnfuzz, python, run_repro

pytestmark = pytest.mark.vllm


def _api():
    from fuzzer.targets import vllm_api

    return vllm_api.remap_api()


def _load(path):
    return json.loads(path.read_text())


# Seeds whose 8 swarm cases still take multi-tile top-k widths (4224), decodes and prefills, and for the filter
# several DCP sizes and both filter modes, at a fifth (index, 96 s -> 19 s) and a half (filter, 19 s -> 11 s) of
# seed 1's interpreted cost on the 2-core CPU: the cost of a case is its widest tiles times its tokens.
@pytest.mark.parametrize("target, seed", [("vllm.index_remap", 0), ("vllm.dcp_filter", 3)])
def test_clean_campaign(target, seed, tmp_path):
    if target == "vllm.dcp_filter" and not _api().has_dcp_filter:
        r = attnfuzz("run", "--target", target, "--max-examples", "5")
        assert r.returncode == 2 and "not available" in r.stderr
        return
    # Its own state: no example another test's campaign of this target stored is replayed among the 8 cases.
    r = attnfuzz("run", "--target", target, "--seed", str(seed), "--max-examples", "8", "--json",
                 str(tmp_path / "s.json"), "--repros", str(tmp_path / "repros"), state=tmp_path / "state")
    summary = _load(tmp_path / "s.json")
    assert summary["examples"] >= 8
    if _api().checks_row_contract or target == "vllm.dcp_filter":
        assert r.returncode == 0, r.stdout + r.stderr
        assert summary["findings"] == []
    else:  # releases before the fix for issue 48611 (e.g. 0.23.0) have the seed bug themselves
        assert r.returncode == 1
        assert {c for f in summary["findings"] for c in f["bug_classes"]} == {"A"}


def test_seed_bug_is_found_shrunk_and_reproduced(tmp_path):
    # The plain search: shrinking and the reproducer are under test here (a swarm's wide cases shrink slower).
    # No --repros: a finding is saved under the state directory, not in repros/ (the gate's corpus).
    r = attnfuzz("run", "--target", "vllm.index_remap", "--inject", "remap-no-length-check", "--seed", "5",
                 "--max-examples", "300", "--max-findings", "1", "--reruns", "1", "--search", "plain",
                 "--json", str(tmp_path / "s.json"), state=tmp_path / "state")
    assert r.returncode == 1, r.stdout + r.stderr
    summary = _load(tmp_path / "s.json")
    (finding,) = summary["findings"]
    # What is counted: the budget holds for searched cases; shrinking and re-runs are counted apart.
    assert summary["examples"] <= 300 and summary["shrink_cases"] > 0 and summary["startup_seconds"] > 0
    assert summary["rerun_cases"] == 1 and finding["shrunk"] is True and finding["inject"] == "remap-no-length-check"
    assert "shrunk case:" in r.stdout and "injected bug remap-no-length-check" in r.stdout
    repros = tmp_path / "state" / "findings"
    assert Path(finding["path"]).parent == repros
    assert finding["bug_classes"] == ["A"]
    assert finding["verdicts"][0]["check"] == "memory"
    assert any("out-of-bounds store" in m for m in finding["memory"])
    case = _load(repros / finding["id"] / "case.json")
    # Shrunk, though not always to the 2-request minimum: the interpreter's bounds checker sees a store only
    # where it leaves every argument's allocation, so whether the smallest batches show the overrun depends on
    # where the allocator put the arguments (seen: 3 requests, and 5 once the example database was live).
    assert len(case["requests"]) <= 6 and sum(r["query_len"] for r in case["requests"]) <= 8
    repro = run_repro(repros / finding["id"], timeout=300, fresh=True)  # a new interpreter, as a stranger runs it
    assert repro.returncode == 1, repro.stdout + repro.stderr
    assert "BUG: out-of-bounds store" in repro.stdout
    assert "attnfuzz" not in "".join(l for l in (repros / finding["id"] / "repro.py").read_text().splitlines()
                                     if l.startswith(("import", "from")))
    replay = attnfuzz("replay", str(repros / finding["id"]), "--save-repro", str(tmp_path / "here"))
    assert replay.returncode == 1 and "still failing" in replay.stdout
    # The same finding's reproducer for the host that replayed it (how a CPU finding gets a GPU repro.py).
    (ported,) = (tmp_path / "here").iterdir()
    assert {p.name for p in ported.iterdir()} >= {"repro.py", "case.json", "finding.json", "report.md"}
    assert json.loads((ported / "finding.json").read_text())["inject"] == finding["inject"]


# Seeds: B and G are found by seed 1's 3rd case (seed 0's 6th, after 7-10 s of wide index cases on the CPU); seed
# 1's first finding of C is a B (the same wrong rows read as a count), seed 0's is C at its 3rd case.
@pytest.mark.parametrize("target, mutant, bug_class, seed", [
    ("vllm.index_remap", "remap-count-past-table", "B", 1),
    ("vllm.index_remap", "remap-past-table-not-invalid", "C", 0),
    ("vllm.dcp_filter", "dcp-owner-ignores-interleave", "G", 1),
])
def test_mutant_is_found_by_a_default_campaign(target, mutant, bug_class, seed, tmp_path):
    if target == "vllm.dcp_filter" and not _api().has_dcp_filter:
        pytest.skip("this vLLM release has no DCP filter")
    # Found within 40 cases, not shrunk (shrinking is the seed bug's test); the search stops at its first finding.
    # Its own state (example database): an unshrunk failure must not be what another test's campaign replays.
    r = attnfuzz("run", "--target", target, "--inject", mutant, "--seed", str(seed), "--max-examples", "40",
                 "--max-findings", "1", "--no-shrink", "--reruns", "0",
                 "--json", str(tmp_path / "s.json"), "--repros", str(tmp_path / "repros"), state=tmp_path / "state")
    assert r.returncode == 1, r.stdout + r.stderr
    summary = _load(tmp_path / "s.json")
    (finding,) = summary["findings"]  # --max-findings 1: the search stopped at it
    assert bug_class in finding["bug_classes"] and summary["examples"] < 40
    # A finding kept as first found is not called shrunk.
    assert finding["shrunk"] is False
    assert "case (as first found, not shrunk)" in r.stdout and "shrunk case" not in r.stdout


@pytest.mark.nightly  # 26 s on the CI host; a mutant found with its standalone reproducer stays in CI (test_flashmla_sparse)
def test_topk_length_mutant_is_found_on_the_flashmla_layer(tmp_path):
    """Class B at backend level: stale entries past the valid count, read because topk_length is dropped."""
    from fuzzer.support.vllm_setup import try_import

    if try_import("vllm.v1.attention.backends.mla.index_group") is None:
        pytest.skip("the layer target and this mutant are written against 0.33 (no index group here)")
    r = attnfuzz("run", "--target", "vllm.flashmla_sparse.layer", "--inject", "flashmla-topk-length-dropped",
                 "--kv-cache-dtype", "bfloat16", "--max-examples", "10", "--reruns", "0", "--max-steps", "1",
                 "--no-shrink", "--json", str(tmp_path / "s.json"), "--repros", str(tmp_path / "repros"))
    assert r.returncode == 1, r.stdout + r.stderr
    finding, *_ = _load(tmp_path / "s.json")["findings"]  # (a trace may show it under more than one signature)
    assert finding["examples_to_find"] <= 10 and finding["inject"] == "flashmla-topk-length-dropped"
    assert (tmp_path / "repros" / finding["id"] / "repro.py").exists()


NARROWED = """
import json, sys
from fuzzer import cli
from fuzzer.commands import run
from fuzzer.targets.registry import TARGETS

NARROWED = ("kv_cache_dtypes", "cudagraph_modes")


def metadata():  # every registered target's class and base classes: what each defines of the narrowed names
    return {f"{c.__module__}.{c.__qualname__}": {k: v for k, v in vars(c).items() if k in NARROWED}
            for cls in TARGETS.values() for c in cls.__mro__}


before, seen = metadata(), []


class Spy(run.Campaign):
    def __init__(self, target, *args, **kwargs):
        seen.append(target)
        super().__init__(target, *args, **kwargs)


run.Campaign = Spy
rc = cli.main(sys.argv[1:])
(target,) = seen
print(json.dumps({"rc": int(rc), "metadata_changed": metadata() != before,
                  "on_the_instance": sorted(set(vars(target)) & set(NARROWED))}))
"""


def test_a_narrowed_campaign_leaves_the_targets_metadata_alone(tmp_path):
    """`--kv-cache-dtype` and `--cudagraph` narrow the cases through the run's RunPlan, an argument: neither the
    target's class (nor any class it derives from) nor the instance the campaign drives is written to."""
    r = python("-c", NARROWED, "--device", "cpu", "run", "--target", "vllm.flashmla_sparse", "--kv-cache-dtype",
               "bfloat16", "--cudagraph", "full", "--max-examples", "3", "--max-steps", "1", "--reruns", "0",
               "--quiet", "--json", str(tmp_path / "s.json"), "--out", str(tmp_path / "out"), "--repros",
               str(tmp_path / "repros"), env=dict(os.environ, ATTNFUZZ_STATE=str(tmp_path / "state")))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report == {"rc": 0, "metadata_changed": False, "on_the_instance": []}
    assert _load(tmp_path / "s.json")["kv_cache_dtypes"] == ["bfloat16"]
    cases = _load(tmp_path / "out" / "campaign.json")["cases"]
    assert len(cases) >= 3 and {c["kv_cache_dtype"] for c in cases} == {"bfloat16"}
    assert all("cudagraph=full" in c["summary"] for c in cases)


def test_usage_errors_exit_2(tmp_path):
    r = attnfuzz("run", "--target", "vllm.nope")
    assert r.returncode == 2 and "unknown target" in r.stderr
    r = attnfuzz("run", "--target", "vllm.index_remap", "--inject", "no-such-mutant")
    assert r.returncode == 2 and "neither a built-in mutant" in r.stderr
    r = attnfuzz("run", "--target", "vllm.index_remap", "--max-findings", "0")
    assert r.returncode == 2 and "--max-findings 0" in r.stderr
    bad = tmp_path / "bad"
    bad.mkdir()
    from tests.strategies.test_case import small_case

    data = json.loads(small_case().to_json())
    data["requests"][0]["query_len"] = -2
    (bad / "case.json").write_text(json.dumps(data))
    (bad / "finding.json").write_text(json.dumps({"target": "vllm.index_remap"}))
    r = attnfuzz("replay", str(bad))
    assert r.returncode == 2 and "case.requests[0].query_len" in r.stderr


def test_list_shows_targets_and_mutants():
    r = attnfuzz("list")
    assert r.returncode == 0
    for name in ("vllm.index_remap", "vllm.dcp_filter", "remap-no-length-check", "dcp-owner-ignores-interleave"):
        assert name in r.stdout
