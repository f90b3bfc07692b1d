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
