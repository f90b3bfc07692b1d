"""`vllm.sparse_mla.all` on CPU: one step through every sparse-MLA backend the host runs (FlashMLA, FlashAttention FA3,
vLLM's Triton backend; FlashInfer's SM90 and SM100 ones, FA4 and ROCm's AITER one on cases whose rows are the
indexer's; SM120 with FlashMLA on fp8_ds_mla steps; each with its target's stand-ins), judged against the reference
and pairwise."""

import dataclasses

import json

import pytest
import torch

from fuzzer.observation import Observation
from oracles.backends import judge_backends
from strategies.case import Case, Request, TopkSpec
from tests.conftest import attnfuzz, run_repro

ALL = ("FLASHMLA_SPARSE", "FLASH_ATTN_MLA_SPARSE", "XPU_MLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM90", "FLASHINFER_MLA_SPARSE",
       "FLASHINFER_MLA_SPARSE_SM120", "FLASH_ATTN_MLA_SPARSE_FA4", "ROCM_AITER_MLA_SPARSE")
CASE = Case(requests=(Request(1, 40), Request(3, 20)), num_decodes=1, block_size=64, block_table=((1,), (2,)),
            topk_width=128, topk=(TopkSpec(30), TopkSpec(12)), heads=16, seed=3).validate()


def _part(out: torch.Tensor) -> Observation:
    return Observation("t", "cpu", outputs={"out": out})


def test_the_pairwise_judge_names_the_backend_out_of_line():
    from oracles.attention_judge import reference_for

    ref = reference_for(CASE)[0].to(torch.bfloat16)
    bad = ref.clone()
    bad[1, 2, 3] += 5.0
    obs = Observation("vllm.sparse_mla.all", "cpu", parts={"A": _part(ref), "B": _part(ref.clone()), "C": _part(bad)})
    failed = [v for v in judge_backends(CASE, obs) if not v.ok]
    assert {v.check for v in failed} == {"output", "backends"}
    output = next(v for v in failed if v.check == "output")
    assert output.where == "C:output" and output.detail.startswith("C: ")
    backends = next(v for v in failed if v.check == "backends")
    assert backends.where == "C" and backends.detail.startswith("C disagrees with A, B, which agree")


@pytest.mark.vllm
def test_a_bug_in_one_backend_is_found_as_the_one_out_of_line_and_reproduced_alone(tmp_path):
    """The Triton kernel's fully masked tile (class I) breaks XPU_MLA_SPARSE alone: the finding names it, the other
    backends agree, and its reproducer is XPU_MLA_SPARSE's own."""
    r = attnfuzz("run", "--target", "vllm.sparse_mla.all", "--inject", "softmax-masked-tile-nan", "--seed", "0",
                 "--max-examples", "30", "--max-findings", "1", "--reruns", "0", "--json", str(tmp_path / "s.json"),
                 "--repros", str(tmp_path / "repros"), state=tmp_path / "state")
    assert r.returncode == 1, r.stdout + r.stderr
    (finding,) = json.loads((tmp_path / "s.json").read_text())["findings"]
    assert finding["bug_classes"] == ["I"] and finding["signature"].startswith("nan:XPU_MLA_SPARSE")
    backends = [v for v in finding["verdicts"] if v["check"] == "backends"]
    assert backends and backends[0]["where"] == "XPU_MLA_SPARSE", finding["verdicts"]
    assert "FLASHMLA_SPARSE, FLASH_ATTN_MLA_SPARSE, which agree" in backends[0]["detail"]  # every backend ran
    assert {part.split(":")[0] for part in finding["real"]} == set(ALL)
    repro = run_repro(tmp_path / "repros" / finding["id"])
    assert repro.returncode == 1 and "BUG:" in repro.stdout, repro.stdout + repro.stderr


def _target():
    from fuzzer.targets.sparse_mla_all import SparseMLAAll

    return SparseMLAAll("cpu")


def test_each_backend_takes_the_steps_vllm_would_route_to_it():
    """bf16 to all but SM120 (fp8_ds_mla only), fp8_ds_mla to FlashMLA and SM120; the backends whose rows must be the
    indexer's (SM90's plan, trtllm-gen's rows of no entry, AITER's ragged lengths) left out of drawn rows, AITER also
    of rows whose -1 entries are not at the tail and of eager steps with graph padding. Each left out says why."""
    t = _target()
    t.backends = ALL
    indexer = dataclasses.replace(CASE, topk=(TopkSpec(128), TopkSpec(128))).validate()
    assert set(t.left_out(indexer)) == {"FLASHINFER_MLA_SPARSE_SM120"}
    assert set(t.left_out(CASE)) == {"FLASHINFER_MLA_SPARSE_SM120", "FLASHINFER_MLA_SPARSE_SM90", "FLASHINFER_MLA_SPARSE",
                                     "FLASH_ATTN_MLA_SPARSE_FA4", "ROCM_AITER_MLA_SPARSE"}
    head = dataclasses.replace(CASE, topk=(TopkSpec(128), TopkSpec(128, "head"))).validate()
    assert set(t.left_out(head)) == {"FLASHINFER_MLA_SPARSE_SM120", "ROCM_AITER_MLA_SPARSE"}
    assert "-1 entries" in t.left_out(head)["ROCM_AITER_MLA_SPARSE"]
    padded = dataclasses.replace(indexer, padded_tokens=1)
    assert set(t.left_out(padded)) == {"FLASHINFER_MLA_SPARSE_SM120", "ROCM_AITER_MLA_SPARSE"}
    assert "FULL graph" in t.left_out(padded)["ROCM_AITER_MLA_SPARSE"]
    fp8 = dataclasses.replace(CASE, kv_cache_dtype="fp8_ds_mla", fp8_scale="arbitrary").validate()
    left = t.left_out(fp8)
    assert set(ALL) - set(left) == {"FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM120"}
    assert "bfloat16" in left["FLASH_ATTN_MLA_SPARSE_FA4"] and "fp8_ds_mla step" in left["XPU_MLA_SPARSE"]


@pytest.mark.vllm
@pytest.mark.parametrize("kv_cache_dtype,fp8_scale,ran", [
    ("bfloat16", "pow2", set(ALL) - {"FLASHINFER_MLA_SPARSE_SM120"}),
    ("fp8_ds_mla", "pow2", {"FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM120"}),
    ("fp8_ds_mla", "arbitrary", {"FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM120"}),
])
def test_the_blackwell_backends_agree_with_the_others_on_one_step(kv_cache_dtype, fp8_scale, ran):
    """Indexer rows: bf16 through seven backends, fp8_ds_mla through FlashMLA and SM120 (each tile-scale convention with
    the model whose scale format reads it); every pair within twice the tolerance."""
    t = _target()
    t.prepare()
    case = dataclasses.replace(CASE, topk=(TopkSpec(128), TopkSpec(128)), kv_cache_dtype=kv_cache_dtype,
                               fp8_scale=fp8_scale).validate()
    obs = t.run(case)
    assert set(obs.parts) == ran and not [p.error for p in obs.parts.values() if p.error_type]
    assert not [v for v in t.oracle(case, obs) if not v.ok]
    assert set(obs.notes.get("left_out", {})) == set(ALL) - ran
