"""The narrow built-in mutants on CPU: each fires only on the conjunction of case knobs its docstring names.

For each mutant, in a process of its own (mutants patch vLLM process-wide): a hand-written case with the whole
conjunction fails, and the same case with any one knob switched back to its plain value passes. A release whose
code a mutant cannot patch (its edit is "not found in this vLLM") skips that mutant."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from strategies.case import Case, Dcp, IndexCall, Request, TopkSpec

ROOT = Path(__file__).resolve().parents[3]

# Runs in a fresh process: prepare the targets as a campaign worker does, then inject, then judge each case.
PROBE = """
import json, sys
from fuzzer.env import prepare_process
prepare_process("cpu")
from fuzzer.errors import UsageError
from fuzzer.mutants import MutantError, inject
from fuzzer.run.host import import_vllm, make_target
from strategies.case import Case
jobs = json.loads(sys.stdin.read())
try:
    import_vllm()
    targets = {name: make_target(name, "cpu") for name in dict.fromkeys(name for name, _ in jobs)}
    inject(sys.argv[1])
except (UsageError, MutantError, RuntimeError) as e:
    if isinstance(e, UsageError) or "not found in this vLLM" in str(e) or "not in this vLLM" in str(e):
        print(json.dumps({"skip": str(e)}))
        sys.exit(0)
    raise
failed = []
for name, data in jobs:
    case, target = Case.from_dict(data), targets[name]
    failed.append(sorted({f"{v.check}:{v.bug_class}" for v in target.oracle(case, target.run(case)) if not v.ok}))
