"""`vllm.flashmla_sparse.layer.dcp` on CPU: MLAAttention.forward_impl on every emulated DCP rank (query gather,
LSE combine, the dense-MHA route's DCP context gather), judged as the layer over the undivided context."""

import functools

import pytest

from strategies.case import Case, Dcp, Request, TopkSpec
from tests.fuzzer.targets.judged import run_fixed_and_saved

pytestmark = pytest.mark.vllm


@functools.cache
def target():
    from fuzzer.targets.flashmla_layer_dcp import FlashMLASparseLayerDcp

    t = FlashMLASparseLayerDcp("cpu")
    if t.unavailable():
        pytest.skip(t.unavailable())
    t.prepare()
    return t


def production_step(size: int, interleave: int, heads: int, kv_cache_dtype: str = "fp8_ds_mla") -> Case:
    """A decode with long context, a short prefill with cached context (chunked) and a fresh one."""
    reqs, virtual = (Request(1, 200), Request(6, 70), Request(4, 0)), 64 * size
    table, nxt = [], 1
    for r in reqs:
        n = -(-r.seq_len // virtual)
        table.append(tuple(range(nxt, nxt + n)) + (0,) * (3 - n))
        nxt += n
    return Case(reqs, 1, 64, tuple(table), 128, (TopkSpec(100), TopkSpec(128), TopkSpec(128)), heads=heads,
                kv_cache_dtype=kv_cache_dtype, dcp=Dcp(size, 0, interleave), seed=5).validate()


@pytest.mark.parametrize("size, interleave, heads", [(2, 1, 16), (4, 16, 16), (8, 1, 8)])
def test_the_production_route_is_right_under_dcp(size, interleave, heads):
    t = target()
    case = production_step(size, interleave, heads)
    obs = t.run(case)
    verdicts = t.oracle(case, obs)
    assert obs.error_type is None, obs.notes.get("traceback")
    assert all(v.ok for v in verdicts), verdicts
    assert {"mha.chunked_context.dcp", "dcp.filter", "mqa"} <= set(obs.notes["paths"])  # the DCP context gather ran
    assert obs.notes["route"]["mha_tokens"] == 10 and obs.notes["route"]["chunked_context"]
    assert any("DCP collectives" in e for e in obs.emulated)


def test_a_bf16_cache_under_dcp_runs_the_layer_where_the_release_runs_it_and_is_refused_where_not():
    """0.34 runs the layer under DCP on a bf16 cache (its bf16 forward filters the top-k to the rank's slots; dense
    MHA gathers the bf16 context over the group); 0.33 refuses it with NotImplementedError, which the oracle takes."""
    t = target()
    case = production_step(2, 1, 16, "bfloat16")
    obs = t.run(case)
    verdicts = t.oracle(case, obs)
    assert all(v.ok for v in verdicts), verdicts
    if "bfloat16" in t.dcp_cache_dtypes:
        assert obs.error_type is None and obs.notes["route"]["mha_tokens"] == 10
        assert {"mha.chunked_context.dcp", "dcp.filter.compacted", "kernel.bf16_sparse"} <= set(obs.notes["paths"])
    else:
        assert obs.error_type == "NotImplementedError" and [v.check for v in verdicts] == ["contract"]


def test_a_finding_gets_a_reproducer_that_emulates_the_ranks_and_shows_it(tmp_path):
    """dcp-empty-shard-lse-zero on a step built here (not searched): a decode whose only position is on rank 0, a
    decode with context on both ranks, a short prefill with cached context (dense MHA, the DCP context gather).
    repro.py (torch + vLLM only, the support code beside it) runs every rank's layer over the in-process DCP
    group, exits 1 on the merged output, and 0 with the injected bug left out."""

    from fuzzer.artifacts.repro import SUPPORT_FILE, write_repro
    from fuzzer.env import host_info
    from fuzzer.observation import Observation
    from fuzzer.records import Finding
    from oracles.verdict import Verdict

    t = target()
    case = Case((Request(1, 0), Request(1, 40), Request(6, 70)), 2, 64, ((1,), (2,), (3,)), 128,
                (TopkSpec(1), TopkSpec(128, "scattered"), TopkSpec(128)), heads=16, kv_cache_dtype="fp8_ds_mla",
                dcp=Dcp(2, 0, 1), seed=5).validate()
    verdict = Verdict("output", False, "output off by 3.1x the tolerance at token 0", "G", where="output")
    obs = Observation(t.name, "cpu", notes={"route": {"mqa_tokens": 2, "mha_tokens": 6}})
    finding = Finding(t.name, verdict.signature, case, [verdict], obs, host_info("cpu"), "dcp-empty-shard-lse-zero", 1, 1.0)
    d = write_repro(finding, t, tmp_path / "repros")
    script = (d / "repro.py").read_text()
    assert (d / SUPPORT_FILE).is_file() and "def replay_layer_dcp_ranks(" in script and "layer_forward(layer, " in script
    assert "on_dcp_ranks(dcp_size, rank_step)" in script and "def layer_forward(" in (d / SUPPORT_FILE).read_text()
    run = run_fixed_and_saved(d)
    assert "merged output off by" in run.stdout and "'mha_tokens': 6" in run.stdout, run.stdout
