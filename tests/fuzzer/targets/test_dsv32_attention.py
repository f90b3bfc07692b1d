"""The `vllm.dsv32.attention` target on CPU: DeepSeek-V3.2's attention module, its real indexer feeding FLASHMLA_SPARSE
through `_sparse_indexer_and_attn`, judged stage by stage (oracles/dsv32.py); a short clean campaign and each
built-in mutant of the module's seam found through the CLI."""

import functools

import pytest
import torch

from strategies.case import Case, CaseError, IndexerStep, Request
from tests.fuzzer.targets.judged import assert_reached, clean_campaign, first_finding, prepared, run_judged

pytestmark = pytest.mark.vllm


@functools.cache
def target():
    from fuzzer.targets.dsv32_attention import Dsv32Attention

    t = Dsv32Attention("cpu")
    if t.unavailable():
        pytest.skip(t.unavailable())
    t.prepare()
    return t


def step(requests, num_decodes, table, width=512, heads=32, mtp=0, pad=0, earlier=(), attention_heads=16, skip=True,
         seed=5):
    return Case(requests=tuple(requests), num_decodes=num_decodes, block_size=64, block_table=tuple(table),
                topk_width=width, topk=(), heads=heads, seed=seed, padded_tokens=pad,
                cudagraph="full" if pad else "none", earlier=tuple(earlier),
                indexer=IndexerStep(num_speculative_tokens=mtp, attention_heads=attention_heads,
                                    skip_topk_layer=skip)).validate()


CASES = {
    # MTP decodes (native next_n 2) with an extend and a fresh prefill, contexts past the top-k: every token on MQA
    "mtp_mixed": (step([Request(2, 700), Request(2, 530), Request(6, 600), Request(9, 0)], 2,
                       [tuple(range(1, 13)), tuple(range(13, 22)) + (0,) * 3, tuple(range(22, 32)) + (0, 0),
                        (32,) + (0,) * 11], mtp=1),
                  {"mqa", "indexer.decode.native_mtp", "dsv32.layer.indexer", "dsv32.layer.skip_topk"}),
    # a decode and a short prefill (seq_len <= top-k): the layer sends the prefill to dense MHA
    "dense_mha_split": (step([Request(1, 40), Request(9, 0)], 1, [(1, 0), (2, 0)]),
                        {"mqa", "mha.dense", "indexer.prefill", "dsv32.indexer_op"}),
    # a full CUDA graph's padded decode batch, run eagerly under FULL's mode: padding rows finite
    "graph_padded": (step([Request(1, 1200), Request(1, 80), Request(0, 0), Request(0, 0)], 4,
                          [tuple(range(1, 20)), (20, 21) + (0,) * 17, (0,) * 19, (0,) * 19], pad=2, skip=False),
                     {"batch.padding_rows", "dsv32.layer.indexer"}),
}


@pytest.mark.parametrize("name", CASES)
def test_a_step_is_judged_stage_by_stage(name):
    case, paths = CASES[name]
    obs, verdicts = run_judged(target(), case)
    assert_reached(obs, paths)
    assert {"topk", "cache_write", "output"} <= {v.check for v in verdicts}
    assert ("out_skip_topk" in obs.outputs) == case.indexer.skip_topk_layer
    assert not obs.memory


GRAPH_TABLE = [tuple(range(1, 20)), (20, 21) + (0,) * 17, (0,) * 19, (0,) * 19]


def graph_trace(skip=True):
    """Two padded decode batches of one size, the second a token further on: captured before the first, both
    replayed."""
    first = step([Request(1, 1200), Request(1, 80), Request(0, 0), Request(0, 0)], 4, GRAPH_TABLE, pad=2, skip=skip)
    return step([Request(1, 1201), Request(1, 81), Request(0, 0), Request(0, 0)], 4, GRAPH_TABLE, pad=2, skip=skip,
                earlier=[first])


def test_full_graph_steps_are_captured_and_replayed_where_graphs_are(monkeypatch):
    """The CUDA path (ModuleGraphs), its capture emulated on a CPU (`cudagraphs.FullGraph`): every uniform decode step
    is replayed from the graph captured before the first, and gives the bits of the same step run eagerly."""
    from fuzzer.support.cudagraphs import EMULATED

    t = target()
    monkeypatch.setattr(t, "captures_graphs", lambda: True)
    case = graph_trace()
    obs, verdicts = run_judged(t, case)
    assert len(obs.steps) == 1
    for o in (*obs.steps, obs):
        assert o.notes["cudagraph"]["captured"] == [[4, 1]] and o.notes["cudagraph"]["replayed"] == 4
        assert o.notes["cudagraph"]["emulated"] and EMULATED in o.emulated
        assert "out_eager" in o.outputs and "out_skip_topk" in o.outputs
    assert any(v.check == "graph" and v.ok for v in verdicts), verdicts


