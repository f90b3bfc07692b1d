"""The differential check of the cache-op stand-ins against vLLM's compiled ops (bench/cache_ops_check.py, run on
the GPU host) draws valid cases: here its cases run through the stand-ins on both sides, each in bounds; and
ATTNFUZZ_STANDIN_OPS=1 makes a host with the compiled ops report them missing, so the stand-ins take their place."""

import subprocess
import sys

from fuzzer.support import flashmla_runtime
from tests.conftest import ROOT


def test_the_check_s_cases_run_in_bounds_through_the_standins():
    done = subprocess.run([sys.executable, "bench/cache_ops_check.py", "--cases", "25", "--against", "standins"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if " cases " in line]
    assert len(rows) == 6 and all("   0 differ" in r for r in rows), done.stdout


def test_forcing_the_standins_hides_the_compiled_ops(monkeypatch):
    monkeypatch.setattr(flashmla_runtime, "_has_op", lambda namespace, name: True)  # a host that has them all
    assert flashmla_runtime.has_cache_op("concat_mla_q")
    monkeypatch.setenv("ATTNFUZZ_STANDIN_OPS", "1")
    assert not flashmla_runtime.has_cache_op("concat_mla_q") and not flashmla_runtime._has_flashmla_kernels()
