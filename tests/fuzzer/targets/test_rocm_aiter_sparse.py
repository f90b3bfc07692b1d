"""`vllm.rocm_aiter_sparse` on CPU: vLLM's ROCM_AITER_MLA_SPARSE builder and forward_mqa run for real (an emulated
gfx950), AITER's planner and decode attnfuzz's stand-in; judged as the campaign judges. The open padding-rows bug
(repros/rocm-aiter-sparse-6d1468ed), the built-in mutant at the backend's own builder, and its reproducer."""

import dataclasses
import importlib.util

import pytest

from fuzzer.env import host_info
from oracles.verdict import primary
from strategies.case import Case, Request, TopkSpec
from tests.fuzzer.targets.judged import failures, prepared, run_saved_then_fixed

pytestmark = pytest.mark.vllm
NAME = "vllm.rocm_aiter_sparse"
W = 128


def target():
    return prepared(NAME)


def _case(reqs, num_decodes, table, **kw) -> Case:
    """Top-k rows as DeepSeek's indexer fills them: min(visible, topk) valid entries first, then -1."""
    return Case(requests=reqs, num_decodes=num_decodes, block_size=64, block_table=table, topk_width=W,
                topk=tuple(TopkSpec(W, invalid_at="tail") for _ in reqs), seed=5, **kw).validate()


def _judged(case):
    return failures(target(), case)


# A decode past the top-k width (its row full, split over two AITER work items), a short decode, a prefill.
MIXED = dict(reqs=(Request(1, 200), Request(1, 5), Request(9, 30)), num_decodes=2, table=((1, 2, 5, 6), (3, 0, 0, 0),
                                                                                          (4, 0, 0, 0)))


@pytest.mark.parametrize("kv_cache_dtype,heads", [("bfloat16", 16), ("fp8", 8), ("bfloat16", 128)])
def test_indexer_rows_through_the_ragged_remap_and_aiter_s_persistent_decode(kv_cache_dtype, heads):
    """bf16 and per-tensor fp8 (the impl quantizes the query with the layer's q_scale; judged against attention over
    that query); 8 heads padded to AITER's 16 and sliced back. The stand-in is importable only during the calls."""
    obs, failed = _judged(_case(**MIXED, heads=heads, kv_cache_dtype=kv_cache_dtype))
    assert not failed, failed
    assert obs.emulated[0].startswith("aiter.mla.mla_decode_fwd (attnfuzz stand-in")
    assert any("gfx950" in s for s in obs.notes["shims"])  # the platform answered as a gfx950's, said so
    assert ("query_fp8_scale" in obs.notes) == (kv_cache_dtype == "fp8")
    assert not obs.notes.get("not_public")
    assert importlib.util.find_spec("aiter") is None


def test_a_trace_keeps_one_builder_and_its_plan_across_steps():
    """Two steps on one engine: the second shrinks the batch (the builder re-zeroes its req_id tail) and changes the
    lengths (a new plan); the last step runs twice on the same metadata (the same bits)."""
    later = _case((Request(1, 31), Request(1, 6)), 2, ((1,), (2,)), heads=16)
    first = dataclasses.replace(later, requests=(Request(1, 30), Request(1, 5), Request(4, 0)), num_decodes=2,
                                block_table=((1,), (2,), (3,)), topk=later.topk + later.topk[:1], seed=11)
    obs, failed = _judged(dataclasses.replace(later, earlier=(first.validate(),)).validate())
    assert not failed, failed


def test_graph_padding_rows_are_left_unwritten_the_open_bug():
    """A full-graph replay with a padding token: the builder plans AITER for the real tokens only and the output is
    torch.empty, so the padding token's row is never written (repros/rocm-aiter-sparse-6d1468ed, class H)."""
    case = _case((Request(1, 0), Request(0, 0)), 2, ((1,), (0,)), heads=16, padded_tokens=1, cudagraph="full")
    obs, failed = _judged(case)
    assert [v.signature for v in failed] == ["padded_rows:padded_rows"], failed
    assert "padded_replay_not_run_eagerly" in obs.notes


@pytest.fixture(scope="module")
def mutant_repro(tmp_path_factory):
    from vllm.v1.attention.backends.mla import rocm_aiter_mla_sparse as rocm

    from fuzzer.artifacts.repro import write_repro
    from fuzzer.mutants import load
    from fuzzer.records import Finding

    case = _case(**MIXED, heads=16)
    assert not _judged(case)[1]
    original = rocm.generate_sparse_seqlen_kernel
    try:
        load("rocm-sparse-seqlen-excludes-self").apply()
        obs, failed = _judged(case)
    finally:
        rocm.generate_sparse_seqlen_kernel = original
    assert "D" in {v.bug_class for v in failed} or primary(failed).check == "output", failed
    finding = Finding(NAME, primary(failed).signature, case, failed, obs, host_info("cpu"),
                      "rocm-sparse-seqlen-excludes-self", 1, 0.1)
    return write_repro(finding, target(), tmp_path_factory.mktemp("repros"))


@pytest.mark.nightly
def test_the_mutant_s_reproducer_shows_the_bug_and_passes_without_it(mutant_repro):
    run_saved_then_fixed(mutant_repro)


def test_the_mutant_is_found(mutant_repro):
    assert (mutant_repro / "repro.py").is_file()
