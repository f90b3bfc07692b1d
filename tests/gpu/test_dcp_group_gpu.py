"""On a GPU: the emulated ranks' collectives are ordered as NCCL orders them on each rank's stream. A rank's tensor
is read only after the kernels that wrote it, and its results reach the caller finished, even when vLLM's
`current_stream()` runs each rank on a stream of its own (each rank a thread)."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (ATTNFUZZ_TEST_DEVICE=cuda)")


def _slow_then_fill(value: float) -> torch.Tensor:
    """A tensor that reads `value` only once a few hundred ms of queued work on the current stream are done."""
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(40):
        a = torch.sin(a @ a)  # bounded: stays finite
    return torch.zeros(1 << 20, device="cuda") + value + 0 * a[0, 0]


def test_a_collective_reads_each_rank_s_tensor_after_its_kernels():
    from vllm.utils.torch_utils import current_stream  # noqa: F401  (imports vLLM's set_stream patch)

    from fuzzer.support.dcp_group import EmulatedGroup, LockstepRanks

    torch.cuda.init()
    ranks = LockstepRanks(2)
    group = EmulatedGroup(ranks, [[0, 1]], "dcp")

    def step(rank: int) -> torch.Tensor:
        assert torch.cuda.current_stream() != torch.cuda.default_stream()  # the rank's own stream
        return group.all_gather(_slow_then_fill(float(rank + 1)), dim=0)

    gathered = ranks.run(step)
    for g in gathered:
        assert g[: 1 << 20].eq(1).all() and g[1 << 20:].eq(2).all()
