"""Two ranks in vLLM's DCP group (NCCL on GPUs, gloo on CPUs): do the collectives DCP's merge uses return what
they should? Per rank it prints vLLM's device communicator, whether its PyNccl communicator is enabled (and why
not), then three checks on known values, each against a reference every rank computes by itself:
  1. all_gather(dim=0) and reduce_scatter(dim=1) of small float32 tensors;
  2. reduce_scatter(dim=1) of a bf16 [T, 2H, 512] tensor, as the combine calls it;
  3. vLLM's whole combine, `cp_lse_ag_out_rs` (LSE all-gather, `correct_attn_out`, reduce-scatter), on partial
     outputs and LSEs with rows where one rank holds nothing (LSE -inf), against an fp32 merge.
With --enable-pynccl, first what the real-rank target does to let vLLM's PyNccl load the host's NCCL
(fuzzer/targets/flashmla_dcp_ranks.py: enable_pynccl).
Exit 1 if any check fails on any rank.  Run: python bench/dcp_collectives_check.py [--enable-pynccl]"""
import os
import subprocess
import sys
import tempfile

ENABLE = "--enable-pynccl" in sys.argv
args = [a for a in sys.argv[1:] if a != "--enable-pynccl"]
if not args:  # the launcher: two ranks
    init = tempfile.mktemp(prefix="dcp-check-")
    procs = [subprocess.Popen([sys.executable, __file__, str(r), init] + sys.argv[1:]) for r in range(2)]
    sys.exit(max(p.wait() for p in procs))

rank, init = int(args[0]), args[1]
from fuzzer.env import prepare_process  # noqa: E402

device = prepare_process(None)
import torch  # noqa: E402
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import parallel_state as ps  # noqa: E402

N, T, H, D = 2, 37, 16, 512


def inputs_of(r: int):
    """Rank r's partial output [T, N*H, D] bf16 and LSE [T, N*H] fp32; rows 5..9 hold nothing on rank 1."""
    g = torch.Generator().manual_seed(1234 + r)
    out = torch.randn(T, N * H, D, generator=g).bfloat16()
    lse = torch.randn(T, N * H, generator=g) * 3
    if r == 1:
        lse[5:10] = float("-inf")
    return out, lse


def reference():
    outs, lses = zip(*(inputs_of(r) for r in range(N)))
    lse = torch.stack(lses)  # [N, T, NH]
    w = torch.softmax(lse, dim=0).nan_to_num(0.0)  # the merge weights
    merged = sum(w[r].unsqueeze(-1) * outs[r].float() for r in range(N))
    return merged[:, rank * H:(rank + 1) * H]


if device == "cuda":
    torch.cuda.set_device(rank)
    if ENABLE:
        from fuzzer.targets.flashmla_dcp_ranks import enable_pynccl

        print(f"rank {rank}: enable_pynccl: {enable_pynccl()}", flush=True)
else:
    from fuzzer.support.standins.cpu_shims import install_cpu_shims

    install_cpu_shims()  # the Triton interpreter runs the LSE correction
failed = []
with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device=device))):
    ps.init_distributed_environment(N, rank, f"file://{init}", rank, "nccl" if device == "cuda" else "gloo")
    ps.initialize_model_parallel(N, 1, 1, N)
    g = ps.get_dcp_group()
    comm = g.device_communicator
    pynccl = getattr(comm, "pynccl_comm", None)
    why = ""
    if pynccl is not None and pynccl.disabled and device == "cuda":
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary
        try:
            NCCLLibrary(None)
            why = " (NCCLLibrary loads now)"
        except Exception as e:  # the reason PyNccl disabled itself
            why = f" (NCCLLibrary: {type(e).__name__}: {e})"
    print(f"rank {rank}: communicator {type(comm).__name__}, pynccl "
          f"{'absent' if pynccl is None else ('DISABLED' if pynccl.disabled else 'enabled')}{why}; "
          f"VLLM_NCCL_SO_PATH={os.environ.get('VLLM_NCCL_SO_PATH')}; torch nccl "
          f"{torch.cuda.nccl.version() if device == 'cuda' else '-'}", flush=True)

    x = torch.full((2, N), float(rank + 1), device=device)
    ag = g.all_gather(x, dim=0).float().cpu()
    rs = g.reduce_scatter(x, dim=1).float().cpu()
    ok1 = torch.equal(ag[::2, 0], torch.arange(1.0, N + 1)) and bool((rs == N * (N + 1) / 2).all())
    print(f"rank {rank}: 1. small all_gather {ag[:, 0].tolist()}, reduce_scatter {rs.flatten().tolist()}: "
          f"{'ok' if ok1 else 'WRONG'}", flush=True)

    outs = [inputs_of(r)[0] for r in range(N)]
    rs = g.reduce_scatter(outs[rank].to(device), dim=1).float().cpu()
    want = sum(o.float() for o in outs)[:, rank * H:(rank + 1) * H]
    err2 = float((rs - want).abs().max())
    ok2 = err2 <= 0.1
    print(f"rank {rank}: 2. bf16 reduce_scatter(dim=1) max error {err2:.3g}: {'ok' if ok2 else 'WRONG'}", flush=True)

    from vllm.v1.attention.ops.dcp import cp_lse_ag_out_rs

    out, lse = inputs_of(rank)
    merged = cp_lse_ag_out_rs(out.to(device), lse.to(device), g).float().cpu()
    err3 = float((merged - reference()).abs().nan_to_num(float("inf")).max())
    ok3 = err3 <= 0.05
    print(f"rank {rank}: 3. cp_lse_ag_out_rs max error {err3:.3g} (NaN {int(merged.isnan().sum())}): "
          f"{'ok' if ok3 else 'WRONG'}", flush=True)
    failed = [n for n, ok in ((1, ok1), (2, ok2), (3, ok3)) if not ok]
    if device == "cuda":
        torch.cuda.synchronize()
sys.exit(1 if failed else 0)
