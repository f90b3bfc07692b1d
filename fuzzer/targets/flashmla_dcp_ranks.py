"""`vllm.flashmla_sparse.dcp.ranks`: FlashMLA sparse under DCP with real ranks, one process per rank.

The process that runs the case is rank 0; `prepare` starts ranks 1..N-1 (this module's `main`), one per GPU,
and every rank joins vLLM's process groups through `torch.distributed` (NCCL on GPUs, gloo on a CPU host),
with TP = DCP = N. For each case rank 0 broadcasts the case (and the mutants it applied) over vLLM's world
group; every rank materializes the same case, keeps its own share of the cache and runs the same step as the
emulated target (`DcpStep.run_rank`), so the query all-gather and the LSE combine are vLLM's own collectives
over the real DCP group; rank 0 gathers every rank's result and judges them together (`oracles.dcp`), naming
the ranks that differ.

N is the host's GPU count (at most 8), or ATTNFUZZ_DCP_RANKS; 2 on a CPU. A rank that raises where the
others go on to a collective leaves them waiting: the case's watchdog turns that into a hang finding, and
the worker (with its ranks, which die with it) is replaced.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import traceback
from pathlib import Path

import torch

from fuzzer.env import die_with_parent, prepare_process
from fuzzer.errors import CollectivesBroken, RankError, first_line
from fuzzer.mutants import APPLIED, inject
from fuzzer.support.vllm_setup import vllm_runtime
from fuzzer.targets.base import WHOLE, RunPlan, lost_device, memory_checked
from fuzzer.targets.flashmla_dcp import DcpStep, FlashMLASparseDcp, RankResult
from fuzzer.targets.probes import observe_paths
from strategies.batches import AttentionFeatures, attention_space
from strategies.case import Case

# vLLM's direct (symmetric-memory) DCP paths would use NVLink multicast, which must stay off on shared hosts.
SAFE_ENV = {"VLLM_USE_DIRECT_DCP_Q_GATHER": "0", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


def world_size(device: str) -> int:
    if "ATTNFUZZ_DCP_RANKS" in os.environ:
        return int(os.environ["ATTNFUZZ_DCP_RANKS"])
    if device != "cuda":
        return 2
    n = min(torch.cuda.device_count(), 8)
    return 1 << (n.bit_length() - 1) if n else 0  # DCP sizes divide TP = 128 / heads: a power of two


class FlashMLASparseDcpRanks(FlashMLASparseDcp):
    name = "vllm.flashmla_sparse.dcp.ranks"
    summary = ("FlashMLA sparse under DCP with real ranks: one process per GPU through torch.distributed (NCCL), "
               "vLLM's DCP group, query all-gather and LSE combine")
    real_parts = FlashMLASparseDcp.real_parts + ("vLLM's DCP process group (NCCL on GPUs, gloo on CPUs)",)
    cuda_gpus = 2  # at least two ranks; on a CPU host two emulated ranks over gloo

    def __init__(self, device: str, rank: int = 0) -> None:
        super().__init__(device)
        self.rank, self.world = rank, world_size(device)
        self.followers: list[subprocess.Popen] = []
        self._applied: list[str] = []

    def unavailable(self) -> str | None:
        if self.world < 2:
            return f"needs at least 2 GPUs for 2 ranks; this host has {torch.cuda.device_count()}"
        return super().unavailable()

    def prepare(self) -> None:
        os.environ.update(SAFE_ENV)
        super().prepare()  # the process group waits for the first case (`runtime` defers it)
        if self.device == "cuda" and (note := enable_pynccl()):
            self.shims.append(note)  # reported with every result

    def runtime(self, state_dir: str):
        self.state_dir = state_dir
        return None  # a process that only lists or inspects the target starts no ranks

    def join_group(self, init_method: str | None = None) -> None:
        """Join (rank 0: start, then join) the N-rank process group; once per process."""
        if self.cfg is not None:
            return
        if self.device == "cuda":
            torch.cuda.set_device(self.rank)
        if self.rank == 0:
            ranks_dir = (Path(self.state_dir) / "dcp-ranks" / str(os.getpid())).resolve()
            ranks_dir.mkdir(parents=True, exist_ok=True)
            (ranks_dir / "init").unlink(missing_ok=True)
            init_method = f"file://{ranks_dir / 'init'}"
            for r in range(1, self.world):  # they die with this process (PDEATHSIG); logs beside the init file
                log = open(ranks_dir / f"rank{r}.log", "w")
                self.followers.append(subprocess.Popen(
                    [sys.executable, "-m", __name__, "--rank", str(r), "--world", str(self.world), "--init",
                     init_method, "--device", self.device], stdout=log, stderr=subprocess.STDOUT))
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_world_group

        self.cfg = vllm_runtime(self.device, self.state_dir, self.world, self.rank, init_method)
        self.collectives = check_collectives()
        # Every rank's check, at rank 0: a follower's broken collective must not pass for a clean group.
        group = get_world_group()
        checks = [None] * self.world if self.rank == 0 else None
        dist.gather_object(self.collectives, checks, dst=group.ranks[0], group=group.cpu_group)
        if self.rank == 0:
            self.collectives = "; ".join(c for c in checks if c) or None

    def cases(self, profile, plan: RunPlan = WHOLE):
        return attention_space(profile, AttentionFeatures(
            kv_cache_dtypes=plan.kv_dtypes(self), heads=(8, 16), block_sizes=(64, 128), dcp=True,
            dcp_sizes=(self.world,), block_stride_rows=True, dcp_outside_envelope=True))

    def run(self, case):
        from vllm.distributed.parallel_state import get_world_group


        self.join_group()
        if case.dcp.size != self.world:
            raise ValueError(f"case.dcp.size is {case.dcp.size}; this group has {self.world} ranks")
        step = DcpStep(self, case)

        def call():
            if self.collectives:  # every case would merge garbage: say why, once per case, instead
                raise CollectivesBroken(self.collectives)  # (before the broadcast: no rank waits on a case)
            get_world_group().broadcast_object({"case": case.to_json(None), "inject": list(APPLIED)}, src=0)
            mine = run_rank(step, 0)
            results = gather(mine)
            failed = {r: res.error for r, res in enumerate(results) if res.error}
            if failed:
                raise RankError("; ".join(f"rank {r}: {e}" for r, e in failed.items()),
                                device_lost=any(res.device_lost for res in results))
            return step.outputs(results)

        obs = observe_paths(self.observe, call, notes={"dcp": f"{self.world} ranks, one process each"})
        return step.finish(obs, "")

    def follow(self) -> None:
        """Ranks 1..N-1: run each case rank 0 broadcasts; None ends."""
        from vllm.distributed.parallel_state import get_world_group


        while True:
            msg = get_world_group().broadcast_object(None, src=0)
            if msg is None:
                return
            for name in msg["inject"][len(self._applied):]:  # the mutants rank 0 runs, here too
                inject(name)
                self._applied.append(name)
            with memory_checked(self.device) as found:  # this rank's kernels bounds-checked, as rank 0's are
                res = run_rank(DcpStep(self, Case.from_json(msg["case"])), self.rank)
            res.memory = [dataclasses.replace(v, kernel=f"{v.kernel} (rank {self.rank})") for v in found]
            gather(res)


# Symbols vLLM's NCCL binding loads but calls only behind `has_symbol()` (sleep mode); it already skips them on
# ROCm. NCCL before 2.29.7 (PyTorch 2.11's wheel ships 2.28.9) lacks them.
OPTIONAL_NCCL_SYMBOLS = ("ncclCommSuspend", "ncclCommResume")


def enable_pynccl() -> str | None:
    """Let vLLM's PyNccl load the host's NCCL, so the DCP combine runs as it does in a vLLM install.

    PyNccl loads "libnccl.so.2" by name (or VLLM_NCCL_SO_PATH) and every symbol it lists; on any failure it is
    silently disabled, and vLLM's `reduce_scatter` (unlike its all_gather and all_reduce) then has no fallback
    and returns an unwritten tensor: every DCP merge would be garbage. So: point it at the NCCL PyTorch ships
    when the loader cannot find that by name, and skip the optional sleep-mode symbols that NCCL lacks.
    Returns what was changed (a shim: reported with every result), or None."""
    import ctypes
    import importlib.util

    from vllm.distributed.device_communicators import pynccl_wrapper

    notes = []
    so = os.environ.get("VLLM_NCCL_SO_PATH") or "libnccl.so.2"
    try:
        lib = ctypes.CDLL(so)
    except OSError:
        spec = importlib.util.find_spec("nvidia.nccl")
        found = [Path(loc) / "lib" / "libnccl.so.2" for loc in (spec.submodule_search_locations or [])] if spec else []
        found = [p for p in found if p.exists()]
        if not found:
            return f"{so} not found: vLLM's PyNccl is disabled here"
        so = os.environ["VLLM_NCCL_SO_PATH"] = str(found[0])
        lib = ctypes.CDLL(so)
        notes.append(f"VLLM_NCCL_SO_PATH={so}")
    functions = pynccl_wrapper.NCCLLibrary.exported_functions
    absent = [f.name for f in functions if not hasattr(lib, f.name)]
    skip = [name for name in absent if name in OPTIONAL_NCCL_SYMBOLS]
    if skip:
        pynccl_wrapper.NCCLLibrary.exported_functions = [f for f in functions if f.name not in skip]
        notes.append(f"PyNccl: {', '.join(skip)} absent from the host's NCCL, skipped as vLLM does on ROCm")
    if set(absent) - set(skip):
        notes.append(f"PyNccl stays disabled: {', '.join(sorted(set(absent) - set(skip)))} absent from {so}")
    return "; ".join(notes) or None


def check_collectives() -> str | None:
    """The two collectives DCP's merge uses, through vLLM's DCP group, on known values: None when both are
    right, else what came back (and whether vLLM's PyNccl communicator is disabled: its reduce_scatter then
    leaves the output unwritten, where all_gather and all_reduce fall back to torch.distributed)."""
    from vllm.distributed.parallel_state import get_dcp_group

    group = get_dcp_group()
    n, r = group.world_size, group.rank_in_group
    x = torch.full((2, n), float(r + 1), device=group.device)
    gathered = group.all_gather(x, dim=0).float().cpu()
    scattered = group.reduce_scatter(x, dim=1).float().cpu()
    want_sum = float(n * (n + 1) / 2)
    wrong = []
    if not torch.equal(gathered[::2, 0], torch.arange(1.0, n + 1)):
        wrong.append(f"all_gather gave {gathered[:, 0].tolist()}")
    if not torch.all(scattered == want_sum):
        wrong.append(f"reduce_scatter gave {scattered.flatten().tolist()}, not {want_sum} everywhere")
    if not wrong:
        return None
    pynccl = getattr(group.device_communicator, "pynccl_comm", None)
    state = "absent" if pynccl is None else ("disabled" if pynccl.disabled else "enabled")
    return (f"rank {r}: vLLM's DCP group ({type(group.device_communicator).__name__}, PyNccl {state}): "
            + "; ".join(wrong))


def run_rank(step: DcpStep, rank: int) -> RankResult:
    try:
        return step.run_rank(rank)
    except Exception as e:  # the code under test raised on this rank: reported by rank 0
        res = RankResult()
        res.error = f"{type(e).__name__}: {first_line(e)[:300]}"
        res.device_lost = lost_device(e, step.target.device)  # told here, where the exception is: rank 0 gets text
        res.problems["traceback"] = [traceback.format_exc(limit=-6)]
        if rank:  # also in the rank's log (beside the init file): rank 0 reports only its first line
            print(f"rank {rank}: {res.problems['traceback'][0]}", file=sys.stderr, flush=True)
        return res


def gather(mine: RankResult) -> list[RankResult] | None:
    """Every rank's result at rank 0 (over vLLM's world CPU group)."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_world_group

    group = get_world_group()
    out = [None] * group.world_size if group.rank_in_group == 0 else None
    dist.gather_object(mine, out, dst=group.ranks[0], group=group.cpu_group)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one follower rank of vllm.flashmla_sparse.dcp.ranks")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--device", required=True)
    args = p.parse_args(argv)

    die_with_parent()
    os.environ["ATTNFUZZ_DCP_RANKS"] = str(args.world)
    prepare_process(args.device)
    import vllm  # noqa: F401  (imported once, before the target, as in a worker)

    target = FlashMLASparseDcpRanks(args.device, rank=args.rank)
    target.prepare()
    target.join_group(args.init)
    target.follow()
    return 0


if __name__ == "__main__":
    sys.exit(main())
