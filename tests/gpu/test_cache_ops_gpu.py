"""On the GPU host with vLLM's compiled cache ops loaded (scripts/gpu-ops.sh): every cache-op stand-in gives what
its real op gives on the same inputs (bench/cache_ops_check.py: writers byte for byte, gathers bit for bit)."""

import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (ATTNFUZZ_TEST_DEVICE=cuda)")


def test_the_standins_match_vllm_s_compiled_cache_ops():
    done = subprocess.run([sys.executable, "bench/cache_ops_check.py", "--cases", "30"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    if done.returncode == 2:
        pytest.skip(done.stdout.strip() or done.stderr.strip())
    assert done.returncode == 0, done.stdout + done.stderr
