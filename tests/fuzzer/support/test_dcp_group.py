"""The emulated context-parallel groups leave nothing behind: vLLM caches per group coordinator for the engine's
life, and a case's groups are new each case (a key per case kept every rank's layer and cache alive); a finished
world, one whose rank raised included, goes by reference counting alone (a case's ranks hold hundreds of MB)."""

import contextlib
import functools
import gc
import types
import weakref

import pytest

pytestmark = pytest.mark.vllm


def test_leaving_the_installed_groups_empties_vllm_s_per_group_caches():
    from fuzzer.env import prepare_process

    prepare_process("cpu")
    import importlib

    import torch

    from fuzzer.support import dcp_group

    module_name, names = dcp_group.GROUP_KEYED_CACHES
    dcp = importlib.import_module(module_name)
    ranks = dcp_group.LockstepRanks(2)
    group = dcp_group.EmulatedGroup(ranks, [[0, 1]], "dcp")
    with dcp_group.installed_groups(_DCP=group):
        dcp.get_direct_dcp_kv_gather_workspace(group, torch.device("cpu"), 16, 576, torch.bfloat16, 1)
        assert dcp.get_direct_dcp_kv_gather_workspace.cache_info().currsize == 1
    assert all(getattr(dcp, n).cache_info().currsize == 0 for n in names)


@contextlib.contextmanager
def no_cyclic_collector():
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class Manager:
    """What a layer's MLADCPManager keeps of its group: the coordinator and its device group."""

    def __init__(self, group) -> None:
        self.group, self.device_group = group, group.device_group


def world_of_two():
    """A world of 2 ranks whose own state (a static forward context each) holds what holds their DCP group."""
    from fuzzer.support import dcp_group

    ranks = dcp_group.LockstepRanks(2)
    group = dcp_group.EmulatedGroup(ranks, [[0, 1]], "dcp")
    process = types.SimpleNamespace(static_forward_context={})
    ranks.own(process, "static_forward_context", [{"layer": Manager(group)} for _ in range(2)])
    return ranks, group


def gather(group, r):
    import torch

    return group.all_gather(torch.full((1,), float(r)), dim=0).tolist()


def gather_then_raise_on_rank_1(group, r):
    gather(group, r)
    if r == 1:
        raise ZeroDivisionError("rank 1")
    gather(group, r)


def test_a_finished_world_goes_by_reference_counting():
    ranks, group = world_of_two()
    assert ranks.run(functools.partial(gather, group)) == [[0.0, 1.0]] * 2
    held = [weakref.ref(o) for o in (ranks, group, ranks._owned[0][2][0]["layer"])]
    with no_cyclic_collector():
        del ranks, group
        assert [r() for r in held] == [None] * 3


def test_a_world_whose_rank_raised_goes_by_reference_counting():
    ranks, group = world_of_two()
    held = [weakref.ref(o) for o in (ranks, group)]
    with no_cyclic_collector():
        with pytest.raises(ZeroDivisionError, match="rank 1"):
            ranks.run(functools.partial(gather_then_raise_on_rank_1, group))
        del ranks, group
        assert [r() for r in held] == [None] * 2


def test_all_to_all_single_sends_each_rank_its_split_as_torch_distributed_does():
    """ShardQ's NCCL fallback on the emulated TP group: rank r's input split j (its input_split_sizes) lands on rank
    j, the splits a rank receives in rank order; rows may differ in width between input and output (the bytes
    count, as NCCL takes them: shard_q receives [world, tokens, ...]); split sizes that disagree are refused."""
    import torch

    from fuzzer.support import dcp_group

    ranks = dcp_group.LockstepRanks(3)
    group = dcp_group.EmulatedGroup(ranks, [[0, 1, 2]], "tp")
    sends = {0: [1, 2, 0], 1: [0, 1, 3], 2: [2, 0, 1]}  # rows rank r sends ranks 0, 1, 2

    def step(r):
        rows = torch.tensor([[10 * r + j, -(10 * r + j)] for j in range(sum(sends[r]))], dtype=torch.int32)
        got = sum(sends[p][r] for p in range(3))
        out = torch.empty(got, 2, dtype=torch.int32)
        dist = dcp_group.emulated_dist()
        dist.all_to_all_single(out, rows, [sends[p][r] for p in range(3)], sends[r], group=group.device_group)
        return out[:, 0].tolist()

    assert ranks.run(step) == [[0, 20, 21], [1, 2, 10], [11, 12, 13, 22]]

    def wrong_output_splits(r):
        out = torch.empty(2, 2, dtype=torch.int32)
        group.all_to_all_single(out, torch.zeros(3, 2, dtype=torch.int32), [1, 1, 0], [1, 1, 1])

    with pytest.raises(RuntimeError, match="expects"):
        ranks.run(wrong_output_splits)
