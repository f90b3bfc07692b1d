"""The `vllm.flashmla_sparse` target on CPU: vLLM's FlashMLA builder + forward_mqa with torch stand-ins for
FlashMLA's kernels and the cache ops, judged by the attention oracle the way the campaign's `check` does."""

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from fuzzer.support.interp.sanitizer import SANITIZER
from fuzzer.targets.flashmla_sparse import FlashMLASparse
from strategies.case import Case, Request, TopkSpec
from strategies.profiles import PROFILES
from tests.conftest import run_repro
from tests.fuzzer.targets.judged import SERVED

pytestmark = pytest.mark.vllm


@functools.cache
def target():
    from fuzzer.targets.flashmla_sparse import FlashMLASparse

    t = FlashMLASparse("cpu")
    if t.unavailable():
        pytest.skip(t.unavailable())
    t.prepare()
    return t


def _passes_topk_length_in_place() -> bool:
    """0.26.0 passes in-place valid counts as FlashMLA's topk_length: rows with a -1 before a valid entry lose it
    (docs/bug-reports/vllm-0.26.0-flashmla-sparse-topk-length-in-place.md)."""
    import inspect

    from vllm.v1.attention.backends.mla import flashmla_sparse, sparse_utils

    return ("topk_length=topk_length" in inspect.getsource(flashmla_sparse)
            and "COMPACT_TO_FRONT=return_valid_counts" not in inspect.getsource(sparse_utils))


def check(case: Case):
    t = target()
    # The bf16 kernel takes topk_length on the bf16 path and for the fp8 separate path's prefill rows (>= 32 heads).
    if _passes_topk_length_in_place() and (case.kv_cache_dtype == "bfloat16" or case.heads >= 32) and any(
            s.invalid_at != "tail" or s.past_table for s in case.topk):
        pytest.skip("this release drops valid entries after a -1 (its own class-B bug, see docs/bug-reports)")
    obs = t.run(case)
    verdicts = t.oracle(case, obs)
    assert all(v.ok for v in verdicts), (case.summary(), case.kv_cache_dtype, case.heads, verdicts)
    return obs, verdicts


