"""`vllm.flashinfer_sparse_sm100` and `vllm.flashinfer_sparse_sm120` on CPU: vLLM's FLASHINFER_MLA_SPARSE and
FLASHINFER_MLA_SPARSE_SM120 builders and forward_mqa run for real, FlashInfer's kernel attnfuzz's stand-in for each
device; judged as the campaign judges. Each built-in mutant (at the backend's own call site) and its reproducer."""

import dataclasses
import importlib.util

import pytest

from fuzzer.env import host_info
from oracles.verdict import primary
from strategies.case import Case, Request, TopkSpec
from tests.fuzzer.targets.judged import failures, prepared, run_saved_then_fixed

pytestmark = pytest.mark.vllm
W = 128


def target(name):
    return prepared(name)


def _case(reqs, num_decodes, table, valid=W, **kw) -> Case:
    return Case(requests=reqs, num_decodes=num_decodes, block_size=64, block_table=table, topk_width=W,
                topk=tuple(TopkSpec(valid, invalid_at="scattered") for _ in reqs), seed=5, **kw).validate()


def _judged(name, case):
    return failures(target(name), case)


MIXED = dict(reqs=(Request(1, 70), Request(1, 5), Request(9, 30)), num_decodes=2, table=((1, 2), (3, 0), (4, 0)))


@pytest.mark.parametrize("kv_cache_dtype,fp8_scale", [("bfloat16", "pow2"), ("fp8", "pow2"), ("fp8", "arbitrary")])
def test_sm100_indexer_rows_pass_through_the_index_group_and_the_trtllm_gen_call(kv_cache_dtype, fp8_scale):
    """An fp8 cache: MLAAttention quantizes the query with the layer's q_scale, vLLM folds q/k scales into the
    kernel's bmm scales; judged against attention over the quantized query (the result carries its scale)."""
    name = "vllm.flashinfer_sparse_sm100"
    obs, failed = _judged(name, _case(**MIXED, heads=16, kv_cache_dtype=kv_cache_dtype, fp8_scale=fp8_scale))
    assert not failed, failed
    assert {"index_group.convert", "remap.valid_counts", "kernel.trtllm_gen_sparse", "mqa",
            "sm100.fp8" if kv_cache_dtype == "fp8" else "sm100.bf16"} <= set(obs.notes["paths"])
    assert obs.emulated[0].startswith("trtllm_batch_decode_with_kv_cache_mla (attnfuzz stand-in")
    assert any("major == 10" in s for s in obs.notes["shims"])  # the platform check bypassed, said so
    assert ("query_fp8_scale" in obs.notes) == (kv_cache_dtype == "fp8")
    assert importlib.util.find_spec("flashinfer") is None  # importable only during the kernel call


def test_sm100_graph_padding_rows_select_nothing_and_are_not_judged_where_the_kernel_s_answer_is_not_public():
    name = "vllm.flashinfer_sparse_sm100"
    case = _case((Request(1, 70), Request(1, 5), Request(0, 0)), 3, ((1, 2), (3, 0), (0, 0)), heads=16,
                 padded_tokens=1, cudagraph="full")
    obs, failed = _judged(name, case)
    assert not failed, failed
    assert any("seq_lens 0" in what for what in obs.notes["not_public"]) and "out_padded" not in obs.outputs
    assert "padded_tokens_not_judged" in obs.notes


@pytest.mark.parametrize("fp8_scale,fmt", [("pow2", "pow2_fp32"), ("arbitrary", "arbitrary_fp32")])
def test_sm120_reads_fp8_ds_mla_with_the_model_s_scale_format_and_rows_of_no_index_give_0(fp8_scale, fmt):
    """DeepSeek-V3.2's power-of-two tile scales (pow2_fp32), GLM-5's arbitrary ones (arbitrary_fp32); a request whose
    top-k row holds no valid index: the kernel's answer is public (0), and judged."""
    name = "vllm.flashinfer_sparse_sm120"
    case = dataclasses.replace(_case(**MIXED, heads=32, kv_cache_dtype="fp8_ds_mla", fp8_scale=fp8_scale),
                               topk=(TopkSpec(W, invalid_at="scattered"), TopkSpec(0), TopkSpec(40, invalid_at="head")))
    obs, failed = _judged(name, case.validate())
    assert not failed, failed
    assert {"remap", "kernel.sm120_sparse", f"sm120.{fmt}", "mqa"} <= set(obs.notes["paths"])
    assert obs.emulated[0].startswith("trtllm_batch_decode_with_kv_cache_mla (attnfuzz stand-in: sparse MLA v32/GLM")
    assert not obs.notes.get("not_public")


def _draft_trace() -> Case:
    """Two MTP draft steps (the second on the first's metadata updated in place), then a decode step."""
    later = _case((Request(1, 12), Request(1, 9)), 2, ((1,), (2,)), heads=16)
    first = dataclasses.replace(later, requests=(Request(1, 10), Request(1, 7)), seed=11)
    draft = dataclasses.replace(later, requests=(Request(1, 11), Request(1, 8)), seed=12, mtp_draft=True)
    return dataclasses.replace(later, earlier=(first, draft)).validate()


def _mutant_finding(name, mutant, case, restore, tmp_path_factory):
    from fuzzer.artifacts.repro import write_repro
    from fuzzer.mutants import load
    from fuzzer.records import Finding

    assert not _judged(name, case)[1]
    try:
        load(mutant).apply()
        obs, failed = _judged(name, case)
    finally:
        restore()
    finding = Finding(name, primary(failed).signature, case, failed, obs, host_info("cpu"), mutant, 1, 0.1)
    return failed, write_repro(finding, target(name), tmp_path_factory.mktemp("repros"))


@pytest.fixture(scope="module")
def sm100_mutant(tmp_path_factory):
    from vllm.v1.attention.backends.mla import flashinfer_mla_sparse as fi

    cls = fi.FlashInferMLASparseTRTLLMMetadataBuilder
    original = vars(cls)["update_draft_decode_metadata"]
    failed, repro = _mutant_finding("vllm.flashinfer_sparse_sm100", "sm100-draft-update-last-token", _draft_trace(),
                                    lambda: setattr(cls, "update_draft_decode_metadata", original), tmp_path_factory)
    assert "M" in {v.bug_class for v in failed} and {v.check for v in failed} >= {"draft"}
    return repro


@pytest.fixture(scope="module")
def sm120_mutant(tmp_path_factory):
    from vllm.v1.attention.backends.mla import flashinfer_mla_sparse_sm120 as sm120

    cls = sm120.FlashInferMLASparseSM120Impl
    original = vars(cls)["forward_mqa"]
    case = _case(**MIXED, heads=16, kv_cache_dtype="fp8_ds_mla")
    failed, repro = _mutant_finding("vllm.flashinfer_sparse_sm120", "sm120-block-stride-in-elements", case,
                                    lambda: setattr(cls, "forward_mqa", original), tmp_path_factory)
    assert primary(failed).check == "memory" and "C" in {v.bug_class for v in failed}
    return repro


@pytest.mark.parametrize("which", ["sm100_mutant", "sm120_mutant"])
def test_the_mutant_s_reproducer_shows_the_bug_and_passes_without_it(which, request):
    repro = request.getfixturevalue(which)
    run_saved_then_fixed(repro)
