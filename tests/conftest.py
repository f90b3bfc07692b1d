"""Tests run on CPU: vLLM's Triton kernels under the interpreter. The environment must be set before
anything imports triton or vLLM (on a host without a GPU driver vLLM swaps Triton for a placeholder
otherwise), hence at conftest import."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Each pytest-xdist worker its own state directory: campaigns journal their running case per target there.
os.environ.setdefault("ATTNFUZZ_STATE", str(Path(__file__).resolve().parent.parent / ".attnfuzz" / "tests"
                                            / os.environ.get("PYTEST_XDIST_WORKER", "main")))

from fuzzer.env import prepare_process  # noqa: E402  (reads ATTNFUZZ_STATE)

# ATTNFUZZ_TEST_DEVICE=cuda on the GPU host (tests/gpu); everything else is CPU.
prepare_process(os.environ.get("ATTNFUZZ_TEST_DEVICE", "cpu"))

ROOT = Path(__file__).resolve().parent.parent

from tests.preloaded import Preloaded  # noqa: E402

PRELOADED = Preloaded(dict(os.environ))  # started on first use, in the environment prepared above


def pytest_sessionfinish(session, exitstatus):
    PRELOADED.close()


def _vllm_importable() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


def pytest_configure(config):
    config.addinivalue_line("markers", "nightly: a slow end-to-end test, run by `-m nightly` or ATTNFUZZ_NIGHTLY=1")


def _nightly_selected(config) -> bool:
    """Nightly tests run when asked for: ATTNFUZZ_NIGHTLY=1, or a -m expression that names them (not `not nightly`)."""
    expression = config.getoption("markexpr") or ""
    return os.environ.get("ATTNFUZZ_NIGHTLY") == "1" or ("nightly" in expression and "not nightly" not in expression)


def pytest_collection_modifyitems(config, items):
    if not _nightly_selected(config):
        later = pytest.mark.skip(reason="nightly: run with -m nightly or ATTNFUZZ_NIGHTLY=1")
        for item in items:
            if item.get_closest_marker("nightly"):
                item.add_marker(later)
    if _vllm_importable():
        return
    skip = pytest.mark.skip(reason="vLLM is not importable in this environment (see README set-up)")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


def python(*args: str, cwd: Path | None = None, env: dict | None = None, input: str | None = None,
           timeout: int = 900, fresh: bool = False) -> subprocess.CompletedProcess:
    """`python ARGS` in a process of its own, as subprocess.run(..., capture_output=True, text=True) runs it: forked
    from an interpreter that has imported vLLM already (tests/preloaded.py), or with `fresh` a new interpreter (a
    test of the start-up itself)."""
    cmd = [sys.executable, *map(str, args)]
    if not fresh:
        return PRELOADED.run(cmd, cwd=cwd or ROOT, env=env, input=input, timeout=timeout)
    return subprocess.run(cmd, cwd=cwd or ROOT, env=env, input=input, capture_output=True, text=True, timeout=timeout)


def run_repro(directory: Path, *, timeout: int = 600, fresh: bool = False) -> subprocess.CompletedProcess:
    """`python repro.py` in a saved finding's DIRECTORY. Forked from the preloaded interpreter (vLLM imported, the
    environment a CPU reproducer sets before its imports already set) unless `fresh`: test_run's seed-bug test runs
    its reproducer in a new interpreter as a stranger would, and the gate runs every one of repros/ that way."""
    return python("repro.py", cwd=directory, timeout=timeout, fresh=fresh)


def attnfuzz(*args: str, cwd: Path | None = None, timeout: int = 900, state: Path | None = None,
             fresh: bool = False) -> subprocess.CompletedProcess:
    """Run the CLI in a process of its own (mutants patch vLLM process-wide; `python` above says which); `state`: a
    state directory of its own (journal, pending findings, example database), none shared with other tests. A
    campaign runs its cases in the CLI's own process (`--isolation none`) unless the call says otherwise: a worker
    process would import vLLM a second time for nothing a test looks at here (the worker is
    tests/fuzzer/run/test_worker.py's)."""
    env = dict(os.environ, **({"ATTNFUZZ_STATE": str(state)} if state is not None else {}))
    if args and args[0] == "run" and not {"--isolation", "--workers", "--sanitizer"} & set(args):
        args = (*args, "--isolation", "none")
    return python("-m", "fuzzer.cli", *args, cwd=cwd, env=env, timeout=timeout, fresh=fresh)
