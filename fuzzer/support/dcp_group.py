"""Emulated decode-context-parallel ranks in one process: every rank's code runs as it would on its own GPU,
and vLLM's DCP collectives meet between them.

Each rank is a thread; one runs at a time (a baton), because Triton's interpreter and attnfuzz's bounds
checker are process-wide state. A collective is where ranks meet: each deposits its tensor, hands the baton
on and waits at a barrier for the others. `EmulatedDcpGroup` stands where vLLM keeps its DCP
`GroupCoordinator` (`parallel_state._DCP`), with the same collective semantics (concat-style all_gather,
sum-then-split reduce_scatter), so vLLM's own code (`get_dcp_world_size_and_rank`, `MLADCPManager`'s query
gather, `cp_lse_ag_out_rs`) runs unchanged on top of it. Ranks must call the same collectives in the same
order, as with NCCL; a rank that raises breaks the barrier so the others stop instead of waiting forever.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch

COLLECTIVE_TIMEOUT_S = 600.0


class RankFailed(RuntimeError):
    """Another rank raised, so this one's collective can never complete."""


class LockstepRanks:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._baton = threading.Lock()
        self._barrier = threading.Barrier(world_size, timeout=COLLECTIVE_TIMEOUT_S)
        self._slots: list[torch.Tensor | None] = [None] * world_size
        self._local = threading.local()

    @property
    def rank(self) -> int:
        return self._local.rank

    def run(self, fn: Callable[[int], object]) -> list:
        """fn(rank) on every rank; returns their results in rank order, or raises the first rank's error."""
        results: list = [None] * self.world_size
        errors: list[BaseException | None] = [None] * self.world_size

        def body(rank: int) -> None:
            self._local.rank = rank
            with self._baton:
                try:
                    results[rank] = fn(rank)
                except BaseException as e:  # noqa: BLE001 - handed to the caller below
                    errors[rank] = e
                    self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,), name=f"dcp-rank{r}") for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # The rank that failed first, not the ones its failure stopped.
        first = next((e for e in errors if e is not None and not isinstance(e, RankFailed)), None)
        if first is None:
            first = next((e for e in errors if e is not None), None)
        if first is not None:
            failed = [r for r, e in enumerate(errors) if e is not None and not isinstance(e, RankFailed)]
            first.add_note(f"on DCP rank(s) {failed} of {self.world_size} (emulated in one process)")
            raise first
        return results

    def exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor`, in rank order (the body of every collective)."""
        self._slots[self.rank] = tensor
        self._meet()
        gathered = list(self._slots)
        self._meet()  # nobody deposits the next collective's tensor before all have read this one's
        return gathered

    def _meet(self) -> None:
        self._baton.release()
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise RankFailed("another DCP rank failed before this collective completed") from None
        finally:
            self._baton.acquire()


class EmulatedDcpGroup:
    """The collectives of vLLM's `GroupCoordinator` that DCP uses, over `LockstepRanks` (the calling thread's rank)."""

    unique_name = "attnfuzz:emulated-dcp"
    use_custom_op_call = False
    device_communicator = None
    cpu_group = device_group = None  # no process group: vLLM's direct (symmetric-memory) paths must stay off

    def __init__(self, ranks: LockstepRanks) -> None:
        self.ranks = ranks
        self.world_size = ranks.world_size
        self.ranks_in_group = list(range(ranks.world_size))

    @property
    def rank_in_group(self) -> int:
        return self.ranks.rank

    rank = local_rank = rank_in_group

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self.ranks.exchange(input_), dim=dim)

    def all_gather_into_tensor(self, output: torch.Tensor, input_: torch.Tensor) -> None:
        """torch.distributed.all_gather_into_tensor over the group: every rank's rows, concatenated, into `output`
        (what MLADCPManager's chunked-context KV gather calls on the group's device_group)."""
        output.copy_(torch.cat(self.ranks.exchange(input_), dim=0))

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        total = torch.stack([t.float() for t in self.ranks.exchange(input_)]).sum(0).to(input_.dtype)
        return total.chunk(self.world_size, dim=dim)[self.rank_in_group].contiguous()

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        return torch.stack([t.float() for t in self.ranks.exchange(input_)]).sum(0).to(input_.dtype)


@contextlib.contextmanager
def installed_dcp_group(group) -> None:
    """`group` as vLLM's DCP group for the duration (vLLM reads `parallel_state._DCP` at call time)."""
    from vllm.distributed import parallel_state

    saved = parallel_state._DCP
    parallel_state._DCP = group
    try:
        yield group
    finally:
        parallel_state._DCP = saved
