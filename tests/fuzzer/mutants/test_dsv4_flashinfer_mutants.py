"""The DeepSeek-V4 / V4.1 FlashInfer (SM100) mutants on CPU, each in a process of its own (mutants patch vLLM
process-wide): each fails the step made to trigger it, under its class and at its check, and a step of the same
target that does not reach it passes. `attnfuzz selftest --targets vllm.dsv4.flashinfer,vllm.dsv41.flashinfer`
finds each by search."""

from __future__ import annotations

import json

import pytest

from strategies.case import Case, Dsv4, Request
from tests.fuzzer.mutants.test_dsv4_mutants import PROBE


def v4(request, table, pad, ratio=1, ctable=()):
    return Case(requests=(request,), num_decodes=int(request.query_len == 1), block_size=64, block_table=(table,),
                topk_width=128, topk=(), kv_cache_dtype="bfloat16", seed=4,
                dsv4=Dsv4(compress_ratio=ratio, window_size=128, compressed_block_table=ctable, cache_dtype="bfloat16",
                          kv_record=1024, page_pad=pad)).validate()


def v41(requests, num_decodes, tables, ctables):
    return Case(requests=requests, num_decodes=num_decodes, block_size=32, block_table=tables, topk_width=128,
                topk=(), kv_cache_dtype="fp8", seed=4,
                dsv4=Dsv4(compress_ratio=2, window_size=128, compressed_block_table=ctables, version="4.1",
                          compressed_block_size=128, cache_dtype="fp8", kv_record=512)).validate()


JOBS = {  # target: (mutant, [(step, checks one of its failed verdicts must name; empty: it must pass)])
    "vllm.dsv4.flashinfer": ("dsv4-flashinfer-packed-span-ignored", [
        (v4(Request(1, 99), (1, 2), pad=8), "N:"),  # a decode whose window crosses into block 2 of a packed cache
        (v4(Request(1, 99), (1, 2), pad=0), ""),  # the same unpacked: the span is the block size
    ]),
    "vllm.dsv41.flashinfer": ("dsv41-flashinfer-prefill-cu-not-rebased", [
        (v41((Request(1, 40), Request(5, 0)), 1, ((1, 2), (3, 0)), ((1,), (2,))), "N:"),  # a decode, then a prefill
        (v41((Request(5, 0),), 0, ((1,),), ((1,),)), ""),  # prefills only: the offsets start at 0 anyway
    ]),
}


@pytest.mark.vllm
@pytest.mark.nightly  # a process of its own per target, vLLM imported in each: ~50 s each on a CPU
@pytest.mark.parametrize("target", sorted(JOBS))
def test_each_flashinfer_dsv4_mutant_fails_its_step_only(target):
    from fuzzer.mutants import load
    from tests.conftest import python

    mutant, steps = JOBS[target]
    assert load(mutant).BUG_CLASS == "N" and target in load(mutant).TARGETS
    probe = PROBE.replace('"vllm.dsv4.flashmla"', f'"{target}"')
    run = python("-c", probe, mutant, input=json.dumps([c.to_dict() for c, _ in steps]), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    failed = json.loads(run.stdout.strip().splitlines()[-1])
    for (_, want), found in zip(steps, failed):
        assert (any(f.startswith(want) for f in found) if want else not found), (target, failed)
