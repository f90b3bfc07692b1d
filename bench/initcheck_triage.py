#!/usr/bin/env python3
"""Which input shape makes initcheck report, and in which call: hand-built cases of `vllm.flashmla_sparse`,
one question each (head padding, a row with no valid index, fp8 split-KV decode, padding rows, the prefill
gather), run in this process with a marker line around each stage and around each kernel-library call the
backend makes (FlashMLA's kernels, the cache ops, the index remap), the device synchronized at each marker, so
that every report in the compute-sanitizer log falls between two markers. On the GPU host:

  PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool initcheck --print-limit 100000 \
      python3 bench/initcheck_triage.py [NAME ...] > log; python3 bench/sanitizer_log_summary.py initcheck log
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strategies.case import Case, Request, TopkSpec  # noqa: E402


def case(requests, num_decodes, heads, dtype, valid=None, block_size=64, topk_width=256) -> Case:
    """Requests as (query_len, context_len); each row selects `valid` positions (default: all it sees)."""
    table, next_block = [], 1
    width = max(1, max(-(-(q + c) // block_size) for q, c in requests))
    for q, c in requests:
        n = -(-(q + c) // block_size)
        table.append(tuple(range(next_block, next_block + n)) + (0,) * (width - n))
        next_block += n
    valid = [topk_width if valid is None else v for v in (valid if isinstance(valid, list) else [valid] * len(requests))]
    return Case(requests=tuple(Request(q, c) for q, c in requests), num_decodes=num_decodes, block_size=block_size,
                block_table=tuple(table), topk_width=topk_width, topk=tuple(TopkSpec(valid=v) for v in valid),
                heads=heads, kv_cache_dtype=dtype).validate()


CASES = {
    # bf16: FlashMLA's sparse prefill kernel serves decodes and prefills alike
    "bf16-h64-decodes": case([(1, 200), (1, 90)], 2, 64, "bfloat16"),
    "bf16-h16-decodes": case([(1, 200), (1, 90)], 2, 16, "bfloat16"),  # heads padded to 64
    "bf16-h64-prefill": case([(5, 0)], 0, 64, "bfloat16"),
    "bf16-h64-prefill-no-valid": case([(1, 0)], 0, 64, "bfloat16", valid=0),  # one prefill token, no valid index
    "bf16-h64-decodes-padding-row": case([(1, 200), (0, 0)], 2, 64, "bfloat16"),
    # fp8_ds_mla: FlashMLA's fp8 sparse decode kernel (split KV, then the combine kernel)
    "fp8-h64-decode-short": case([(1, 50)], 1, 64, "fp8_ds_mla"),
    "fp8-h64-decodes-long": case([(1, 1500), (1, 700), (1, 40)], 3, 64, "fp8_ds_mla", topk_width=2048),
    "fp8-h128-decodes-long": case([(1, 1500), (1, 700)], 2, 128, "fp8_ds_mla", topk_width=2048),
    "fp8-h16-mixed": case([(1, 300), (4, 0)], 1, 16, "fp8_ds_mla"),  # the mixed-batch path (heads < 64)
    "fp8-h16-decode-no-valid": case([(1, 300), (1, 100)], 2, 16, "fp8_ds_mla", valid=[256, 0]),
    "fp8-h128-prefill-with-context": case([(1, 100), (4, 300)], 1, 128, "fp8_ds_mla"),  # separate path, gather
    "fp8-h64-decodes-padding-row": case([(1, 300), (0, 0)], 2, 64, "fp8_ds_mla"),
    # the layer target (ATTNFUZZ_TRIAGE_TARGET=vllm.flashmla_sparse.layer): one route each
    "layer-one-token-h16": case([(1, 0)], 0, 16, "bfloat16", topk_width=128),  # one token: a decode to vLLM
    "layer-short-prefill-h16": case([(5, 0)], 0, 16, "bfloat16", topk_width=128),  # the dense-MHA route
    "layer-decode-h16": case([(1, 200)], 1, 16, "bfloat16"),  # the MQA route
    "layer-fp8-prefill-with-context-h16": case([(3, 100)], 0, 16, "fp8_ds_mla"),  # dense MHA + context gather
}


def main() -> None:
    names = sys.argv[1:] or [n for n in CASES if not n.startswith("layer-")]
    device = os.environ.get("ATTNFUZZ_TRIAGE_DEVICE", "cuda")  # cpu: to try the script itself
    from fuzzer.env import prepare_process

    prepare_process(device)
    import importlib

    import vllm  # noqa: F401
    from initcheck_stages import stage_marker  # bench/, beside this script

    from fuzzer.support.flashmla_runtime import BACKEND_MODULE
    from fuzzer.targets.registry import TARGETS

    marked = stage_marker(device)

    target = TARGETS[os.environ.get("ATTNFUZZ_TRIAGE_TARGET", "vllm.flashmla_sparse")](device)
    target.prepare()
    mod = importlib.import_module(BACKEND_MODULE)
    for name in ("flash_mla_sparse_fwd", "flash_mla_with_kvcache", "triton_convert_req_index_to_global_index"):
        if hasattr(mod, name):
            setattr(mod, name, marked(name, getattr(mod, name)))
    for name in ("concat_mla_q", "cp_gather_and_upconvert_fp8_kv_cache"):
        if hasattr(mod.ops, name):
            try:
                setattr(mod.ops, name, marked(f"ops.{name}", getattr(mod.ops, name)))
            except (AttributeError, TypeError):  # a module, not the stand-in namespace: leave it
                pass
    impl = mod.FlashMLASparseBackend.get_impl_cls()
    impl.forward_mqa = marked("forward_mqa", impl.forward_mqa)
    if hasattr(impl, "forward_mha"):
        impl.forward_mha = marked("forward_mha", impl.forward_mha)
    print(f"emulated here: {target.emulated}", flush=True)
    for name in names:
        c = CASES[name]
        print(f"CASE {name}: heads {c.heads} {c.kv_cache_dtype} {c.summary()}", flush=True)
        obs = marked("run", target.run)(c)
        verdicts = marked("oracle", type(target).oracle)(c, obs)
        print(f"CASE {name} done: paths {sorted(obs.notes.get('paths', []))} error {obs.error} "
              f"verdicts {[(v.check, v.ok) for v in verdicts]}", flush=True)


if __name__ == "__main__":
    main()
