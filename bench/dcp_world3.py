"""vLLM's DCP LSE correction (`correct_attn_out`, the kernel behind cp_lse_ag_out_rs) for DCP sizes 2-8:
the kernel documents N_ROUNDED as the rank count rounded to a power of two, but its launcher passes the
rank count itself, and tl.arange needs a power of two. Prints what each size does on this host."""
import torch

from fuzzer.env import prepare_process

device = prepare_process(None)
if device == "cpu":  # the interpreter needs attnfuzz's shims (InterpretedFunction.constexprs)
    from fuzzer.support.standins.cpu_shims import install_cpu_shims

    install_cpu_shims()
from vllm.v1.attention.ops.dcp import correct_attn_out  # noqa: E402

for n in (2, 3, 4, 6, 8):
    out = torch.randn(4, 8, 512, device=device, dtype=torch.bfloat16)
    lses = torch.randn(n, 4, 8, device=device)
    try:
        corrected, lse = correct_attn_out(out.clone(), lses, 0, None)
        ref = torch.logsumexp(lses, dim=0)
        print(f"DCP size {n}: ran; merged LSE max error {float((lse - ref).abs().max()):.3g}")
    except Exception as e:
        print(f"DCP size {n}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}")
