"""The ROCm layer's standalone inverse RoPE reads the wrong positions (class N): DeepSeek-V4's ROCm `forward_mqa`
(ROCM_FLASHMLA_SPARSE_DSV4) rotates the rows its decode reduce did not, output[rotated:], with the positions of
the batch's first rows, positions[:T - rotated], instead of their own, positions[rotated:]. A step of decodes only
or prefills only is unaffected (rotated is all of the rows or none); with both, every prefill row is rotated back
by a decode's or an earlier prefill token's angle. Found by the output check; needs a step with decodes and
prefills whose positions differ. Beside the other V4 backends (`vllm.dsv4.all`) it is the one out of line."""

from fuzzer.mutants._kernel_patch import patch_method

BUG_CLASS = "N"
TARGETS = ("vllm.dsv4.rocm", "vllm.dsv4.all")


def unavailable(device: str) -> str | None:
    if device != "cpu":  # vllm.dsv4.all runs there without its ROCm backend
        return "the ROCm layer runs on a CPU only (its Triton launches take AMD options): no case on a GPU reaches it"
    return None


def apply():
    patch_method("vllm.models.deepseek_v4.amd.rocm", "DeepseekV4ROCMAiterMLAAttention", "forward_mqa",
                 [(("positions[rotated:]", "positions[:positions.shape[0] - rotated]"),  # the standalone pass's
                   ("positions[rotated:end]", "positions[:end - rotated]"))],  # 0.34: it ends where the kernel's begin
                 "dsv4-rocm-inverse-rope-positions-unshifted")
