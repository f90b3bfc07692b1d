"""The emulated context-parallel groups leave nothing behind: vLLM caches per group coordinator for the engine's
life, and a case's groups are new each case (a key per case kept every rank's layer and cache alive)."""

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