def mixed_batch(kv_cache_dtype: str, heads: int, block_size: int) -> Case:
    """2 decodes + 1 prefill, the prefill with a chunked context, unwritten positions and out-of-table picks."""
    reqs = (Request(1, 70), Request(1, 5), Request(9, 30))
    table, nxt = [], 1
    for r in reqs:
        n = -(-r.seq_len // block_size)
        table.append(tuple(range(nxt, nxt + n)) + (0,) * (3 - n))
        nxt += n
    from fuzzer.targets.vllm_api import remap_api

    strided = remap_api().has_block_stride_rows  # releases before flat_kv_row_view need contiguous caches
    return Case(requests=reqs, num_decodes=2, block_size=block_size, block_table=tuple(table), topk_width=128,
                topk=(TopkSpec(40), TopkSpec(128, "scattered"), TopkSpec(20, "head", past_table=2)), heads=heads,
                kv_cache_dtype=kv_cache_dtype, block_stride_rows=2 * block_size if strided else 0, seed=3).validate()


@pytest.mark.parametrize("kv_cache_dtype,heads,block_size", [
    ("bfloat16", 16, 64), ("bfloat16", 64, 128),
    ("fp8_ds_mla", 16, 64),  # heads < 32: fp8 mixed batch (the decode kernel for every token)
    ("fp8_ds_mla", 64, 128),  # fp8 separate prefill/decode: upconverted workspace + bf16 prefill kernel
])
def test_mixed_batch_two_decodes_one_prefill(kv_cache_dtype, heads, block_size):
    obs, verdicts = check(mixed_batch(kv_cache_dtype, heads, block_size))
    assert obs.outputs["out"].shape == (11, heads, 512)
    assert {"flash_mla_sparse_fwd", "flash_mla_with_kvcache", "get_mla_metadata", "concat_mla_q"} <= set(obs.emulated)


@pytest.mark.parametrize("kv_cache_dtype,q", [("bfloat16", 2), ("fp8_ds_mla", 1)])
def test_cuda_graph_padding_tokens(kv_cache_dtype, q):
    """A uniform decode batch padded as a full CUDA graph pads it: vLLM gets num_actual_tokens and q rows for the
    padding tokens (no request, slot -1, no valid index); their output rows are dropped, the rest judged.
    vLLM 0.23's fp8 decode path relies on it (it asserted on padding rows without their tokens)."""
    case = Case(requests=(Request(q, 200), Request(q, 90), Request(0, 0)), num_decodes=3, block_size=64,
                block_table=((1, 2, 3, 4), (5, 6, 0, 0), (0, 0, 0, 0)), topk_width=128,
                topk=(TopkSpec(128), TopkSpec(60, "scattered"), TopkSpec(1)), heads=16,
                kv_cache_dtype=kv_cache_dtype, padded_tokens=q).validate()
    obs, _ = check(case)
    assert obs.outputs["out"].shape == (2 * q, 16, 512) and obs.notes["padded_tokens"] == q


def test_generated_cases_pad_like_a_cuda_graph():
    from hypothesis import find

    padded = find(FlashMLASparse("cpu").cases(PROFILES["cpu"]).strategy(), lambda c: c.padded_tokens > 0,
                  settings=settings(max_examples=2000, database=None))
    assert padded.num_decodes == len(padded.requests) and padded.requests[-1].query_len == 0


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(FlashMLASparse("cpu").cases(PROFILES["cpu"]).strategy())  # the strategy needs no vLLM
def test_generated_cases_pass(case):
    check(case)


def test_sparse_prefill_standin_masks_by_contract_and_reports_faults():
    from fuzzer.support.standins.flashmla_ops import (
        flash_mla_sparse_fwd,
        flash_mla_with_kvcache,
        get_mla_metadata,
        quantize_fp8_ds_mla,
    )

    kv = torch.randn(4, 1, 576, dtype=torch.bfloat16)
    q = torch.randn(2, 8, 576, dtype=torch.bfloat16)
    idx = torch.tensor([[[0, 3, -1, 9]], [[-1, -1, -1, -1]]], dtype=torch.int32)  # 9 >= s_kv: invalid by contract
    with SANITIZER.collect() as found:
        out, _, lse = flash_mla_sparse_fwd(q, kv, idx, 0.1, topk_length=torch.tensor([2, 4], dtype=torch.int32))
    assert not found and out[1].eq(0).all() and lse[1].eq(float("inf")).all()  # empty row: 0 and +inf (FlashMLA ref)
    ref, _, _ = flash_mla_sparse_fwd(q[:1], kv, idx[:1, :, :2], 0.1)
    torch.testing.assert_close(out[:1], ref, atol=1e-2, rtol=1e-2)  # same set; summation order may differ
    cache = quantize_fp8_ds_mla(kv[:, 0, :512], kv[:, 0, 512:]).view(1, 4, 1, 656)
    with SANITIZER.collect() as found:  # the decode kernel masks only -1: 7 is past the cache
        flash_mla_with_kvcache(q[None], cache, None, None, 512, get_mla_metadata()[0], softmax_scale=0.1,
                               is_fp8_kvcache=True, indices=torch.tensor([[[0, 7], [1, -1]]], dtype=torch.int32))
    assert [(v.op, v.argument) for v in found] == [("load", "k_cache")]


def test_the_padded_heads_mutant_is_found_and_its_standalone_reproducer_shows_it(tmp_path):
    """flashmla-padded-heads-out (class J, the output keeps FlashMLA's padded heads) found by a campaign of single
    fresh steps (the head envelope needs no earlier step), unshrunk (test_run's seed-bug test shrinks); the saved
    repro.py (torch + vLLM only, attnfuzz's support code in attnfuzz_support.py beside it, the mutant inlined) shows
    the bug and exits 1."""
    import json

    from fuzzer.support.vllm_setup import try_import
    from tests.conftest import attnfuzz

    if FlashMLASparse("cpu").unavailable():
        pytest.skip(FlashMLASparse("cpu").unavailable())
    if try_import("vllm.v1.attention.backends.mla.index_group") is None:
        pytest.skip("the mutant edits 0.33's head slicing; older releases slice differently")
    run = attnfuzz("--device", "cpu", "run", "--target", "vllm.flashmla_sparse", "--inject", "flashmla-padded-heads-out",
                   "--max-examples", "20", "--max-findings", "1", "--reruns", "0", "--max-steps", "1", "--no-shrink", "--quiet",
                   "--repros", str(tmp_path / "repros"), "--json", str(tmp_path / "run.json"), state=tmp_path / "state")
    if run.returncode == 2 and "not found in this vLLM" in run.stderr:
        pytest.skip("the mutant patches 0.33's padded-heads slice; this release has none to patch")
    assert run.returncode == 1, run.stderr[-3000:]
    finding, *_ = json.loads((tmp_path / "run.json").read_text())["findings"]
    assert finding["bug_classes"] == ["J"]
    d = tmp_path / "repros" / finding["id"]
    assert "python repro.py" in (d / "report.md").read_text()
    repro = run_repro(d)
    assert repro.returncode == 1 and "BUG: output has shape" in repro.stdout and "bug present" in repro.stdout, (
        repro.stdout + repro.stderr[-2000:])
    # attnfuzz's support code comes from the generated file beside the script (its modules under their own
    # names), never from attnfuzz; the mutant is inlined
    script = (d / "repro.py").read_text()
    assert (d / "attnfuzz_support.py").is_file() and "def apply(" in script
    assert not [ln for ln in script.splitlines() if ln.strip().startswith(("import fuzzer", "from fuzzer", "from oracles"))
                and not ln.strip().startswith(SERVED)]
