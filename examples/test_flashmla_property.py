"""A property of vLLM's FLASHMLA_SPARSE backend, written with attnfuzz as a library (docs/library.md).

`forward_mqa` on attnfuzz's steps (decodes, MTP decodes, padding rows, prefills with cached context; top-k rows
with -1 entries anywhere and every valid count from 0 to top-k; permuted and shared block tables), driven through
the support functions the `vllm.flashmla_sparse` target calls, judged by that target's oracle against attnfuzz's
reference. On a CPU vLLM's Triton kernels run interpreted and bounds-checked, and FlashMLA's compiled kernels are
attnfuzz's stand-ins: an EmulatedWarning names them.

    pytest examples/test_flashmla_property.py                                   # passes
    ATTNFUZZ_INJECT=flashmla-topk-length-dropped pytest examples/test_flashmla_property.py
        # fails: prints the finding and the directory of the reproducer it saved
"""

from fuzzer import api  # first: it prepares the process before vLLM is imported

import functools

import torch
from hypothesis import given
from vllm.config import set_current_vllm_config

from fuzzer.support.flashmla_runtime import flashmla_sparse_backend
from fuzzer.support.sparse_mla_steps import forward_mqa, mla_spec, prepare_host, sparse_mla_engine, step_config, topk_buffer

TARGET = "vllm.flashmla_sparse"
DEVICE = api.device()
PROFILE = api.PROFILES["gpu" if DEVICE == "cuda" else "cpu"]

# Single steps of a bf16 cache, blocks of 64 or 128 tokens, laid out contiguously: the strategy's knobs for the
# steps this test drives (the target's own strategy, api.cases(TARGET), adds fp8_ds_mla, traces and CUDA graphs).
STEPS = api.attention_cases(PROFILE, api.AttentionFeatures(kv_cache_dtypes=("bfloat16",), block_sizes=(64, 128),
                                                           block_stride_rows=False))


@functools.cache
def backend():
    """vLLM's FLASHMLA_SPARSE backend and the stand-ins bound for it on this host. api.target() first: the
    target's preparation of the host (and the mutant ATTNFUZZ_INJECT names, if any)."""
    api.target(TARGET)
    backend_cls, emulated, _shims = prepare_host(flashmla_sparse_backend, DEVICE)
    return backend_cls, emulated


@api.settings(max_examples=20)
@given(case=STEPS)
def test_forward_mqa_matches_the_reference(case):
    backend_cls, emulated = backend()
    inputs = api.materialize_attention_inputs(case, DEVICE)  # q, kv_c, k_pe; the indexer's rows; the block table
    rows = case.num_tokens + 8
    cfg = step_config(DEVICE, case.heads, case.topk_width, case.kv_cache_dtype, case.block_size, rows)
    topk_indices_buffer = topk_buffer(rows, case.topk_width, DEVICE)  # the indexer's persistent buffer, poisoned
    topk_indices_buffer[: case.num_tokens] = inputs.index.topk_indices
    builder, impl = sparse_mla_engine(backend_cls, mla_spec(case.block_size, case.kv_cache_dtype), cfg, case.heads,
                                      case.kv_cache_dtype, topk_indices_buffer, DEVICE)
    cache = api.paged_cache(case, DEVICE)  # every slot NaN until written
    write, write_emulated = api.cache_writer(DEVICE)
    slots = api.written_slots(case).to(DEVICE)  # the step's own tokens, and the context its requests hold
    write(inputs.kv_c[slots], inputs.k_pe[slots], cache, slots, "auto", torch.ones((), device=DEVICE))

    def call():
        with set_current_vllm_config(cfg), torch.inference_mode():
            metadata = builder.build(0, api.common_attn_metadata(case, inputs.index, DEVICE))
            out, lse = forward_mqa(impl, inputs.q, cache, metadata)
        return {"out": out, "lse": lse}

    obs = api.observe(TARGET, call, emulated=tuple(x for x in (*emulated, write_emulated) if x))
    api.judge(TARGET, case, obs)


@api.settings(max_examples=10)
@given(case=api.cases(TARGET))
def test_flashmla_sparse_as_a_campaign_runs_it(case):
    """The target's own strategy (both cache dtypes, traces of up to 4 steps, full CUDA graphs), each case run
    through the target as a campaign runs it."""
    api.check(TARGET, case)
