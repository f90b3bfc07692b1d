"""Emulated context-parallel ranks in one process: every rank's code runs as it would on its own GPU, and
vLLM's collectives (DCP, and with prefill context parallelism the PCP and TP groups too) meet between them.

Each rank is a thread; one runs at a time (a baton), because Triton's interpreter and attnfuzz's bounds
checker are process-wide state. A collective is where ranks meet: each deposits its tensor, hands the baton
on and waits at its group's barrier for the others. On a GPU each rank runs on a stream of its own, as a real
rank runs on its own device: vLLM's `current_stream()` would otherwise make one per thread, ordered with nothing,
and a collective would read another rank's tensor before its kernels finished (a race of the emulation, not of
vLLM). So a rank's stream starts after the caller's work, a collective is ordered as NCCL orders it on each
rank's stream (the reader waits for the writer's stream; the writer's next kernels wait for every read), and a
rank's stream is finished before its results are handed back. `EmulatedGroup` stands where vLLM keeps a
`GroupCoordinator` (`parallel_state._DCP`, `_PCP`, `_TP`), with the same collective semantics (concat-style
all_gather, sum-then-split reduce_scatter, all_reduce), so vLLM's own code (`get_dcp_world_size_and_rank`,
`MLADCPManager`'s query gather and LSE combines, PCP's cache-input gather) runs unchanged on top of it; each
calling rank sees its own group of that kind. Ranks must call the same collectives in the same order, as with
NCCL; a rank that raises breaks every barrier so the others stop instead of waiting forever.

What a real rank holds as its own process state (vLLM's forward context, its workspace manager, ...) is
named with `LockstepRanks.own`: it is swapped in whenever that rank takes the baton and out when it hands it on.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from types import SimpleNamespace
from typing import Callable

import torch

from fuzzer.support.errors import RankFailed

COLLECTIVE_TIMEOUT_S = 600.0


class LockstepRanks:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._baton = threading.Lock()
        self._barriers: dict[tuple[int, ...], threading.Barrier] = {}
        self._slots: dict[tuple, dict[int, tuple]] = {}  # (tensor, event) deposited; ("read", ...): events
        self._failed = False
        self._local = threading.local()
        self._owned: list[tuple[object, str, list | None]] = []
        self._state: list[list] = []

    @property
    def rank(self) -> int:
        return self._local.rank

    def own(self, obj, attr: str, values: list | None = None) -> None:
        """`obj.attr` is each rank's own (a process global every real rank has one of): swapped in while the rank
        runs. `values[r]` is its value on rank r when the rank starts (None: the value it has now)."""
        self._owned.append((obj, attr, values))

    def run(self, fn: Callable[[int], object]) -> list:
        """fn(rank) on every rank; returns their results in rank order, or raises the first rank's error."""
        results: list = [None] * self.world_size
        errors: list[BaseException | None] = [None] * self.world_size
        saved = [getattr(obj, attr) for obj, attr, _ in self._owned]
        caller = torch.cuda.current_stream() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self._state = [[values[r] if values is not None else now for (_, _, values), now in zip(self._owned, saved)]
                       for r in range(self.world_size)]

        def body(rank: int) -> None:
            self._local.rank = rank
            with self._baton:
                self._swap_in(rank)
                stream = _rank_stream(caller)
                try:
                    results[rank] = fn(rank)
                except BaseException as e:  # noqa: BLE001 - handed to the caller below
                    errors[rank] = e
                    self._fail()
                finally:
                    self._swap_out(rank)
                    if stream is not None:
                        stream.synchronize()

        threads = [threading.Thread(target=body, args=(r,), name=f"cp-rank{r}") for r in range(self.world_size)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            for (obj, attr, _), value in zip(self._owned, saved):
                setattr(obj, attr, value)
        # The rank that failed first, not the ones its failure stopped.
        first = next((e for e in errors if e is not None and not isinstance(e, RankFailed)), None)
        if first is None:
            first = next((e for e in errors if e is not None), None)
        if first is not None:
            failed = [r for r, e in enumerate(errors) if e is not None and not isinstance(e, RankFailed)]
            first.add_note(f"on rank(s) {failed} of {self.world_size} (emulated in one process)")
            try:
                raise first
            finally:  # the tracebacks hold this frame and the ranks': none may hold an exception back
                first = errors = None
        return results

    def exchange(self, tensor: torch.Tensor, members: tuple[int, ...] | None = None) -> list[torch.Tensor]:
        """Every member's `tensor`, in member order (the body of every collective); members: the world ranks of
        the calling rank's group, in group order (None: every rank)."""
        members = tuple(range(self.world_size)) if members is None else tuple(members)
        slots = self._slots.setdefault(members, {})
        slots[self.rank] = (tensor, _recorded(tensor))
        self._meet(members)
        # Copies, taken while every member waits here: after the next meeting a rank may write the tensor it
        # handed in (vLLM writes a combine's result back into its input), as NCCL's copy would not see.
        gathered = []
        for m in members:
            t, written = slots[m]
            _wait(written)
            gathered.append(t.clone())
        read = self._slots.setdefault(("read", *members), {})
        read[self.rank] = _recorded(tensor)
        self._meet(members)  # nobody deposits the next collective's tensor before all have read this one's
        for m in members:
            _wait(read[m])  # this rank's next kernels (which may write what it handed in) after every member's read
        return gathered

    def _meet(self, members: tuple[int, ...]) -> None:
        # Barriers are made and read only by the rank holding the baton.
        barrier = self._barriers.setdefault(members, threading.Barrier(len(members), timeout=COLLECTIVE_TIMEOUT_S))
        if self._failed:
            raise RankFailed("another rank failed before this collective completed")
        rank = self.rank
        self._swap_out(rank)
        self._baton.release()
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            raise RankFailed("another rank failed before this collective completed") from None
        finally:
            self._baton.acquire()
            self._swap_in(rank)

    def _fail(self) -> None:
        self._failed = True
        for barrier in self._barriers.values():
            barrier.abort()

    def _swap_in(self, rank: int) -> None:
        for (obj, attr, _), value in zip(self._owned, self._state[rank]):
            setattr(obj, attr, value)

    def _swap_out(self, rank: int) -> None:
        self._state[rank] = [getattr(obj, attr) for obj, attr, _ in self._owned]


def _rank_stream(caller):
    """On a GPU: a stream of the rank's own, made the thread's current one (vLLM's too: it patches set_stream),
    starting after the caller's work. None on a CPU."""
    if caller is None:
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(caller)
    torch.cuda.set_stream(stream)
    return stream


def _recorded(tensor: torch.Tensor):
    """An event after the work queued so far on this rank's stream (None for a CPU tensor)."""
    if not tensor.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return event


def _wait(event) -> None:
    if event is not None:
        torch.cuda.current_stream().wait_event(event)


class EmulatedProcessGroup:
    """What an emulated group offers as its `device_group`: torch.distributed cannot take it, so vLLM's direct
    torch.distributed calls on it go through `emulated_dist`."""

    def __init__(self, coordinator: "EmulatedGroup") -> None:
        self.coordinator = weakref.proxy(coordinator)  # the coordinator holds this object: no cycle back


class EmulatedGroup:
    """The collectives of vLLM's `GroupCoordinator` over `LockstepRanks`. `groups` lists the world ranks of every
    group of this kind (as vLLM's initialize_model_parallel lays them out); the calling thread's rank sees its own."""

    use_custom_op_call = False
    device_communicator = None
    cpu_group = None

    def __init__(self, ranks: LockstepRanks, groups=None, name: str = "dcp") -> None:
        # Weak: the world holds every rank's process state (its static forward context, so its layers) and a layer's
        # MLADCPManager holds its group, so a strong reference would make each world a reference cycle that only
        # Python's cyclic collector frees, with every rank's caches and workspaces in it. Whoever made the world
        # keeps it while its groups run.
        self.ranks = weakref.proxy(ranks)
        self.groups = [tuple(g) for g in (groups if groups is not None else [range(ranks.world_size)])]
        self._group_of = {r: g for g in self.groups for r in g}
        self.unique_name = f"attnfuzz:emulated-{name}"
        self.world_size = len(self.groups[0])
        self.device_group = EmulatedProcessGroup(self)

    @property
    def ranks_in_group(self) -> list[int]:
        return list(self._group_of[self.ranks.rank])

    @property
    def rank_in_group(self) -> int:
        return self._group_of[self.ranks.rank].index(self.ranks.rank)

    rank = local_rank = rank_in_group

    def _exchange(self, tensor: torch.Tensor, what: str) -> list[torch.Tensor]:
        members = self._group_of[self.ranks.rank]
        parts = self.ranks.exchange(tensor, members)
        if len({tuple(t.shape) for t in parts}) > 1:  # NCCL takes every rank's count as its own: a hang or garbage
            shapes = ", ".join(f"rank {r}: {tuple(t.shape)}" for r, t in zip(members, parts))
            raise RuntimeError(f"{what} over the emulated {self.unique_name.rsplit('-', 1)[-1].upper()} group: the "
                               f"ranks hand in tensors of different shapes ({shapes}); a collective every rank must "
                               f"size alike (over NCCL: a hang, or rows of the wrong ranks)")
        return parts

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._exchange(input_, "all_gather"), dim=dim)

    def all_gather_into_tensor(self, output: torch.Tensor, input_: torch.Tensor) -> None:
        """torch.distributed.all_gather_into_tensor over the group: every rank's rows, concatenated, into `output`
        (what vLLM calls on the group's device_group: MLADCPManager's context gather, FlashMLA's PCP+DCP KV gather)."""
        gathered = torch.cat(self._exchange(input_, "all_gather_into_tensor"), dim=0)
        if gathered.shape != output.shape:  # torch.distributed refuses a wrong-sized output
            raise ValueError(f"all_gather_into_tensor: output {tuple(output.shape)}, gathered {tuple(gathered.shape)}")
        output.copy_(gathered)

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        total = torch.stack([t.float() for t in self._exchange(input_, "reduce_scatter")]).sum(0).to(input_.dtype)
        return total.chunk(self.world_size, dim=dim)[self.rank_in_group].contiguous()

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        return torch.stack([t.float() for t in self._exchange(input_, "all_reduce")]).sum(0).to(input_.dtype)

    def all_to_all_single(self, output: torch.Tensor, input_: torch.Tensor, output_split_sizes=None,
                          input_split_sizes=None) -> None:
        """torch.distributed.all_to_all_single over the group: the input's dim-0 split (input_split_sizes, else
        equal) j goes to group rank j; the output holds what each rank sent this one, in rank order, split by
        output_split_sizes (else equal), as bytes (the two tensors' rows may differ in width, as NCCL takes them).
        What vLLM calls on the TP group's device_group: ShardQ's NCCL fallback."""
        members, world, me = self._group_of[self.ranks.rank], self.world_size, self.rank_in_group
        row_in = input_[:1].numel() * input_.element_size() if input_.shape[0] else 0
        sizes = [n * row_in for n in _splits(input_split_sizes, input_.shape[0], world, "input_split_sizes")]
        flat = input_.contiguous().view(-1).view(torch.uint8)
        parts = self.ranks.exchange(flat, members)  # each rank's whole input: ranks send different sizes
        splits = [s.tolist() for s in self.ranks.exchange(torch.tensor(sizes), members)]
        received = [t[sum(sp[:me]): sum(sp[:me]) + sp[me]] for t, sp in zip(parts, splits)]
        row_out = output[:1].numel() * output.element_size() if output.shape[0] else 0
        expected = [n * row_out for n in _splits(output_split_sizes, output.shape[0], world, "output_split_sizes")]
        got = [r.numel() for r in received]
        if expected != got:  # NCCL would read past or short of what each peer sent
            raise RuntimeError(f"all_to_all_single over the emulated {self.unique_name.rsplit('-', 1)[-1].upper()} "
                               f"group: rank {me} expects {expected} bytes from the ranks, they send {got}")
        output.view(-1).view(torch.uint8).copy_(torch.cat(received))


