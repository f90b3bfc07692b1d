"""Two ranks in vLLM's DCP group (NCCL on GPUs, gloo on CPUs): does each collective DCP uses return what it
should? Prints, per rank, vLLM's device communicator, whether its PyNccl communicator is disabled, and the
results of all_gather and reduce_scatter on known values.  Run: python bench/dcp_collectives_check.py"""
import os
import subprocess
import sys
import tempfile

if len(sys.argv) == 1:  # the launcher: two ranks
    init = tempfile.mktemp(prefix="dcp-check-")
    procs = [subprocess.Popen([sys.executable, __file__, str(r), init]) for r in range(2)]
    sys.exit(max(p.wait() for p in procs))

rank, init = int(sys.argv[1]), sys.argv[2]
from fuzzer.env import prepare_process  # noqa: E402

device = prepare_process(None)
import torch  # noqa: E402
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import parallel_state as ps  # noqa: E402

if device == "cuda":
    torch.cuda.set_device(rank)
with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device=device))):
    ps.init_distributed_environment(2, rank, f"file://{init}", rank, "nccl" if device == "cuda" else "gloo")
    ps.initialize_model_parallel(2, 1, 1, 2)
    g = ps.get_dcp_group()
    comm = g.device_communicator
    pynccl = getattr(comm, "pynccl_comm", None)
    x = torch.full((2, 4), float(rank + 1), device=device)
    ag = g.all_gather(x, dim=0)
    rs = g.reduce_scatter(x, dim=1)
    if device == "cuda":
        torch.cuda.synchronize()
    print(f"rank {rank}: communicator {type(comm).__name__}, pynccl "
          f"{'absent' if pynccl is None else ('DISABLED' if pynccl.disabled else 'enabled')}"
          f"{'' if pynccl is None else f' (available={pynccl.available})'}; "
          f"all_gather sum {float(ag.sum())} (want 24.0); reduce_scatter {rs.flatten().tolist()} (want [3.0, 3.0, 3.0, 3.0])",
          flush=True)
