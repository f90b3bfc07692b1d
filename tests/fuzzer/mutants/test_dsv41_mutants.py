"""The DeepSeek-V4.1 mutants on CPU, in one process of their own (mutants patch vLLM process-wide; the three patch
different code): each fails the step made to trigger it, under its class and at its check, and a step that
triggers none of them passes. `attnfuzz selftest --targets vllm.dsv41.flashmla` finds each by search."""

from __future__ import annotations

import json

import pytest

from strategies.case import Case, Dsv4, Request
from tests.fuzzer.mutants.test_dsv4_mutants import PROBE


def step(request, table, ratio, ctable=(), window=32, record=584):
    return Case(requests=(request,), num_decodes=int(request.query_len == 1), block_size=32, block_table=(table,),
                topk_width=128, topk=(), kv_cache_dtype="fp8_ds_mla", seed=4,
                dsv4=Dsv4(compress_ratio=ratio, window_size=window, compressed_block_table=ctable, version="4.1",
                          compressed_block_size=64, kv_record=record)).validate()


JOBS = [  # (mutant, step, verdicts it must give among others)
    ("dsv41-ratio1-swa-only", step(Request(1, 40), (1, 2), 1, ((1,),)),  # a C1A decode with 41 compressed entries
     {"N:output"}),
    ("dsv41-combine-topk-len-off-by-one", step(Request(4, 0), (1,), 2, ((1,),)),  # a C2A prefill: positions 1, 3
     {"N:output"}),
    # an SWA-only MXFP8 prefill: the "scales" it reads are other records' fp8 bytes and unwritten (0xFF, NaN) ones
    ("dsv41-mxfp8-scales-not-interleaved", step(Request(3, 0), (1,), 0, record=528), {"N:nan"}),
    (None, step(Request(1, 40), (1, 2), 2, ((1,),), record=528), set()),  # a C2A MXFP8 decode: none fires
]


@pytest.mark.vllm
def test_each_dsv41_mutant_fails_its_step_only():
    from fuzzer.mutants import load
    from tests.conftest import python

    mutants = [m for m, _, _ in JOBS if m]
    assert all(load(m).BUG_CLASS == "N" and load(m).TARGETS == ("vllm.dsv41.flashmla",) for m in mutants)
    probe = PROBE.replace('"vllm.dsv4.flashmla"', '"vllm.dsv41.flashmla"')
    run = python("-c", probe, *mutants, input=json.dumps([c.to_dict() for _, c, _ in JOBS]), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    failed = json.loads(run.stdout.strip().splitlines()[-1])
    assert all(want <= set(f) and bool(f) == bool(want) for (_, _, want), f in zip(JOBS, failed)), failed
