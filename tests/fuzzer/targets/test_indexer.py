"""The `vllm.indexer` target on CPU: DeepSeek-V3.2's indexer module and metadata builder on vLLM's CUDA route
(SM90 presented to its modules), DeepGEMM's and vLLM's compiled kernels as stand-ins, judged by oracles/indexer.py
from the index cache's bytes; a short clean campaign and an injected bug through the CLI."""

import functools

import pytest

from strategies.case import Case, CaseError, IndexerStep, Request
from tests.fuzzer.targets.judged import assert_reached, clean_campaign, first_finding, run_judged

pytestmark = pytest.mark.vllm


@functools.cache
def target():
    from fuzzer.targets.indexer import Indexer

    t = Indexer("cpu")
    if t.unavailable():
        pytest.skip(t.unavailable())
    t.prepare()
    return t


def step(requests, num_decodes, table, width=512, heads=64, backend="auto", mtp=0, mb=512, pad=0, earlier=(), seed=5,
         values="normal"):
    return Case(requests=tuple(requests), num_decodes=num_decodes, block_size=64, block_table=tuple(table),
                topk_width=width, topk=(), heads=heads, seed=seed, padded_tokens=pad, values=values,
                cudagraph="full" if pad else "none", earlier=tuple(earlier),
                indexer=IndexerStep(topk_backend=backend, num_speculative_tokens=mtp, max_logits_mb=mb)).validate()


CASES = {
    # MTP decodes of 2 tokens on SM90's native next_n rows (contexts past the width: the top-k selects), then an
    # extend after a prefix hit and a fresh prefill; cooperative top-k (<= 64 rows)
    "mtp_native_mixed": (step([Request(2, 700), Request(2, 530), Request(6, 600), Request(9, 0)], 2,
                              [(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12), (13, 14, 15, 16, 17, 18, 19, 20, 21, 0, 0, 0),
                               (22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 0, 0), (32, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)],
                              mtp=1),
                         {"batch.mixed", "indexer.decode", "indexer.decode.native_mtp", "indexer.prefill",
                          "indexer.topk.cooperative"}),
    # next_n 3: SM90's paged logits take 1, 2 or 4 rows, so the builder flattens each decode to one-row requests
    "mtp_flattened": (step([Request(3, 900), Request(3, 40)], 2, [tuple(range(1, 16)), (16, 17) + (0,) * 13],
                           width=256, heads=32, mtp=2),
                      {"batch.decode_only", "indexer.decode.flattened", "indexer.topk.per_row"}),
    # a full CUDA graph's padded decode batch: two padding rows, their tokens slot -1; persistent top-k
    "graph_padded": (step([Request(1, 1200), Request(1, 80), Request(0, 0), Request(0, 0)], 4,
                          [tuple(range(1, 20)), (20, 21) + (0,) * 17, (0,) * 19, (0,) * 19], backend="persistent",
                          pad=2),
                     {"batch.decode_only", "batch.padding_rows", "indexer.decode", "indexer.topk.persistent"}),
    # a logits budget of 0 MB: every prefill request a chunk of its own, one query row per sub-chunk
    "prefill_chunks": (step([Request(5, 700), Request(4, 0)], 0, [tuple(range(1, 13)), (13,) + (0,) * 11],
                            mb=0, backend="torch", values="zero_tiles"),
                       {"batch.prefill_only", "indexer.prefill", "indexer.prefill.chunks",
                        "indexer.prefill.query_subchunks"}),
}


@pytest.mark.parametrize("name", CASES)
def test_a_step_gives_a_valid_top_k(name):
    case, paths = CASES[name]
    obs, verdicts = run_judged(target(), case)
    assert_reached(obs, paths)
    assert {"deep_gemm.fp8_fp4_paged_mqa_logits", "indexer_k_quant_and_cache"} <= set(obs.emulated)
    assert {v.check for v in verdicts} >= {"topk", "cache_write", "padded_rows", "buffer_rows"}
    assert not obs.memory


def test_a_trace_keeps_the_cache_and_the_buffer_across_steps():
    """Three steps on one engine: the first prefill's keys are read by the decodes after it, whose rows leave the
    buffer's other rows as they were."""
    table = [(1,) + (0,) * 10, tuple(range(2, 12)) + (0,)]
    first = step([Request(20, 0), Request(30, 600)], 0, table)
    second = step([Request(1, 20), Request(1, 630)], 2, table)
    case = step([Request(1, 21), Request(1, 631)], 2, table, earlier=[first, second])
    obs, _ = run_judged(target(), case)
    assert len(obs.steps) == 2


def test_an_indexer_case_holds_no_drawn_top_k_and_names_a_bad_field():
    case, _ = CASES["mtp_native_mixed"]
    with pytest.raises(CaseError, match="indexer.topk_backend"):
        Case.from_dict({**case.to_dict(), "indexer": {**case.to_dict()["indexer"], "topk_backend": "fastest"}})
    with pytest.raises(CaseError, match="num_decodes"):  # a decode longer than 1 + its draft tokens
        Case.from_dict({**case.to_dict(), "indexer": {**case.to_dict()["indexer"], "num_speculative_tokens": 0}})
    assert Case.from_json(case.to_json()) == case


def test_a_short_clean_campaign(tmp_path):
    clean_campaign(tmp_path, "vllm.indexer", 12, "--seed", "3")


def test_an_injected_indexer_bug_is_found(tmp_path):
    finding = first_finding(tmp_path, "vllm.indexer", "--max-examples", "40", "--seed", "1", "--inject",
                            "indexer-mtp-seq-lens-off-by-one")
    assert "D" in finding["bug_classes"], finding