def _splits(sizes, rows: int, world: int, name: str) -> list[int]:
    """all_to_all_single's split sizes: as given (they must sum to the rows), else `rows` split equally (torch
    refuses rows the world does not divide)."""
    if sizes is None:
        if rows % world:
            raise ValueError(f"all_to_all_single: {rows} rows do not split equally over {world} ranks ({name} None)")
        return [rows // world] * world
    sizes = [int(x) for x in sizes]
    if len(sizes) != world or sum(sizes) != rows:
        raise ValueError(f"all_to_all_single: {name} {sizes} for {rows} rows over {world} ranks")
    return sizes


class EmulatedDcpGroup(EmulatedGroup):
    """vLLM's DCP group over every emulated rank (DCP without PCP reuses the TP ranks)."""

    device_group = None  # no process group: vLLM's direct (symmetric-memory) paths must stay off

    def __init__(self, ranks: LockstepRanks) -> None:
        super().__init__(ranks, None, "dcp")
        self.device_group = None


@contextlib.contextmanager
def installed_dcp_group(group) -> None:
    """`group` as vLLM's DCP group for the duration (vLLM reads `parallel_state._DCP` at call time)."""
    with installed_groups(_DCP=group):
        yield group


@contextlib.contextmanager
def installed_groups(**groups) -> None:
    """vLLM's group coordinators (`_DCP=`, `_PCP=`, `_TP=`) replaced for the duration."""
    from vllm.distributed import parallel_state

    saved = {name: getattr(parallel_state, name) for name in groups}
    for name, group in groups.items():
        setattr(parallel_state, name, group)
    try:
        yield
    finally:
        for name, group in saved.items():
            setattr(parallel_state, name, group)
        forget_groups()


# vLLM caches per group coordinator for the engine's life (functools.cache keyed by the group): with a new emulated
# world every case, each key would keep its case's ranks (their layers, caches, workspaces) alive for good; the
# PCP target grew 180 MB a case on the CPU and its workers ran out of the H200's 140 GB.
GROUP_KEYED_CACHES = ("vllm.v1.attention.ops.dcp", ("get_direct_dcp_a2a_workspace", "get_direct_dcp_q_gather_workspace",
                                                    "get_direct_dcp_kv_gather_workspace"))


def forget_groups() -> None:
    """Empty vLLM's per-group caches (the emulated groups of a finished step are never used again)."""
    import importlib

    module_name, names = GROUP_KEYED_CACHES
    try:
        module = importlib.import_module(module_name)
    except ImportError:  # an older release without the direct DCP paths
        return
    for name in names:
        cached = getattr(module, name, None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


def context_parallel_groups(pcp: int, tp: int, dcp: int) -> dict[str, list[list[int]]]:
    """The world ranks of vLLM's TP, PCP and DCP groups for a world of PCP x TP ranks (DP = PP = 1), laid out as
    vLLM 0.33's `initialize_model_parallel` lays them out: world rank = pcp_rank * TP + tp_rank; TP groups
    vary the TP rank, PCP groups the PCP rank; a DCP group spans PCP first, then TP (`dcp_ranks.transpose(-1,
    -2)`), so DCP = PCP is each TP rank's PCP group and DCP = PCP x TP is the whole world."""
    world = torch.arange(pcp * tp).reshape(pcp, tp)
    return {"tp": [g.tolist() for g in world.reshape(-1, tp).unbind(0)],
            "pcp": [g.tolist() for g in world.transpose(0, 1).reshape(-1, pcp).unbind(0)],
            "dcp": [g.tolist() for g in (world.transpose(0, 1) if dcp > 1 else world).reshape(-1, dcp).unbind(0)]}


def emulated_dist():
    """torch.distributed as vLLM calls it on an emulated group's device_group (`group=`): the collectives it
    calls route to the emulated group; with any other group they are torch.distributed's own."""
    import torch.distributed as dist

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        if isinstance(group, EmulatedProcessGroup):
            group.coordinator.all_gather_into_tensor(output_tensor, input_tensor)
            return None
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        if isinstance(group, EmulatedProcessGroup):
            group.coordinator.all_to_all_single(output, input, output_split_sizes, input_split_sizes)
            return None
        return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                      async_op=async_op)

    return SimpleNamespace(**{**vars(dist), "all_gather_into_tensor": all_gather_into_tensor,
                              "all_to_all_single": all_to_all_single})
