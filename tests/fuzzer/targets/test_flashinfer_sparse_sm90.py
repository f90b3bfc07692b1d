"""`vllm.flashinfer_sparse_sm90` on CPU: vLLM's FLASHINFER_MLA_SPARSE_SM90 builder (its FlashInfer plan, plan reuse and
Triton kv_end clamp) and forward_mqa (index remap, Triton page packing) run for real, FlashInfer's wrapper attnfuzz's
stand-in; judged as the campaign judges. The built-in mutant (class A at this backend's plan) and its reproducer."""

import dataclasses
import functools
import importlib.util

import pytest

from fuzzer.env import host_info
from oracles.verdict import primary
from strategies.case import Case, Request, TopkSpec
from tests.conftest import python, run_repro
from tests.fuzzer.targets.judged import failures

pytestmark = pytest.mark.vllm
W = 128


@functools.cache
def target():
    from fuzzer.targets.flashinfer_sparse_sm90 import FlashInferMLASparseSM90

    t = FlashInferMLASparseSM90("cpu")
    if t.unavailable():
        pytest.skip(t.unavailable())
    t.prepare()
    return t


def _case(reqs, num_decodes, table, **kw) -> Case:
    return Case(requests=reqs, num_decodes=num_decodes, block_size=64, block_table=table, topk_width=W,
                topk=tuple(TopkSpec(W, invalid_at="scattered") for _ in reqs), seed=5, **kw).validate()


def _judged(case):
    return failures(target(), case)


MIXED = dict(reqs=(Request(1, 70), Request(1, 5), Request(9, 30)), num_decodes=2, table=((1, 2), (3, 0), (4, 0)))


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8"])
def test_indexer_rows_pass_through_the_builder_s_plan_and_forward_mqa(kv_cache_dtype):
    obs, failed = _judged(_case(**MIXED, heads=16, kv_cache_dtype=kv_cache_dtype))
    assert not failed, failed
    paths = set(obs.notes["paths"])
    assert {"sm90.plan.upper_bound", "sm90.plan.replanned", "sm90.plan.clamp_kv_end", "sm90.pack_indices",
            "remap.valid_counts", "kernel.flashinfer_mla", "flashinfer.plan.split_kv"} <= paths
    assert ("sm90.fp8" if kv_cache_dtype == "fp8" else "sm90.bf16") in paths
    assert obs.emulated[0].startswith("BatchMLAPagedAttentionWrapper")  # FlashInfer: a stand-in, named
    assert importlib.util.find_spec("flashinfer") is None  # importable only while the builder is made


def test_the_plan_of_a_decode_step_is_reused_by_the_next_and_clamped_to_its_counts():
    """One engine, two decode steps of the same requests one token apart: the planned lengths (+32 tokens of slack)
    still bound the second step's, so vLLM keeps the plan and only clamps each work item's kv_end on the device."""
    first = _case((Request(1, 70), Request(1, 5)), 2, ((1, 2), (3, 0)), heads=32)
    case = dataclasses.replace(first, requests=(Request(1, 71), Request(1, 6)), earlier=(first,)).validate()
    obs, failed = _judged(case)
    assert not failed, failed
    assert {"sm90.plan.reused", "sm90.plan.clamp_kv_end"} <= set(obs.notes["paths"])


def test_the_open_bugs_of_vllm_0_33_0_show():
    """docs/bug-reports/vllm-0.33.0-flashinfer-sm90-*.md: an fp8 cache written with k_scale != 1 is read with
    kpe_scale 1.0 (output off); a full graph of 12 tokens at 128 heads replayed for 4 real ones runs the capture's
    FlashInfer grid on a plan for another cluster size (rows unwritten)."""
    _, failed = _judged(_case(**MIXED, heads=16, kv_cache_dtype="fp8", fp8_scale="arbitrary"))
    assert [v.check for v in failed] == ["output"]
    _, failed = _judged(_case((Request(4, 5), Request(0, 0), Request(0, 0)), 3, ((1,), (0,), (0,)), heads=128,
                              padded_tokens=8, cudagraph="full"))
    assert {"nan", "graph"} <= {v.check for v in failed} and "M" in {v.bug_class for v in failed}


@pytest.fixture(scope="module")
def mutant_finding(tmp_path_factory):
    """The mutant's finding, made in this process with the mutant applied and taken out again: a step of 4 tokens,
    then one of 1 whose lengths the first plan still bounds; its reproducer written as a campaign writes it."""
    from fuzzer.artifacts.repro import write_repro
    from fuzzer.mutants import load
    from fuzzer.records import Finding
    from vllm.v1.attention.backends.mla import flashinfer_mla_sparse_sm90 as sm90

    t = target()
    first = _case((Request(2, 40), Request(2, 20)), 2, ((1,), (2,)), heads=16)
    case = dataclasses.replace(first, requests=(Request(1, 42),), num_decodes=1, block_table=((1,),),
                               topk=first.topk[:1], earlier=(first,)).validate()
    assert not _judged(case)[1]
    original = vars(sm90._SM90State)["plan"]
    try:
        load("sm90-plan-reused-for-fewer-tokens").apply()
        obs, failed = _judged(case)
    finally:
        sm90._SM90State.plan = original
    assert failed and primary(failed).check == "memory" and {v.bug_class for v in failed} == {"A"}
    assert {v.where for v in failed} >= {"_clamp_work_kv_end"}
    finding = Finding(t.name, primary(failed).signature, case, failed, obs, host_info("cpu"),
                      "sm90-plan-reused-for-fewer-tokens", 1, 0.1)
    return write_repro(finding, t, tmp_path_factory.mktemp("repros"))


def test_the_mutant_s_reproducer_shows_the_bug(mutant_finding):
    # A memory finding (class A, in `_clamp_work_kv_end`): its reproducer bounds-checks the interpreted kernels.
    assert "SANITIZER.install()" in (mutant_finding / "repro.py").read_text()
    run = run_repro(mutant_finding)
    assert run.returncode == 1 and "q_nope" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]


def test_the_mutant_s_reproducer_passes_without_the_mutant(mutant_finding):
    script = (mutant_finding / "repro.py").read_text()
    (mutant_finding / "fixed.py").write_text(script.replace("apply()  # the injected bug", "pass  # no injected bug"))
    run = python("fixed.py", cwd=mutant_finding, timeout=300)
    assert run.returncode == 0 and "no bug: fixed" in run.stdout, run.stdout[-2000:] + run.stderr[-3000:]
