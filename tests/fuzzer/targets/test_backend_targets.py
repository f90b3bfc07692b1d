"""Whole-backend targets on CPU: vLLM's pure-Triton sparse-MLA backend (builder, impl, kernels)."""

import json

import pytest
import torch

from fuzzer.support.interp.sanitizer import SANITIZER
from fuzzer.support.standins.cache_ops import concat_and_cache_mla
from tests.conftest import attnfuzz, run_repro


def test_concat_and_cache_mla_standin_writes_slots_and_checks_bounds():
    cache = torch.zeros(2, 4, 576, dtype=torch.bfloat16)
    kv_c, k_pe = torch.ones(3, 512), torch.full((3, 64), 2.0)
    with SANITIZER.collect() as found:
        concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([5, -1, 8]), "auto", torch.ones(()))
    assert cache[1, 1, :512].eq(1).all() and cache[1, 1, 512:].eq(2).all()
    assert cache.view(-1, 576).ne(0).any(dim=1).sum() == 1  # padding slot -1 skipped, slot 8 not written
    assert [(v.op, v.argument) for v in found] == [("store", "kv_cache")]


def _xpu_kernel_masks_with_inf() -> bool:
    """Releases up to 0.26 mask with -inf: a fully masked first tile gives NaN (their own class-I bug)."""
    import inspect

    from vllm.v1.attention.ops import xpu_mla_sparse

    return 'float("inf")' in inspect.getsource(xpu_mla_sparse)


@pytest.mark.vllm
def test_clean_triton_sparse_campaign(tmp_path):
    r = attnfuzz("run", "--target", "vllm.triton_sparse", "--seed", "2", "--max-examples", "12",
                 "--json", str(tmp_path / "s.json"), "--repros", str(tmp_path / "repros"), state=tmp_path / "state")
    summary = json.loads((tmp_path / "s.json").read_text())
    if _xpu_kernel_masks_with_inf():
        assert r.returncode == 1 and {c for f in summary["findings"] for c in f["bug_classes"]} == {"I"}
        return
    assert r.returncode == 0, r.stdout + r.stderr
    assert summary["examples"] >= 12


@pytest.mark.vllm
def test_fully_masked_tile_mutant_is_found_and_reproduced(tmp_path):
    if _xpu_kernel_masks_with_inf():
        pytest.skip("this release already has the bug the mutant injects")
    r = attnfuzz("run", "--target", "vllm.triton_sparse", "--inject", "softmax-masked-tile-nan", "--max-examples", "60",
                 "--max-findings", "1",
                 "--json", str(tmp_path / "s.json"), "--repros", str(tmp_path / "repros"), state=tmp_path / "state")
    assert r.returncode == 1, r.stdout + r.stderr
    (finding, *_) = json.loads((tmp_path / "s.json").read_text())["findings"]
    assert "I" in finding["bug_classes"] and finding["verdicts"][0]["check"] == "nan"
    assert finding["emulated"] == ["concat_and_cache_mla"]  # the CPU has no compiled cache ops
    d = tmp_path / "repros" / finding["id"]
    repro = run_repro(d)
    assert repro.returncode == 1 and "BUG:" in repro.stdout and "non-finite" in repro.stdout, repro.stdout + repro.stderr
