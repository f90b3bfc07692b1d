"""Decode context parallelism: the in-process rank emulation, the cache split, and the DCP targets on CPU
(every rank emulated in one process; real ranks as processes over gloo), with and without the DCP mutants."""

import json
import os
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuzzer.support.dcp_group import EmulatedDcpGroup, EmulatedGroup, LockstepRanks, context_parallel_groups
from oracles.dcp import owner_and_local, rank_slots, undivided
from strategies.case import Case, Dcp, Request, TopkSpec, rank_owned_positions
from tests.conftest import attnfuzz, run_repro


# -- the emulated group ------------------------------------------------------------------------------------
def test_collectives_follow_group_coordinator_semantics():
    ranks = LockstepRanks(3)
    group = EmulatedDcpGroup(ranks)

    def step(r):
        x = torch.full((2, 1, 4), float(r))
        gathered = group.all_gather(x, dim=1)  # concat-style, in rank order
        scattered = group.reduce_scatter(torch.arange(6.0).view(1, 6) * (r + 1), dim=1)  # sum, then rank's chunk
        return gathered, scattered, group.rank_in_group

    for r, (gathered, scattered, rank) in enumerate(ranks.run(step)):
        assert rank == r
        assert gathered.shape == (2, 3, 4) and gathered[0, :, 0].tolist() == [0.0, 1.0, 2.0]
        assert scattered.tolist() == [[6.0 * 2 * r, 6.0 * (2 * r + 1)]]  # (1+2+3) x [2r, 2r+1]


def test_a_failing_rank_stops_the_others_instead_of_hanging():
    ranks = LockstepRanks(2)
    group = EmulatedDcpGroup(ranks)

    def step(r):
        if r == 1:
            raise ValueError("rank 1 broke")
        return group.all_gather(torch.zeros(1), dim=0)

    done = []
    t = threading.Thread(target=lambda: done.append(pytest.raises(ValueError, ranks.run, step)))
    t.start()
    t.join(30)
    assert done and "rank 1 broke" in str(done[0].value)
    assert "rank(s) [1]" in str(done[0].value.__notes__)


def test_groups_of_a_pcp_x_tp_world_meet_apart_and_ranks_keep_their_own_state():
    """vLLM's layout of a PCP 2 x TP 2 world (world rank = pcp * TP + tp): TP groups vary tp, PCP groups pcp, a DCP
    group of 4 spans PCP first; each group's collectives meet only its members; `own` state is per rank; a
    collective whose ranks hand in different shapes raises (over NCCL: a hang or mixed rows)."""
    layout = context_parallel_groups(2, 2, 4)
    assert layout == {"tp": [[0, 1], [2, 3]], "pcp": [[0, 2], [1, 3]], "dcp": [[0, 2, 1, 3]]}
    assert context_parallel_groups(2, 2, 2)["dcp"] == [[0, 2], [1, 3]]
    ranks = LockstepRanks(4)
    tp, pcp, dcp = (EmulatedGroup(ranks, layout[k], k) for k in ("tp", "pcp", "dcp"))
    state = type("State", (), {"value": "outside"})
    ranks.own(state, "value", [f"rank{r}" for r in range(4)])

    def step(r):
        x = torch.full((1,), float(r))
        got = (tp.all_gather(x, 0).tolist(), pcp.all_gather(x, 0).tolist(), dcp.all_gather(x, 0).tolist(),
               dcp.rank_in_group, state.value)
        x.fill_(-1.0)  # a rank writing its input after the collective: the others' copies keep its value
        return got

    out = ranks.run(step)
    assert out[1] == ([0.0, 1.0], [1.0, 3.0], [0.0, 2.0, 1.0, 3.0], 2, "rank1") and state.value == "outside"
    assert out[2][:4] == ([2.0, 3.0], [0.0, 2.0], [0.0, 2.0, 1.0, 3.0], 1)
    mismatch = LockstepRanks(2)
    group = EmulatedGroup(mismatch, None, "dcp")
    with pytest.raises(RuntimeError, match="different shapes"):
        mismatch.run(lambda r: group.all_gather(torch.zeros(r + 1), 0))


# -- the split ---------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(size=st.sampled_from([1, 2, 4, 8]), interleave=st.sampled_from([1, 2, 16, 64]), blocks=st.integers(1, 3))
def test_every_undivided_slot_is_one_rank_slot(size, interleave, blocks):
    block_size = 64
    case = Case((Request(1, 0),), 1, block_size, ((1,),), 128, (TopkSpec(0),), dcp=Dcp(size, 0, interleave))
    slots = torch.arange(blocks * block_size * size)
    owner, local = rank_slots(case, slots)
    assert len(set(zip(owner.tolist(), local.tolist()))) == len(slots)  # a bijection
    assert all(int((owner == r).sum()) == blocks * block_size for r in range(size))  # blocks full on every rank
    # ... and a request's positions are dealt as vLLM's DCP deals them
    for seq_len in (1, 63, 200):
        pos = torch.arange(seq_len)
        held, _ = owner_and_local(case, pos)
        assert [int((held == r).sum()) for r in range(size)] == [
            rank_owned_positions(seq_len, size, r, interleave) for r in range(size)]


