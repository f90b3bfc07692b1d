"""`vllm.flashmla_sparse.layer.pcp_dcp` on CPU: every rank of a PCP x TP world fed as vLLM's model runner feeds it
(PCPManager, DefaultModelState), DeepSeek-V3.2's attention layer on FLASHMLA_SPARSE with the PCP + DCP prefill
gather, judged as the layer over the undivided context; its mutants and reproducer."""

import functools
import importlib

import numpy as np
import pytest

from strategies.case import Case, Dcp, Request, TopkSpec, pcp_splits
from tests.fuzzer.targets.judged import run_fixed_and_saved

pytestmark = pytest.mark.vllm


@functools.cache
def target():
    from fuzzer.targets.flashmla_layer_pcp import FlashMLASparseLayerPcp

    t = FlashMLASparseLayerPcp("cpu")
    if t.unavailable():
        pytest.skip(t.unavailable())
    t.prepare()
    return t


def step(pcp: int, size: int, tp: int, heads: int = 16, reqs=None, seed: int = 5) -> Case:
    """A decode with long context, a prefill with cached context long enough to split over the PCP ranks, one too
    short to split (every rank runs it whole), a fresh one that splits."""
    reqs = reqs or (Request(1, 200), Request(12, 40), Request(3, 20), Request(10, 0))
    table, nxt, virtual = [], 1, 64 * size
    for r in reqs:
        n = -(-r.seq_len // virtual)
        table.append(tuple(range(nxt, nxt + n)) + (0,) * (4 - n))
        nxt += n
    num_decodes = sum(1 for r in reqs if r.query_len == 1 and r.context_len >= 100)
    return Case(tuple(reqs), num_decodes, 64, tuple(table), 128, tuple(TopkSpec(128) for _ in reqs), heads=heads,
                kv_cache_dtype="fp8_ds_mla", dcp=Dcp(size, 0, 1, pcp, tp), seed=seed).validate()


GATHER_PATHS = {"pcp_dcp.prefill_shards", "pcp_dcp.prefill_shards.split", "pcp_dcp.prefill_shards.whole",
                "pcp_dcp.kv_gather", "remap.workspace.rank_major", "pcp.cache_inputs_gather", "dcp.filter"}


@pytest.mark.parametrize("pcp, size, tp", [(2, 2, 1), (2, 4, 2)])
def test_a_step_with_cached_context_runs_the_pcp_dcp_gather_and_matches_the_reference(pcp, size, tp):
    t = target()
    case = step(pcp, size, tp)
    obs = t.run(case)
    verdicts = t.oracle(case, obs)
    assert obs.error_type is None, obs.notes.get("traceback")
    assert all(v.ok for v in verdicts) and verdicts[0].check == "output", verdicts
    assert GATHER_PATHS <= set(obs.notes["paths"]), obs.notes["paths"]  # the gather ran, on split and whole rows
    # PCP rank 0 takes chunks 0 and 3 of each split prefill, rank 1 chunks 1 and 2; decodes and the short one whole.
    assert [b["requests"] for b in obs.notes["rank_batches"]] == [6] * pcp * tp
    assert any("collectives" in e for e in obs.emulated) and obs.outputs["out"].shape == (26, 16 * tp * 128)


def test_heads_outside_the_fp8_envelope_are_refused_at_start_up():
    """PCP 2 x TP 2 with DCP 4 gathers q over TP: 64 local heads pad to 64, 128 gathered ones to 128."""
    t = target()
    case = step(2, 4, 2, heads=64)
    obs = t.run(case)
    verdicts = t.oracle(case, obs)
    assert obs.error_type == "NotImplementedError" and [v.check for v in verdicts] == ["contract"], verdicts


def test_the_strategy_splits_prefills_as_vllms_pcp_manager_does():
    manager = importlib.import_module("vllm.v1.worker.gpu.pcp_manager").PCPManager
    for pcp in (2, 4):
        m = manager(pcp, 0, "cpu", shard_decode_requests=False, dcp_world_size=pcp)
        q = np.arange(1, 70)
        assert [not r for r in m.replicated_requests(q, np.ones(len(q), bool))] == [pcp_splits(int(x), pcp) for x in q]


@pytest.mark.parametrize("mutant, verdict", [("pcp-dcp-chunk-rows-paired", "output"),
                                             ("pcp-dcp-shard-rows-own-rank", "error")])
def test_the_mutants_break_the_gather_and_the_oracle_sees_it(mutant, verdict):
    """Each mutant on the step above, then vLLM restored (the same process runs the other tests)."""
    from fuzzer.mutants import load

    fm = importlib.import_module("vllm.v1.attention.backends.mla.flashmla_sparse")
    saved = (fm.gathered_prefill_shards, fm.FlashMLASparseMetadataBuilder._build_fp8_separate_prefill_decode)
    t = target()
    case = step(2, 2, 1)
    try:
        load(mutant).apply()
        obs = t.run(case)
    finally:
        fm.gathered_prefill_shards, fm.FlashMLASparseMetadataBuilder._build_fp8_separate_prefill_decode = saved
    failed = [v for v in t.oracle(case, obs) if not v.ok]
    assert failed and failed[0].check == verdict and failed[0].bug_class == "G", failed
    if verdict == "error":  # the ranks size the DCP all-gather of their shards differently
        assert "all_gather_into_tensor" in obs.error and "different shapes" in obs.error, obs.error


def test_a_finding_gets_a_reproducer_that_emulates_every_rank_and_shows_it(tmp_path):
    """pcp-dcp-chunk-rows-paired on a step built here: two fresh prefills too short to split (one row each on
    every PCP rank, paired into one workspace entry by the mutant). repro.py (torch + vLLM only) runs every rank's
    layer over the in-process groups, exits 1 on the restored output, and 0 with the injected bug left out."""
    from fuzzer.artifacts.repro import SUPPORT_FILE, write_repro
    from fuzzer.env import host_info
    from fuzzer.observation import Observation
    from fuzzer.records import Finding
    from oracles.verdict import Verdict

    t = target()
    case = step(2, 2, 1, reqs=(Request(1, 0), Request(3, 0)))
    verdict = Verdict("output", False, "output off by 68x the tolerance at token 1", "G", where="output")
    obs = Observation(t.name, "cpu", notes={"route": {"mqa_tokens": 4, "mha_tokens": 0}})
    finding = Finding(t.name, verdict.signature, case, [verdict], obs, host_info("cpu"), "pcp-dcp-chunk-rows-paired",
                      1, 1.0)
    d = write_repro(finding, t, tmp_path / "repros")
    script = (d / "repro.py").read_text()
    assert (d / SUPPORT_FILE).is_file() and "pcp_runtime.rank_batch(" in script and "def replay_pcp_ranks(" in script
    assert "on_pcp_ranks(cfg, ranks, groups, pcp, tp, write, rank_step)" in script
    run = run_fixed_and_saved(d)
    assert "merged output off by" in run.stdout and "PCP 2 x TP 1 ranks" in run.stdout, run.stdout
