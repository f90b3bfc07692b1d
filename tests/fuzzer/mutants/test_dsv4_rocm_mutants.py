"""The ROCm DeepSeek-V4 and V4.1 mutants on CPU, one process per target (mutants patch vLLM process-wide): each
fails the step made to trigger it, under its class and at its check, and a step that triggers none passes.
`attnfuzz selftest --targets vllm.dsv4.rocm,vllm.dsv41.rocm` finds each by search."""

from __future__ import annotations

import json

import pytest

from strategies.case import Case, Dsv4, Request
from tests.fuzzer.mutants.test_dsv4_mutants import PROBE


def v4(requests, tables, num_decodes, ratio=1, ctables=()):
    return Case(requests=requests, num_decodes=num_decodes, block_size=64, block_table=tables, topk_width=128, topk=(),
                kv_cache_dtype="fp8_ds_mla", seed=4,
                dsv4=Dsv4(compress_ratio=ratio, window_size=32, compressed_block_table=ctables,
                          rocm_arch="gfx950")).validate()


def v41(request, table, ratio, ctable):
    return Case(requests=(request,), num_decodes=1, block_size=32, block_table=(table,), topk_width=128, topk=(),
                kv_cache_dtype="fp8_ds_mla", seed=4,
                dsv4=Dsv4(compress_ratio=ratio, window_size=32, compressed_block_table=(ctable,), version="4.1",
                          compressed_block_size=64, rocm_arch="gfx950")).validate()


JOBS = {  # target: [(mutant, step, verdicts it must give among others)]
    "vllm.dsv4.rocm": [
        # a decode at position 40, then a 3-token prefill: the prefill rows get the angles of positions 40, 0, 1
        ("dsv4-rocm-inverse-rope-positions-unshifted", v4((Request(1, 40), Request(3, 0)), ((1,), (2,)), 1),
         {"N:output"}),
        (None, v4((Request(1, 40), Request(1, 7)), ((1,), (2,)), 2), set()),  # decodes only: rotated is every row
    ],
    "vllm.dsv41.rocm": [
        # a C2A decode at position 99: 50 compressed entries over two blocks of 32
        ("dsv41-rocm-decode-topk-block-in-tokens", v41(Request(1, 99), (1, 2, 3, 4), 2, (1, 2)), {"N:output"}),
        (None, v41(Request(1, 99), (1, 2, 3, 4), 1, (1, 2)), set()),  # C1A: a block of 64 entries, the sizes agree
    ],
}


@pytest.mark.vllm
@pytest.mark.parametrize("target", sorted(JOBS))
def test_each_rocm_dsv4_mutant_fails_its_step_only(target):
    from fuzzer.mutants import load
    from tests.conftest import python

    jobs = JOBS[target]
    mutants = [m for m, _, _ in jobs if m]
    assert all(load(m).BUG_CLASS == "N" and target in load(m).TARGETS for m in mutants)
    probe = PROBE.replace('"vllm.dsv4.flashmla"', f'"{target}"')
    run = python("-c", probe, *mutants, input=json.dumps([c.to_dict() for _, c, _ in jobs]), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    failed = json.loads(run.stdout.strip().splitlines()[-1])
    assert all(want <= set(f) and bool(f) == bool(want) for (_, _, want), f in zip(jobs, failed)), failed
