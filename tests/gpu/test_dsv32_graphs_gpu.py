"""On a GPU: `vllm.dsv32.attention`'s full-graph engine captures DeepseekV32Attention's seam (both layers, the indexer
in it) as a torch.cuda.CUDAGraph before its first step and replays every uniform decode step from it, as vLLM's
runner does under FULL_DECODE_ONLY; each replay gives the bits of the same step run eagerly on the same metadata
and passes the module's oracle."""

import pytest
import torch

from tests.fuzzer.targets.test_dsv32_attention import graph_trace

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (ATTNFUZZ_TEST_DEVICE=cuda)")]


@pytest.mark.parametrize("skip", [False, True])
def test_full_graph_decode_steps_are_captured_and_replayed(skip):
    from fuzzer.support.cudagraphs import EMULATED
    from fuzzer.targets.dsv32_attention import Dsv32Attention

    t = Dsv32Attention("cuda")
    if t.unavailable():
        pytest.skip(t.unavailable())
    t.prepare()
    assert t.captures_graphs()
    case = graph_trace(skip=skip)
    obs = t.run(case)
    verdicts = t.oracle(case, obs)
    assert obs.error is None and all(v.ok for v in verdicts), (case.summary(), obs.error, verdicts)
    for o in (*obs.steps, obs):
        graphs = o.notes["cudagraph"]
        assert graphs["captured"] == [[4, 1]] and graphs["replayed"] == 4 and not graphs["emulated"], graphs
        assert EMULATED not in o.emulated
    assert any(v.check == "graph" and v.ok for v in verdicts), verdicts
