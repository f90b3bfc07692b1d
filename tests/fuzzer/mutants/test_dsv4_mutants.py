"""The DeepSeek-V4 mutants on CPU, in one process of their own (mutants patch vLLM process-wide; the three patch
three different kernels): each fails the step made to trigger it, under its class and at its check, and a step that
triggers none of them passes. `attnfuzz selftest --targets vllm.dsv4.flashmla` finds each by search."""

from __future__ import annotations

import json

import pytest

from strategies.case import Case, Dsv4, Request

PROBE = """
import json, sys
from fuzzer.env import prepare_process
prepare_process("cpu")
from fuzzer.mutants import inject
from fuzzer.run.host import import_vllm, make_target
from strategies.case import Case
import_vllm()
target = make_target("vllm.dsv4.flashmla", "cpu")
for mutant in sys.argv[1:]:
    inject(mutant)
failed = []
for data in json.loads(sys.stdin.read()):
    case = Case.from_dict(data)
    failed.append(sorted({f"{v.bug_class}:{v.where}" for v in target.oracle(case, target.run(case)) if not v.ok}))
print(json.dumps(failed))
"""


def step(request, table, ratio, ctable=(), window=32):
    return Case(requests=(request,), num_decodes=int(request.query_len == 1), block_size=64, block_table=(table,),
                topk_width=128, topk=(), kv_cache_dtype="fp8_ds_mla", seed=4,
                dsv4=Dsv4(compress_ratio=ratio, window_size=window, compressed_block_table=ctable)).validate()


JOBS = [  # (mutant, step, verdicts it must give among others: a window one key short also moves the output)
    ("dsv4-swa-window-block-edge", step(Request(1, 95), (1, 2), 1),  # position 95: window 64..95, a block edge
     {"N:metadata:decode_swa_indices", "N:metadata:decode_swa_lens"}),
    ("dsv4-c128a-topk-past-row", step(Request(1, 255), (1, 2, 3, 4), 128, ((1,),)),  # a complete state: no partial
     {"N:buffer_overrun:c128a_global_decode_buffer"}),
    ("dsv4-compressed-slot-partial-state", step(Request(3, 0), (1,), 4, ((1,),)),  # ends 3 tokens into a state
     {"N:metadata:compressed_slot_mapping"}),
    (None, step(Request(1, 7), (1,), 4, ((1,),)), set()),  # a complete C4 state, window from 0: none fires
]


@pytest.mark.vllm
def test_each_dsv4_mutant_fails_its_step_only():
    from fuzzer.mutants import load
    from tests.conftest import python

    mutants = [m for m, _, _ in JOBS if m]
    assert all(load(m).BUG_CLASS == "N" and load(m).TARGETS == ("vllm.dsv4.flashmla",) for m in mutants)
    run = python("-c", PROBE, *mutants, input=json.dumps([c.to_dict() for _, c, _ in JOBS]), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    failed = json.loads(run.stdout.strip().splitlines()[-1])
    assert all(want <= set(f) and bool(f) == bool(want) for (_, _, want), f in zip(JOBS, failed)), failed
