"""The `vllm.step5_dsa` target on CPU: vLLM's STEP5_DSA builder, its CSA tail-ring builder and
Step5DSAAttentionImpl.forward on decode steps (summary update, indexer scores, region top-k, sparse attention; Triton
interpreted), judged by oracles/step5.py; the oracle against corrupted observations; the built-in mutant in a process
of its own."""

import dataclasses
import functools
import json

import pytest

from strategies.case import Case, Request, Step5
from tests.fuzzer.targets.judged import assert_reached, run_judged

pytestmark = pytest.mark.vllm


@functools.cache
def target():
    from fuzzer.targets.step5_dsa import Step5DSA

    t = Step5DSA("cpu")
    if t.unavailable():
        pytest.skip(t.unavailable())
    t.prepare()
    return t


def step(contexts, table, block=32, groups=1, heads=8, kv="bfloat16", scale="pow2", topk=4, steps=1,
         regions="distinct", defer=False, index_heads=4, pads=0):
    return Case(requests=tuple(Request(1, c) for c in contexts), num_decodes=len(contexts), block_size=block,
                block_table=tuple(table), topk_width=128, topk=(), heads=groups * heads, kv_cache_dtype=kv,
                fp8_scale=scale, seed=11, padded_tokens=pads,
                step5=Step5(groups=groups, index_heads=index_heads, region_topk=topk, steps=steps,
                            defer_inactive_clear=defer, regions=regions)).validate()


CASES = {
    # past topk: 15 and 9 closed regions, 4 kept by score; three steps, the last one's first token (position 127)
    # closing its region from the ring; 2 KV groups, fp8 with calibrated scales, a permuted table with a spare column
    "topk_fp8_groups": (step([127, 74], [(3, 1, 5, 7, 0), (2, 6, 4, 0, 0)], groups=2, kv="fp8", scale="arbitrary",
                             steps=3),
                        {"step5.summary.decode", "step5.scores.direct", "step5.select.topk", "step5.attention.splits",
                         "step5.attention.fp8", "step5.attention.gated", "step5.attention.groups"}),
    # ties at the cut (every third region repeats region 0), 16 heads a group, bf16, the deferred clear, two
    # graph-padding rows (slot -1: their outputs cleared)
    "ties_bf16": (step([100], [(1, 2, 3, 4)], heads=16, regions="ties", defer=True, index_heads=2, pads=2),
                  {"step5.select.topk", "step5.attention.splits"}),
    # every closed region kept (fewer than topk), 128-token blocks: regions <= topk selects all (_all_regions)
    "short": (step([20, 3], [(1,), (2,)], block=128, topk=16, heads=4, steps=2), {"step5.select.all"}),
}


@pytest.mark.parametrize("name", CASES)
def test_a_step_matches_the_reference(name):
    case, paths = CASES[name]
    obs, verdicts = run_judged(target(), case)
    assert_reached(obs, paths)
    assert any("top_k_per_row_decode" in e for e in obs.emulated) and not obs.memory
    assert obs.outputs["out.0"].shape == (len(case.requests) + case.padded_tokens, case.heads, 192)


def test_a_step_after_an_indexer_case_on_another_top_k_backend_runs_on_vllm_s_default(monkeypatch):
    """The process's one VllmConfig: an indexer case before this one (the same worker) may have left its top-k
    backend on cooperative or persistent, which Step5 refuses; a Step5 step sets vLLM's default again."""
    case, _ = CASES["ties_bf16"]
    t = target()
    monkeypatch.setattr(t.cfg.kernel_config, "sparse_indexer_topk_backend", "persistent")
    obs = t.run(case)
    assert obs.error is None and "selected.0" in obs.outputs, (obs.error_type, obs.error)


def test_the_oracle_rejects_an_uncleared_padding_row():
    case, _ = CASES["ties_bf16"]
    t = target()
    obs = t.run(case)
    out = obs.outputs["out.0"].clone()
    out[2, 0, 0] = 1.0
    bad = dataclasses.replace(obs, outputs={**obs.outputs, "out.0": out})
    assert [v.where for v in t.oracle(case, bad) if not v.ok] == ["padded_rows"]


def test_the_oracle_rejects_a_wrong_selection_and_output():
    case, _ = CASES["topk_fp8_groups"]
    t = target()
    obs = t.run(case)
    sel = obs.outputs["selected.1"].clone()
    row = sel[0].tolist()
    kept = {r for r in row if r >= 0}
    sel[0, -2] = next(r for r in range(row[-1]) if r not in kept)  # a closed region the scores left out
    bad = dataclasses.replace(obs, outputs={**obs.outputs, "selected.1": sel})
    assert {v.check for v in t.oracle(case, bad) if not v.ok} >= {"topk"}
    out = obs.outputs["out.2"].clone()
    out[1, 3, 5] += 0.5
    bad = dataclasses.replace(obs, outputs={**obs.outputs, "out.2": out})
    assert [v.where for v in t.oracle(case, bad) if not v.ok] == ["output"]
    ring = obs.outputs["ring.0"].clone()
    ring[1, 7] += 1
    bad = dataclasses.replace(obs, outputs={**obs.outputs, "ring.0": ring})
    assert [v.where for v in t.oracle(case, bad) if not v.ok] == ["ring"]


PROBE = """
import json, sys
from fuzzer.env import prepare_process
prepare_process("cpu")
from fuzzer.mutants import inject
from fuzzer.run.host import import_vllm, make_target
from strategies.case import Case
import_vllm()
target = make_target("vllm.step5_dsa", "cpu")
for mutant in sys.argv[1:]:
    inject(mutant)
failed = []
for data in json.loads(sys.stdin.read()):
    case = Case.from_dict(data)
    failed.append(sorted({f"{v.bug_class}:{v.check}:{v.where}" for v in target.oracle(case, target.run(case)) if not v.ok}))
print(json.dumps(failed))
"""


def test_the_mutant_fails_a_decode_step():
    """step5-summary-position-off-by-one: the token at position 20 (an open region) lands one ring row late."""
    from fuzzer.mutants import load
    from tests.conftest import python

    assert load("step5-summary-position-off-by-one").TARGETS == ("vllm.step5_dsa",)
    jobs = [step([20], [(1,)])]
    run = python("-c", PROBE, "step5-summary-position-off-by-one", input=json.dumps([c.to_dict() for c in jobs]),
                 timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    failed = json.loads(run.stdout.strip().splitlines()[-1])
    assert "D:cache_write:ring" in failed[0], failed
