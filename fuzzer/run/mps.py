"""CUDA's Multi-Process Service for fleet workers that share a GPU (`attnfuzz run --workers N --mps`).

Without it a GPU time-slices between the workers' CUDA contexts: eight workers on one H200 each ran a case's
device work 2-3 times slower than one worker alone did. Under MPS their kernels run side by side, and each
worker keeps nearly its speed alone (docs/benchmarks.md, "Throughput per worker and per H200").

The fleet uses a control daemon that already serves (CUDA_MPS_PIPE_DIRECTORY's, else the default
/tmp/nvidia-mps); otherwise it starts one in a pipe directory of its own, so that only its workers are that
daemon's clients, and quits it when they are done. Nothing of the GPU's settings changes.

The cost, from NVIDIA's MPS guide: a fatal GPU fault in one client is seen by every client on that GPU. A memory
fault that one worker's case makes can end the cases running beside it too, as `device_lost` crashes that do not
repeat when re-run (`--reruns`, flaky); for a campaign that hunts memory faults, leave MPS off.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fuzzer.errors import UsageError

CONTROL = "nvidia-cuda-mps-control"
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
START_SECONDS = 10.0  # how long the daemon may take to open its control pipe


@dataclass(frozen=True)
class Mps:
    pipe_directory: str
    log_directory: str
    started: bool  # True: this fleet started the daemon (and quits it); False: one already served

    def env(self) -> dict[str, str]:
        """What a worker needs in its environment to be this daemon's client."""
        return {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_directory, "CUDA_MPS_LOG_DIRECTORY": self.log_directory}


def serving() -> str | None:
    """The pipe directory of a control daemon that already serves this process's CUDA clients, or None."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY
    return pipe if (Path(pipe) / "control").exists() else None


def start(gpus: list[str]) -> Mps:
    """A daemon for the fleet's workers on `gpus`: the one already serving, or a new one of the fleet's own."""
    if pipe := serving():
        return Mps(pipe, os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"), started=False)
    control = shutil.which(CONTROL)
    if control is None:
        raise UsageError(f"--mps: {CONTROL} is not on PATH (it comes with the NVIDIA driver)")
    # A short path: the daemon's pipes are Unix sockets, whose paths may not exceed 107 bytes.
    root = tempfile.mkdtemp(prefix="attnfuzz-mps-", dir="/tmp")
    mps = Mps(root, os.path.join(root, "log"), started=True)
    os.makedirs(mps.log_directory)
    env = dict(os.environ, **mps.env(), CUDA_VISIBLE_DEVICES=",".join(gpus))
    done = subprocess.run([control, "-d"], env=env, capture_output=True, text=True, timeout=30)
    deadline = time.monotonic() + START_SECONDS
    while done.returncode == 0 and not (Path(root) / "control").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if done.returncode != 0 or not (Path(root) / "control").exists():
        log = Path(mps.log_directory) / "control.log"
        why = (done.stderr.strip() or done.stdout.strip()
               or (log.read_text(errors="replace").strip()[-300:] if log.exists() else "no control pipe"))
        shutil.rmtree(root, ignore_errors=True)
        raise UsageError(f"--mps: {CONTROL} -d did not start a daemon (exit {done.returncode}): {why}")
    return mps


def stop(mps: Mps) -> None:
    """Quit a daemon this fleet started (after its workers are gone); one that already served stays."""
    if not mps.started:
        return
    env = dict(os.environ, **mps.env())
    try:
        subprocess.run([shutil.which(CONTROL) or CONTROL], input="quit\n", env=env, capture_output=True, text=True,
                       timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pass
    deadline = time.monotonic() + START_SECONDS
    while (Path(mps.pipe_directory) / "control").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    shutil.rmtree(mps.pipe_directory, ignore_errors=True)
