"""Where attnfuzz runs: the host, its device, and how vLLM must be imported there.

Everything that has to happen *before* `import vllm` lives here, because vLLM decides at import time
whether Triton is real: on a host without a GPU driver it swaps Triton for a placeholder whose `jit` does
nothing, unless CUDA_VISIBLE_DEVICES is set and empty.
"""

from __future__ import annotations

import os
import platform
import signal
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fuzzer.errors import UsageError

STATE_DIR = Path(os.environ.get("ATTNFUZZ_STATE", ".attnfuzz"))


def _has_cuda_driver() -> bool:
    return any(Path(p).exists() for p in ("/dev/nvidia0", "/dev/nvidiactl", "/proc/driver/nvidia"))


def _torch_has_cuda() -> bool:
    import torch

    return torch.version.cuda is not None


def host_device() -> str:
    """The device a command runs on by default: "cuda" on a host with a GPU driver whose GPUs this process may see
    (CUDA_VISIBLE_DEVICES not set empty), else "cpu"."""
    return "cuda" if _has_cuda_driver() and os.environ.get("CUDA_VISIBLE_DEVICES") != "" else "cpu"


def prepare_process(device: str | None = None) -> str:
    """Configure this process for `device` ("cpu" or "cuda"; None = what the host has) before vLLM loads.

    On a host without a GPU driver, vLLM swaps Triton for a placeholder whose `jit` does nothing unless
    CUDA_VISIBLE_DEVICES is set and empty; Triton must also run its interpreter there.
    """
    if "vllm" in sys.modules:
        return "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    if device is None:
        device = host_device()
    if device == "cuda" and not _has_cuda_driver():
        raise UsageError("--device cuda: this host has no GPU driver (no /dev/nvidia0); run with --device cpu")
    if device == "cuda" and not _torch_has_cuda():
        raise UsageError("--device cuda: this torch is a CPU build (torch.version.cuda is None)")
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["TRITON_INTERPRET"] = "1"
    # Few intra-op threads unless told otherwise. CPU: one; the interpreter is single-threaded Python, and torch's
    # OpenMP pool stalls on every small op while another process holds the other cores (measured on the 2-core CI
    # host: a campaign took 83 s beside a second one, 52 s with one thread each). GPU host: two, as
    # bench/scenario.sh sets; its campaign and worker processes run several at a time (a gate's four campaigns, a
    # fleet's eight workers), each doing the oracle's and the harness's torch work on the CPU, and a pool of every
    # core in each oversubscribes the host.
    os.environ.setdefault("OMP_NUM_THREADS", "1" if device == "cpu" else "2")
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # vLLM writes caches and distributed-init files: keep them inside the campaign's own directory.
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_CACHE_ROOT", str((STATE_DIR / "vllm-cache").resolve()))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return device


def prepare_check_process(script: str, offline_word: str) -> str:
    """For the bench/*_check.py scripts, which compare two implementations on the GPU host: the device, prepared before
    torch is imported: the CPU where the command line holds `offline_word` (their offline form, one implementation on
    both sides), else the GPU. A host that cannot be prepared ends the script with exit 2: could not compare."""
    try:
        return prepare_process("cpu" if offline_word in sys.argv else "cuda")
    except UsageError as e:
        print(f"{script}: cannot compare: {e}")
        sys.exit(2)


@dataclass(frozen=True)
class HostInfo:
    device: str
    device_name: str
    vllm: str
    torch: str
    triton: str
    python: str
    interpreted: bool
    emulated_ops: tuple[str, ...] = field(default_factory=tuple)
    hypothesis: str = ""  # its engine decides how many cases a batch runs (a database replay is not capped)

    def to_dict(self) -> dict:
        return asdict(self)


def installed_vllm() -> str:
    """vLLM's version without importing it here (only fuzzer/targets imports vLLM): the module a target loaded,
    else the installed distribution's metadata."""
    if "vllm" in sys.modules:
        return getattr(sys.modules["vllm"], "__version__", "unknown")
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception as e:  # pragma: no cover - reported, not raised
        return f"unavailable ({type(e).__name__}: {e})"


def host_info(device: str, emulated_ops: tuple[str, ...] = ()) -> HostInfo:
    import hypothesis
    import torch
    import triton

    vllm_version = installed_vllm()
    name = torch.cuda.get_device_name(0) if device == "cuda" else (platform.processor() or platform.machine())
    return HostInfo(
        device=device,
        device_name=name,
        vllm=vllm_version,
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        interpreted=os.environ.get("TRITON_INTERPRET") == "1",
        emulated_ops=tuple(emulated_ops),
        hypothesis=hypothesis.__version__,
    )


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies (a SIGKILLed campaign leaves no hung worker)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass
