"""On the GPU host only: compute-sanitizer sees the seed bug's out-of-bounds accesses in vLLM's real kernel
with attnfuzz's sanitized environment, and sees nothing with PyTorch's caching allocator on. The second half
is the reason for the first: if the setting ever regressed, memcheck campaigns would go silently blind.

    scripts/gpu-host.sh -- python3 -m pytest -q tests/gpu
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fuzzer.run.compute_sanitizer import (
    SanitizerUnavailable,
    find_compute_sanitizer,
    parse_log,
    sanitized_env,
    sanitizer_command,
)

ROOT = Path(__file__).resolve().parents[2]


def _sanitizer():
    try:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        return find_compute_sanitizer()
    except SanitizerUnavailable as e:
        pytest.skip(str(e))


def _memcheck(env: dict) -> list:
    cmd = sanitizer_command("memcheck", _sanitizer()) + [sys.executable, str(ROOT / "tests/gpu/seed_bug_launch.py")]
    env = dict(env, PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    return parse_log(r.stdout + r.stderr, "memcheck")


def test_memcheck_sees_the_seed_bug_with_attnfuzz_settings():
    reports = _memcheck(sanitized_env())
    print("\n".join(r.describe() for r in reports))
    invalid = [r for r in reports if r.kind.startswith("Invalid __global__")]
    assert invalid, "memcheck saw no invalid access with the caching allocator off"
    assert {r.kernel for r in invalid} == {"sparse_mla_index_remap_kernel"}
    assert all(r.file.endswith("sparse_utils.py") and r.line > 0 for r in invalid)


def test_memcheck_is_blind_with_the_caching_allocator_on():
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NO_CUDA_MEMORY_CACHING"}
    assert [r for r in _memcheck(env) if r.kind.startswith("Invalid")] == []
