"""`vllm.flashattn_sparse_fa4` on CPU: vLLM's FLASH_ATTN_MLA_SPARSE_FA4 builder, forward_mqa and
flash_attn_varlen_func run for real, FA4's _flash_attn_fwd and FlashInfer's trtllm-gen attnfuzz's stand-ins; judged as
the campaign judges. A decode batch takes FA4 (the sparse decode kernel, or the MLA forward one at 128 heads),
anything else trtllm-gen; the built-in mutant at FA4's call site and its reproducer."""

import dataclasses
import importlib.util
import sys

import pytest

from fuzzer.env import host_info
from oracles.verdict import primary
from strategies.case import Case, Request, TopkSpec
from tests.fuzzer.targets.judged import failures, prepared, run_saved_then_fixed

pytestmark = pytest.mark.vllm
NAME, W = "vllm.flashattn_sparse_fa4", 128


def target():
    return prepared(NAME)


def _case(reqs, num_decodes, table, heads=16, **kw) -> Case:
    return Case(requests=reqs, num_decodes=num_decodes, block_size=64, block_table=table, topk_width=W,
                topk=tuple(TopkSpec(W, invalid_at="scattered") for _ in reqs), seed=5, heads=heads, **kw).validate()


def _judged(case):
    return failures(target(), case)


DECODES = dict(reqs=(Request(1, 70), Request(1, 5), Request(2, 30)), num_decodes=2, table=((1, 2), (3, 0), (4, 0)))


@pytest.mark.parametrize("heads,kernel", [(16, "kernel.fa4_sparse_decode"), (128, "kernel.fa4_mla_forward")])
def test_a_decode_batch_runs_fa4_through_vllm_s_own_wrapper(heads, kernel):
    obs, failed = _judged(_case(**DECODES, heads=heads))
    assert not failed, failed
    paths = set(obs.notes["paths"])
    assert {"index_group.convert", "remap.valid_counts", "mqa", kernel} <= paths and "kernel.trtllm_gen_sparse" not in paths
    assert obs.emulated[0].startswith("_flash_attn_fwd (attnfuzz stand-in: FA4")
    assert any("flash_attn_varlen_func" in part for part in obs.real)
    assert any("FlashAttnMLASparseFA4Backend" in s and "major == 10" in s for s in obs.notes["shims"])
    # the stand-ins are importable only during the kernel call
    assert importlib.util.find_spec("flashinfer") is None and "vllm.vllm_flash_attn.cute.interface" not in sys.modules


def test_a_batch_with_a_prefill_past_the_reorder_threshold_runs_trtllm_gen():
    """129 query tokens at 16 heads: past the builder's 128, a prefill; the step's one kernel call is not is_decode."""
    case = _case((Request(1, 70), Request(129, 0)), 1, ((1, 2, 0), (3, 4, 5)), heads=16)
    obs, failed = _judged(case)
    assert not failed, failed
    assert {"batch.mixed", "kernel.trtllm_gen_sparse"} <= set(obs.notes["paths"])
    assert not {"kernel.fa4_sparse_decode", "kernel.fa4_mla_forward"} & set(obs.notes["paths"])


def test_graph_padding_rows_of_a_decode_batch_are_judged_fa4_gives_them_0():
    case = _case((Request(1, 70), Request(1, 5), Request(0, 0)), 3, ((1, 2), (3, 0), (0, 0)), padded_tokens=1,
                 cudagraph="full")
    obs, failed = _judged(case)
    assert not failed, failed
    assert "out_padded" in obs.outputs and (obs.outputs["out_padded"] == 0).all()
    assert "padded_tokens_not_judged" not in obs.notes


def _draft_trace() -> Case:
    later = _case((Request(1, 12), Request(1, 9)), 2, ((1,), (2,)))
    first = dataclasses.replace(later, requests=(Request(1, 10), Request(1, 7)), seed=11)
    draft = dataclasses.replace(later, requests=(Request(1, 11), Request(1, 8)), seed=12, mtp_draft=True)
    return dataclasses.replace(later, earlier=(first, draft)).validate()


def test_mtp_draft_steps_update_the_trtllm_gen_builder_s_metadata_in_place():
    obs, failed = _judged(_draft_trace())
    assert not failed, failed
    assert "mtp_draft.update" in {p for s in obs.steps for p in s.notes.get("paths", ())} | set(obs.notes["paths"])


@pytest.fixture(scope="module")
def mutant_repro(tmp_path_factory):
    from vllm.v1.attention.backends.mla import flashattn_mla_sparse as fa

    from fuzzer.artifacts.repro import write_repro
    from fuzzer.mutants import load
    from fuzzer.records import Finding

    cls = fa.FlashAttnMLASparseFA4Impl
    original = vars(cls)["_forward_mqa_kernel"]
    case = _case(**DECODES)
    assert not _judged(case)[1]
    try:
        load("fa4-seqused-k-valid-counts").apply()
        obs, failed = _judged(case)
    finally:
        cls._forward_mqa_kernel = original
    assert failed and primary(failed).check in ("output", "empty_row"), failed
    finding = Finding(NAME, primary(failed).signature, case, failed, obs, host_info("cpu"),
                      "fa4-seqused-k-valid-counts", 1, 0.1)
    return write_repro(finding, target(), tmp_path_factory.mktemp("repros"))


@pytest.mark.nightly  # two reproducer processes, each importing vLLM: ~45 s
def test_the_mutant_s_reproducer_shows_the_bug_and_passes_without_it(mutant_repro):
    run_saved_then_fixed(mutant_repro)