def test_undivided_case_has_virtual_blocks_and_gathered_heads():
    case = Case((Request(1, 5),), 1, 64, ((3,),), 128, (TopkSpec(4),), heads=8, dcp=Dcp(4, 0, 2),
                kv_cache_dtype="fp8_ds_mla")
    whole = undivided(case)
    assert (whole.block_size, whole.heads, whole.dcp) == (256, 32, Dcp())
    assert whole.block_table == case.block_table and whole.topk == case.topk


# -- the targets on vLLM's real code -----------------------------------------------------------------------
def mixed(size: int, interleave: int) -> Case:
    """A decode whose only position sits on rank 0 (an empty shard everywhere else), a decode with context on
    every rank, and a short prefill."""
    return Case(requests=(Request(1, 0), Request(1, 40), Request(3, 20)), num_decodes=2, block_size=64,
                block_table=((1,), (2,), (3,)), topk_width=128,
                topk=(TopkSpec(1), TopkSpec(128, "scattered"), TopkSpec(12, "head")), heads=8,
                dcp=Dcp(size, 0, interleave), kv_cache_dtype="fp8_ds_mla").validate()


@pytest.mark.vllm
@pytest.mark.parametrize("size,interleave", [(2, 1), (4, 16)])
def test_emulated_ranks_match_the_undivided_context(size, interleave):
    from fuzzer.targets.flashmla_dcp import FlashMLASparseDcp

    target = FlashMLASparseDcp("cpu")
    target.prepare()
    case = mixed(size, interleave)
    obs = target.run(case)
    verdicts = target.oracle(case, obs)
    assert all(v.ok for v in verdicts), verdicts
    assert obs.outputs["out"].shape == (case.num_tokens, 8 * size, 512)
    assert {f"rank{r}.topk" for r in range(size)} <= set(obs.outputs)  # every rank's filter was judged
    assert torch.isneginf(obs.outputs["rank1.lse"][0]).all()  # rank 1 holds nothing of token 0's pick


PROBE = """
import json, sys
from fuzzer.env import prepare_process
prepare_process("cpu")
import vllm
from fuzzer.mutants import inject
from fuzzer.targets.flashmla_dcp import FlashMLASparseDcp
from strategies.case import Case
t = FlashMLASparseDcp("cpu"); t.prepare(); inject(sys.argv[1])
case = Case.from_json(sys.argv[2])
print(json.dumps(sorted({(v.check, v.bug_class) for v in t.oracle(case, t.run(case)) if not v.ok})))
"""