def test_a_replay_whose_topk_came_in_another_order_is_not_taken_for_a_stale_one(monkeypatch):
    """On an H100 the replay's attention differed from the eager run's in the bits of the rows whose context passes
    the top-k (cooperative_topk writes its k best in no promised order); the top-k kernel here returns each full row
    in another order every call: the graph check passes, naming the rows it did not compare."""
    from vllm.model_executor.layers.indexer_topk import SparseIndexerTopk

    forward, calls = SparseIndexerTopk.forward, []

    def reordered(self, logits, seq_lens, next_n, topk_indices, topk_tokens, max_seq_len):
        forward(self, logits, seq_lens, next_n, topk_indices, topk_tokens, max_seq_len)
        calls.append(topk_indices.shape[0])
        full = (topk_indices >= 0).all(dim=1)
        order = torch.randperm(topk_indices.shape[1], generator=torch.Generator().manual_seed(len(calls)))
        topk_indices[full] = topk_indices[full][:, order]

    t = target()
    monkeypatch.setattr(t, "captures_graphs", lambda: True)
    monkeypatch.setattr(SparseIndexerTopk, "forward", reordered)
    obs, verdicts = run_judged(t, graph_trace(skip=False))
    assert calls and obs.notes["cudagraph"]["replayed"] == 4
    graph = [v for v in verdicts if v.check == "graph"]
    assert graph and "1 of 2 rows not compared" in graph[0].detail, graph


def test_full_graph_steps_run_eagerly_on_a_cpu():
    obs, _ = run_judged(target(), graph_trace(skip=False))
    assert "cudagraph" not in obs.notes and "out_eager" not in obs.outputs


def test_a_trace_keeps_the_engine():
    table = [(1,) + (0,) * 10, tuple(range(2, 12)) + (0,)]
    first = step([Request(20, 0), Request(30, 600)], 0, table)
    case = step([Request(1, 20), Request(1, 630)], 2, table, earlier=[first])
    obs, _ = run_judged(target(), case)
    assert len(obs.steps) == 1


def test_the_attention_fields_are_checked():
    case, _ = CASES["mtp_mixed"]
    x = case.to_dict()["indexer"]
    with pytest.raises(CaseError, match="indexer.skip_topk_layer"):
        Case.from_dict({**case.to_dict(), "indexer": {**x, "attention_heads": 0}})
    assert Case.from_json(case.to_json()) == case


def test_a_short_clean_campaign(tmp_path):
    clean_campaign(tmp_path, "vllm.dsv32.attention", 8, "--seed", "3")


@pytest.mark.parametrize("mutant", ["dsv32-dense-mha-skip-with-decodes", "dsv32-dense-mha-split-ignores-context"])
def test_a_seam_mutant_is_found(tmp_path, mutant):
    finding = first_finding(tmp_path, "vllm.dsv32.attention", "--max-examples", "20", "--max-findings", "1",
                            "--no-shrink", "--seed", "1", "--inject", mutant)
    assert "F" in finding["bug_classes"], finding


# -- the module on the other Hopper sparse backends (fuzzer/targets/dsv32_attention_backends.py) ---------------------
ON_OTHER_BACKENDS = {"vllm.dsv32.attention.flashattn": "FlashAttnMLASparseMetadataBuilder",
                     "vllm.dsv32.attention.flashinfer_sm90": "FlashInferMLASparseSM90Builder "
                                                             "(FlashInferMLASparseMetadataBuilder, the sparse-MLA builder)"}


# A decode and a 150-token extend: past these builders' decode threshold (128 tokens at 16 heads).
# Its sequence within the top-k (512): dense MHA, its context chunked in (FlashInfer SM90 plans the decode alone).
PAST_THRESHOLD = step([Request(1, 600), Request(150, 100)], 1, [tuple(range(1, 11)), (11, 12, 13, 14) + (0,) * 6])
# Its sequence past the top-k (256): every token on MQA, the indexer's rows; the mutant sends it to dense MHA.
PAST_TOPK = step([Request(1, 600), Request(150, 200)], 1, [tuple(range(1, 11)), tuple(range(11, 17)) + (0,) * 4],
                 width=256)


@pytest.mark.parametrize("name", ON_OTHER_BACKENDS)
def test_the_module_on_another_backend_splits_past_its_threshold_and_the_seam_mutants_are_found(name):
    import inspect

    import vllm.model_executor.layers.attention.sparse_mla_attention as sma
    import vllm.model_executor.layers.sparse_attn_indexer as sai

    from fuzzer.mutants import inject

    t = prepared(name)
    assert ON_OTHER_BACKENDS[name] in t.real_parts and "FlashMLASparseMetadataBuilder" not in t.real_parts
    for case, mha_tokens, paths in ((PAST_THRESHOLD, 150, {"mqa", "mha.dense", "mha.chunked_context"}),
                                    (PAST_TOPK, 0, {"mqa"})):
        obs, _ = run_judged(t, case)
        assert obs.notes["route"] == {"mqa_tokens": 1 + 150 - mha_tokens, "mha_tokens": mha_tokens}
        assert_reached(obs, paths)
        assert "out_skip_topk" in obs.outputs
    saved = vars(sma.SparseMLACommonMetadataBuilder)["build"]
    inject("dsv32-dense-mha-split-ignores-context")
    try:
        found = [v for v in t.oracle(PAST_TOPK, t.run(PAST_TOPK)) if not v.ok]
    finally:  # the rest of the session runs unpatched vLLM
        sma.SparseMLACommonMetadataBuilder.build = saved
    assert "F" in {v.bug_class for v in found if v.check == "route"}, found
    indexer_op = inspect.unwrap(sai.sparse_attn_indexer)  # the mutant sets new code on this function object
    code = indexer_op.__code__
    inject("dsv32-dense-mha-skip-with-decodes")
    try:
        found = [v for v in t.oracle(PAST_THRESHOLD, t.run(PAST_THRESHOLD)) if not v.ok]
    finally:
        indexer_op.__code__ = code
    assert "F" in {v.bug_class for v in found if v.check == "route"}, found
