"""`vllm.flashattn_sparse.layer` on CPU: MLAAttention on FLASH_ATTN_MLA_SPARSE. Its builder's reorder threshold
(128 query tokens at 16 heads) decides the split: a decode and a 140-token short prefill take forward_mqa and dense
MHA, and the seed bug's class at FlashAttn's own call site (the whole batch's req_id_per_token with the MQA tokens'
top-k) is found there, as a row-count contract break (class A)."""

import functools

import pytest

from strategies.case import Request
from tests.fuzzer.targets.test_flashmla_layer import layer_case

pytestmark = pytest.mark.vllm


@functools.cache
def target():
    from fuzzer.targets.flashattn_layer import FlashAttnMLASparseLayer

    t = FlashAttnMLASparseLayer("cpu")
    if t.unavailable():
        pytest.skip(t.unavailable())
    t.prepare()
    return t


DECODE_PLUS_SHORT_PREFILL = ([Request(1, 70), Request(140, 0)], 1)


def test_a_decode_and_a_short_prefill_take_both_routes_and_pass_and_the_seed_bug_at_fa_s_call_site_is_found():
    import vllm.model_executor.layers.attention.sparse_mla_attention as sma
    import vllm.v1.attention.backends.mla.sparse_utils as su

    from fuzzer.mutants import inject

    t = target()
    case = layer_case(*DECODE_PLUS_SHORT_PREFILL, "bfloat16", topk=256)
    obs = t.run(case)
    assert all(v.ok for v in t.oracle(case, obs)), t.oracle(case, obs)
    assert obs.notes["route"]["mqa_tokens"] == 1 and obs.notes["route"]["mha_tokens"] == 140
    assert "flash_attn_varlen_func" in t.emulated  # FA3's kernel is the stand-in on a CPU, and says so
    patched = [(sma.SparseMLACommonImpl, "forward_mqa"), *((m, "triton_convert_req_index_to_global_index") for m in (su, sma))]
    saved = [(owner, name, vars(owner)[name]) for owner, name in patched]
    inject("flashattn-mqa-full-batch-req-id")
    try:
        found = [v for v in t.oracle(case, t.run(case)) if not v.ok]
    finally:
        for owner, name, original in saved:  # the rest of the session runs unpatched vLLM
            setattr(owner, name, original)
    # (the rows it reads past the top-k it was given hold anything, so block-table reads past the table may follow: C)
    assert "A" in {v.bug_class for v in found if v.check == "memory"}, found
