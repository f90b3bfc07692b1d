"""Traces on the FlashMLA targets: one builder, impl, cache and top-k buffer across steps, through the CLI."""

import json

import pytest

from tests.conftest import attnfuzz, run_repro

pytestmark = pytest.mark.vllm


def _findings(path):
    return json.loads(path.read_text())["findings"]


def test_a_stale_persistent_buffer_is_found_by_traces_and_not_by_single_steps(tmp_path):
    from fuzzer.support.vllm_setup import try_import

    if try_import("vllm.v1.attention.backends.mla.index_group") is None:
        pytest.skip("the mutant patches 0.33's sparse-MLA builder")
    run = ("run", "--target", "vllm.flashmla_sparse", "--inject", "flashmla-req-id-buffer-grow-only", "--seed", "1",
           "--no-shrink", "--reruns", "0")
    r = attnfuzz(*run, "--max-examples", "30", "--max-findings", "1", "--json", str(tmp_path / "t.json"), "--repros", str(tmp_path / "repros"),
                 state=tmp_path / "state")
    assert r.returncode == 1, r.stdout + r.stderr
    # What the stale rows read is whatever the allocator left there: one batch can show the bug under two
    # signatures (an out-of-bounds index, NaN output), each its own finding.
    findings = _findings(tmp_path / "t.json")
    assert findings and all("H" in f["bug_classes"] for f in findings), findings
    finding = findings[0]
    assert "earlier step" in finding["summary"]
    assert any(v["check"] == "stateful" for v in finding["verdicts"])  # the failing step passes alone
    # Its reproducer runs the trace's steps on one builder and impl, and shows the bug without attnfuzz.
    repro = run_repro(tmp_path / "repros" / finding["id"])
    assert repro.returncode == 1, repro.stdout + repro.stderr
    assert "BUG:" in repro.stdout
    # The same campaign on single fresh steps: nothing to find.
    r = attnfuzz(*run, "--max-examples", "12", "--max-steps", "1", "--json", str(tmp_path / "s.json"),
                 "--repros", str(tmp_path / "single"),
                 state=tmp_path / "state-single")
    assert r.returncode == 0, r.stdout + r.stderr
    assert _findings(tmp_path / "s.json") == []


def test_metadata_rebuilt_out_of_place_is_found_by_graph_replay(tmp_path):
    """A builder that copies the block table each step is right eagerly; a full-graph engine replays the copy
    its capture made. Found as class M (replay against the same step run eagerly); the reproducer captures and
    replays. On a CPU the replay is emulated, and every result says so."""
    from fuzzer.support.vllm_setup import try_import

    if try_import("vllm.model_executor.layers.attention.sparse_mla_attention") is None:
        pytest.skip("the mutant patches 0.33's sparse-MLA builder")
    run = ("run", "--target", "vllm.flashmla_sparse", "--inject", "flashmla-graph-block-table-copied", "--seed", "0",
           "--no-shrink", "--reruns", "0", "--max-steps", "1", "--max-findings", "1")
    r = attnfuzz(*run, "--max-examples", "40", "--json", str(tmp_path / "t.json"), "--repros", str(tmp_path / "repros"),
                 state=tmp_path / "state")
    assert r.returncode == 1, r.stdout + r.stderr
    (finding,) = _findings(tmp_path / "t.json")
    assert "M" in finding["bug_classes"] and any(v["check"] == "graph" for v in finding["verdicts"])
    assert any("CUDA graph" in e for e in finding["emulated"])
    repro = run_repro(tmp_path / "repros" / finding["id"])
    assert repro.returncode == 1, repro.stdout + repro.stderr
    assert "replayed from its CUDA graph" in repro.stdout and "CUDA graph capture/replay" in repro.stdout
