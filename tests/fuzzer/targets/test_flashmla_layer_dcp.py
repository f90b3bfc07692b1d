"""`vllm.flashmla_sparse.layer.dcp` on CPU: MLAAttention.forward_impl on every emulated DCP rank (query gather,
LSE combine, the dense-MHA route's DCP context gather), judged as the layer over the undivided context."""

import functools

import pytest

from strategies.case import Case, Dcp, Request, TopkSpec

pytestmark = pytest.mark.vllm


@functools.cache
def target():
    from fuzzer.targets.flashmla_layer_dcp import FlashMLASparseLayerDcp

    t = FlashMLASparseLayerDcp("cpu")
    if t.unavailable():
        pytest.skip(t.unavailable())
    t.prepare()
    return t


def production_step(size: int, interleave: int, heads: int) -> Case:
    """A decode with long context, a short prefill with cached context (chunked) and a fresh one."""
    reqs, virtual = (Request(1, 200), Request(6, 70), Request(4, 0)), 64 * size
    table, nxt = [], 1
    for r in reqs:
        n = -(-r.seq_len // virtual)
        table.append(tuple(range(nxt, nxt + n)) + (0,) * (3 - n))
        nxt += n
    return Case(reqs, 1, 64, tuple(table), 128, (TopkSpec(100), TopkSpec(128), TopkSpec(128)), heads=heads,
                kv_cache_dtype="fp8_ds_mla", dcp=Dcp(size, 0, interleave), seed=5).validate()


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