print(json.dumps({"failed": failed}))
"""

REMAP, DCP_FILTER = "vllm.index_remap", "vllm.dcp_filter"
FLASHMLA, LAYER = "vllm.flashmla_sparse", "vllm.flashmla_sparse.layer"


def _table(reqs, block_size=64, spare=0):
    """One contiguous row of blocks per request, 0 (the null block) padding each row to one width."""
    need = [-(-r.seq_len // block_size) for r in reqs]
    width, rows, nxt = max(need) + spare, [], 1
    for n in need:
        rows.append(tuple(range(nxt, nxt + n)) + (0,) * (width - n))
        nxt += n
    return tuple(rows)


def compact_gap_multitile():
    def case(target=REMAP, width=4224, valid_counts=True, invalid_at="head", dcp=Dcp()):
        reqs = (Request(1, 300), Request(2, 150))
        return Case(requests=reqs, num_decodes=1, block_size=64, block_table=_table(reqs), topk_width=width,
                    topk=(TopkSpec(200, invalid_at), TopkSpec(200, invalid_at)), dcp=dcp,
                    call=IndexCall(valid_counts=valid_counts), seed=5).validate()

    rank1 = Dcp(2, 1, 1)  # filtering leaves -1s before the rank's entries even with invalid_at tail
    return [("conjunction", REMAP, case(), True),
            ("no valid counts", REMAP, case(valid_counts=False), False),
            ("single tile (4096)", REMAP, case(width=4096), False),
            ("-1s at the tail", REMAP, case(invalid_at="tail"), False),
            ("dcp conjunction", DCP_FILTER, case(invalid_at="tail", dcp=rank1), True),
            ("dcp single tile", DCP_FILTER, case(invalid_at="tail", dcp=rank1, width=4096), False),
            ("dcp no valid counts", DCP_FILTER, case(invalid_at="tail", dcp=rank1, valid_counts=False), False)]


def stride_last_column():
    def case(stride=128, workspace=True, spare=0, decode_valid=129, seed=11):
        reqs = (Request(1, 128), Request(4, 20))  # the decode's 129th position is alone in its third block
        return Case(requests=reqs, num_decodes=1, block_size=64, block_table=_table(reqs, spare=spare),
                    topk_width=256, topk=(TopkSpec(decode_valid), TopkSpec(16)), block_stride_rows=stride,
                    call=IndexCall(valid_counts=True, prefill_workspace=workspace), seed=seed).validate()

    return [("conjunction", REMAP, case(), True),
            ("packed blocks", REMAP, case(stride=0), False),
            ("no prefill workspace", REMAP, case(workspace=False), False),
            ("a spare column", REMAP, case(spare=1), False),
            ("nothing picked in the last block", REMAP, case(decode_valid=20, seed=0), False)]  # seed 0 misses it


def workspace_second_prefill():
    def case(workspace=True, counts=True, prefills=2, later_valid=40):
        reqs = (Request(1, 70), Request(5, 30), Request(6, 50))[: 1 + prefills]
        topk = (TopkSpec(40), TopkSpec(40), TopkSpec(later_valid))[: 1 + prefills]
        return Case(requests=reqs, num_decodes=1, block_size=64, block_table=_table(reqs), topk_width=128, topk=topk,
                    call=IndexCall(valid_counts=counts, prefill_workspace=workspace), seed=3).validate()

    return [("conjunction", REMAP, case(), True),
            ("no prefill workspace", REMAP, case(workspace=False), False),
            ("no valid counts", REMAP, case(counts=False), False),
            ("one prefill", REMAP, case(prefills=1), False),
            ("nothing valid in the later prefill", REMAP, case(later_valid=0), False)]


def mtp_padded_decode():
    def case(dtype="fp8_ds_mla", heads=32, pad=True, q=2):
        reqs = (Request(q, 60), Request(q, 100)) + ((Request(0, 0),) if pad else ())
        return Case(requests=reqs, num_decodes=len(reqs), block_size=64, block_table=_table(reqs), topk_width=128,
                    topk=tuple(TopkSpec(40) for _ in reqs), heads=heads, kv_cache_dtype=dtype,
                    padded_tokens=q if pad else 0, seed=4).validate()

    return [("conjunction", FLASHMLA, case(), True),
            ("bf16 cache", FLASHMLA, case(dtype="bfloat16"), False),
            ("16 heads (fp8 mixed batch)", FLASHMLA, case(heads=16), False),
            ("no padding rows", FLASHMLA, case(pad=False), False),
            ("query_len 1", FLASHMLA, case(q=1), False)]


def fp8_uncompacted_topk_length():
    def case(dtype="fp8_ds_mla", heads=32, prefill=True, invalid_at="head", block_size=128, strided=True):
        reqs = (Request(1, 60),) + ((Request(6, 40),) if prefill else ())
        topk = (TopkSpec(30, invalid_at),) + ((TopkSpec(20, invalid_at),) if prefill else ())
        return Case(requests=reqs, num_decodes=1, block_size=block_size, block_table=_table(reqs, block_size),
                    topk_width=128, topk=topk, heads=heads, kv_cache_dtype=dtype, seed=6,
                    block_stride_rows=2 * block_size if strided else 0).validate()

    return [("conjunction", FLASHMLA, case(), True),
            ("bf16 cache", FLASHMLA, case(dtype="bfloat16"), False),
            ("16 heads (fp8 mixed batch)", FLASHMLA, case(heads=16), False),
            ("64-token blocks", FLASHMLA, case(block_size=64), False),
            ("a packed cache", FLASHMLA, case(strided=False), False),
            ("no prefill", FLASHMLA, case(prefill=False), False),
            ("-1s at the tail", FLASHMLA, case(invalid_at="tail"), False)]


def full_batch_req_id_fp8_separate():
    def case(dtype="fp8_ds_mla", heads=32, decode=True, prefill=True, prefill_context=0):
        reqs = ((Request(1, 50),) if decode else ()) + ((Request(5, prefill_context),) if prefill else ())
        return Case(requests=reqs, num_decodes=int(decode), block_size=64, block_table=_table(reqs), topk_width=128,
                    topk=tuple(TopkSpec(128) for _ in reqs), heads=heads, kv_cache_dtype=dtype, seed=7).validate()

    return [("conjunction", LAYER, case(), True),
            ("bf16 cache", LAYER, case(dtype="bfloat16"), False),
            ("16 heads (fp8 mixed batch)", LAYER, case(heads=16), False),
            ("no decode", LAYER, case(decode=False), False),
            ("no prefill", LAYER, case(prefill=False), False),
            ("a long prefill (seq_len > top-k: no dense MHA)", LAYER, case(prefill_context=200), False),
            ("a prefill with cached context", LAYER, case(prefill_context=20), False)]


def seed_bug_in_one_call_mode(mode):
    """remap-no-length-check-<mode>: the full-batch req_id_per_token in its call mode fails; the same call sliced,
    and the full batch in any other call mode (vLLM's row check refuses it), pass."""
    def case(in_mode, full_batch=True):
        reqs = (Request(1, 70), Request(5, 30))
        return Case(requests=reqs, num_decodes=1, block_size=64, block_table=_table(reqs),
                    topk_width=4224 if in_mode == "compaction" else 256, topk=(TopkSpec(40), TopkSpec(20)),
                    block_stride_rows=128 if in_mode == "block_stride" else 0,
                    idx_mapping=(0, 1) if in_mode == "idx_mapping" else None,
                    call=IndexCall(valid_counts=in_mode in ("valid_counts", "compaction"),
                                   prefill_workspace=in_mode == "prefill_workspace", token_rows="decodes",
                                   req_id_rows="full_batch" if full_batch else "match"), seed=3).validate()

    others = [m for m in ("plain", "valid_counts", "compaction", "prefill_workspace", "idx_mapping", "block_stride")
              if m != mode]
    return [("conjunction", REMAP, case(mode), True), ("req_id sliced", REMAP, case(mode, full_batch=False), False),
            *((f"full batch, {other}", REMAP, case(other), False) for other in others)]


CALL_MODE_MUTANTS = {f"remap-no-length-check-{m.replace('_', '-')}": functools.partial(seed_bug_in_one_call_mode, m)
                     for m in ("plain", "valid_counts", "compaction", "prefill_workspace", "idx_mapping",
                               "block_stride")}


NARROW = {
    "remap-compact-gap-multitile": compact_gap_multitile,
    "remap-stride-last-column": stride_last_column,
    "remap-workspace-second-prefill": workspace_second_prefill,
    "flashmla-mtp-padded-decode": mtp_padded_decode,
    "flashmla-fp8-uncompacted-topk-length": fp8_uncompacted_topk_length,
    "remap-full-batch-req-id-fp8-separate": full_batch_req_id_fp8_separate,
    **CALL_MODE_MUTANTS,
}


def test_the_time_to_find_benchmark_s_call_mode_set_is_these_mutants():
    import importlib.util

    from fuzzer.mutants._kernel_patch import CALL_MODES
    from strategies.swarm import CALL_MODES as SEARCHED_MODES

    spec = importlib.util.spec_from_file_location("time_to_find", ROOT / "bench" / "time_to_find.py")
    ttf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ttf)
    assert ttf.groups()["call-modes"] == list(CALL_MODE_MUTANTS)
    assert tuple(CALL_MODES) == SEARCHED_MODES  # the modes the mutants break are the modes the search pairs


def test_narrow_mutants_are_registered_with_their_targets():
    from fuzzer.mutants import MUTANTS, load
    from fuzzer.targets.registry import TARGETS

    for name, cases in NARROW.items():
        mod = load(name)
        assert name in MUTANTS and mod.BUG_CLASS in "ABCDEFGHIJKLMN" and len(mod.BUG_CLASS) == 1, name
        assert {target for _, target, _, _ in cases()} <= set(mod.TARGETS) <= set(TARGETS), name
        assert "Needs all of:" in (mod.__doc__ or ""), name  # the docstring names the conjunction


@pytest.mark.vllm
@pytest.mark.parametrize("mutant", list(NARROW))
def test_fires_on_its_conjunction_only(mutant):
    from tests.conftest import python

    jobs = NARROW[mutant]()
    run = python("-c", PROBE, mutant, input=json.dumps([[t, c.to_dict()] for _, t, c, _ in jobs]), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(f"{mutant}: {result['skip']}")
    failed = {label: verdicts for (label, *_), verdicts in zip(jobs, result["failed"])}
    wrong = {label: failed[label] for label, _, _, should_fail in jobs if bool(failed[label]) != should_fail}
    assert not wrong, f"{mutant}: expected only the conjunction cases to fail; got {failed}"