@pytest.mark.vllm
@pytest.mark.parametrize("mutant,interleave,check", [
    ("dcp-empty-shard-lse-zero", 1, "dcp_empty_shard"),
    ("dcp-lse-base2-as-natural", 1, "dcp_rank_lse"),
    ("dcp-owner-ignores-interleave", 2, "dcp_filter"),
])
def test_each_dcp_mutant_is_seen(mutant, interleave, check):
    from tests.conftest import python

    case = mixed(2, interleave)
    run = python("-c", PROBE, mutant, case.to_json(None), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    failed = json.loads(run.stdout.strip().splitlines()[-1])
    assert [check, "G"] in failed, failed


RANKS_PROBE = """
import json, sys
from fuzzer.env import prepare_process
prepare_process("cpu")
import vllm
from fuzzer.mutants import inject
from fuzzer.targets.flashmla_dcp_ranks import FlashMLASparseDcpRanks
from strategies.case import Case
t = FlashMLASparseDcpRanks("cpu"); t.prepare(); inject(sys.argv[1])
case = Case.from_json(sys.argv[2])
obs = t.run(case)
print(json.dumps([obs.notes.get("dcp"), sorted({(v.check, v.bug_class) for v in t.oracle(case, obs) if not v.ok})]))
"""


@pytest.mark.vllm
def test_real_ranks_over_gloo_see_a_mutant(tmp_path):
    """Two rank processes over gloo, vLLM's DCP group and collectives, on one fixed case: the mutant rank 0 applied
    runs on rank 1 too (broadcast with the case), and the judge sees its class-G verdict (the campaign, shrinking
    and the reproducer: the nightly test below)."""
    from tests.conftest import python

    env = dict(os.environ, ATTNFUZZ_STATE=str(tmp_path))  # the ranks' init file and logs
    run = python("-c", RANKS_PROBE, "dcp-empty-shard-lse-zero", mixed(2, 1).to_json(None), env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    notes, failed = json.loads(run.stdout.strip().splitlines()[-1])
    assert notes == "2 ranks, one process each" and ["dcp_empty_shard", "G"] in failed, failed


@pytest.mark.vllm
@pytest.mark.nightly  # a campaign with two rank processes, then its reproducer: ~70 s (the fixed case above: CI)
def test_real_ranks_over_gloo_find_a_mutant(tmp_path):
    run = attnfuzz("--device", "cpu", "run", "--target", "vllm.flashmla_sparse.dcp.ranks", "--inject",
                   "dcp-empty-shard-lse-zero", "--max-examples", "6", "--max-findings", "1", "--no-shrink",
                   "--reruns", "0", "--quiet",
                   "--repros", str(tmp_path / "repros"), "--json", str(tmp_path / "run.json"))
    summary = json.loads((tmp_path / "run.json").read_text())
    assert run.returncode == 1, run.stderr[-3000:]
    (finding,) = [f for f in summary["findings"] if "G" in f["bug_classes"]]
    # Its reproducer (ranks emulated in one process, torch + vLLM only) shows it too.
    repro = run_repro(finding["path"])
    assert repro.returncode == 1, repro.stdout + repro.stderr[-3000:]
    assert "not -inf (the merge's identity)" in repro.stdout and "real ranks" in (Path(finding["path"]) / "repro.py").read_text()


@pytest.mark.vllm
@pytest.mark.parametrize("heads,size", [(16, 8), (32, 2)])
def test_configurations_outside_flashmlas_envelope_are_refused(heads, size):
    from fuzzer.targets.flashmla_dcp import FlashMLASparseDcp
    from oracles.dcp import outside_envelope

    target = FlashMLASparseDcp("cpu")
    target.prepare()
    case = Case((Request(1, 10),), 1, 64, ((1,),), 128, (TopkSpec(5),), heads=heads, dcp=Dcp(size, 0, 1),
                kv_cache_dtype="fp8_ds_mla").validate()
    assert outside_envelope(case)
    obs = target.run(case)
    assert obs.error_type == "NotImplementedError"
    (verdict,) = target.oracle(case, obs)
    assert verdict.ok and verdict.check == "contract"


@pytest.mark.vllm
def test_a_bf16_cache_under_dcp_runs_where_the_release_runs_it_and_is_refused_where_not():
    """0.34 runs FlashMLA sparse under DCP on a bf16 cache (its bf16 forward filters the top-k to the rank's slots,
    compacted to each row's front); 0.33 refuses it. The target reads which from the installed impl, and the oracle
    judges the refusal or the run: either way the case passes on a correct vLLM."""
    from fuzzer.targets.flashmla_dcp import FlashMLASparseDcp
    from oracles.dcp import outside_envelope

    target = FlashMLASparseDcp("cpu")
    target.prepare()
    case = Case((Request(1, 10), Request(1, 40)), 2, 64, ((1,), (2,)), 128, (TopkSpec(5), TopkSpec(30)), heads=16,
                dcp=Dcp(2, 0, 1), kv_cache_dtype="bfloat16").validate()
    runs = "bfloat16" in target.dcp_cache_dtypes
    assert bool(outside_envelope(case, target.dcp_cache_dtypes)) != runs
    assert outside_envelope(case) and outside_envelope(case, ("fp8_ds_mla", "bfloat16")) is None
    obs = target.run(case)
    verdicts = target.oracle(case, obs)
    assert all(v.ok for v in verdicts), [v.detail for v in verdicts if not v.ok]
    if runs:
        assert obs.error_type is None and obs.notes["dcp_filter_call"]["compacted"]
    else:
        assert obs.error_type == "NotImplementedError" and [v.check for v in verdicts] == ["contract"]


@pytest.mark.vllm
def test_enable_pynccl_skips_only_the_optional_sleep_mode_symbols(monkeypatch):
    """PyTorch 2.11's NCCL (2.28.9) lacks ncclCommSuspend/Resume, which vLLM 0.33 loads on CUDA; without them
    PyNccl is disabled and vLLM's reduce_scatter returns an unwritten tensor (seen on 2 x H200)."""
    import ctypes
    from types import SimpleNamespace

    from vllm.distributed.device_communicators import pynccl_wrapper

    from fuzzer.targets.flashmla_dcp_ranks import OPTIONAL_NCCL_SYMBOLS, enable_pynccl

    functions = pynccl_wrapper.NCCLLibrary.exported_functions
    monkeypatch.setattr(pynccl_wrapper.NCCLLibrary, "exported_functions", list(functions))
    monkeypatch.setenv("VLLM_NCCL_SO_PATH", "libnccl-test.so")
    has = {f.name: object() for f in functions if f.name not in ("ncclCommSuspend", "ncclCommResume")}
    monkeypatch.setattr(ctypes, "CDLL", lambda so: SimpleNamespace(**has))
    note = enable_pynccl()
    names = {f.name for f in pynccl_wrapper.NCCLLibrary.exported_functions}
    if {"ncclCommSuspend", "ncclCommResume"} <= {f.name for f in functions}:  # 0.33; older releases lack them
        assert "skipped as vLLM does on ROCm" in note and not names & set(OPTIONAL_NCCL_SYMBOLS)
    assert names == {f.name for f in functions} - set(OPTIONAL_NCCL_SYMBOLS)
    del has["ncclReduceScatter"]  # a symbol PyNccl needs: it stays disabled, and says so
    assert "PyNccl stays disabled: ncclReduceScatter" in enable_pynccl()
