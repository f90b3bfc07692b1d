#!/usr/bin/env python3
"""Which stage of a backend case makes a sanitizer report: run N cases of a target in this process, with a
marker line before and after each stage (the device synchronized around it), so that every report in the
compute-sanitizer log falls between two markers. For diagnosing, on the GPU host:

  PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool initcheck --print-limit 50 --show-backtrace host \
      python3 bench/initcheck_stages.py vllm.flashmla_sparse 3 [cuda|cpu]
"""

from __future__ import annotations

import functools
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def stage_marker(device: str):
    """marked(label, f): `f` with a STAGE line before and after each call, the device synchronized at each, so
    that every sanitizer report falls between two lines (shared with bench/initcheck_triage.py)."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def marked(label, f):
        @functools.wraps(f)
        def wrapper(*a, **k):
            sync()
            print(f"STAGE {label} begin", flush=True)
            r = f(*a, **k)
            sync()
            print(f"STAGE {label} end", flush=True)
            return r
        return wrapper
    return marked


def main() -> None:
    name, n = sys.argv[1], int(sys.argv[2])
    device = sys.argv[3] if len(sys.argv) > 3 else "cuda"
    from fuzzer.env import prepare_process

    prepare_process(device)
    import vllm  # noqa: F401
    from hypothesis.control import BuildContext
    from hypothesis.internal.conjecture.data import ConjectureData

    from fuzzer.targets.guards import Guards
    from fuzzer.targets.registry import TARGETS
    from strategies.profiles import PROFILES

    marked = stage_marker(device)

    target = TARGETS[name](device)
    target.prepare()
    import importlib

    from fuzzer.support.flashmla_runtime import BACKEND_MODULE

    backend = importlib.import_module(BACKEND_MODULE).FlashMLASparseBackend
    builder, impl = backend.get_builder_cls(), backend.get_impl_cls()
    for cls, meth in ((builder, "__init__"), (builder, "build"), (impl, "__init__"), (impl, "forward_mqa"),
                      (Guards, "check"), (type(target), "step"), (type(target), "finish")):
        setattr(cls, meth, marked(f"{cls.__name__}.{meth}", getattr(cls, meth)))
    strategy = target.cases(PROFILES["gpu" if device == "cuda" else "cpu"]).strategy()
    for i in range(n):
        data = ConjectureData(random=random.Random(i))
        with BuildContext(data, is_final=False, wrapped_test=None):
            case = data.draw(strategy)
        print(f"CASE {i}: heads {case.heads} {case.kv_cache_dtype} {case.summary()}", flush=True)
        obs = marked("run", target.run)(case)
        verdicts = marked("oracle", type(target).oracle)(case, obs)
        print(f"CASE {i} done: paths {sorted(obs.notes.get('paths', []))} error {obs.error} "
              f"verdicts {[(v.check, v.ok) for v in verdicts]}", flush=True)


if __name__ == "__main__":
    main()
