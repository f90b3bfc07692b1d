"""The `vllm.flashmla_sparse.layer` target on CPU: vLLM's MLAAttention.forward_impl on FLASHMLA_SPARSE, with
the decode/dense-MHA split, judged after W_UV. Includes vLLM's upstream regression shapes for issue 48611."""

import functools

import pytest
import torch

from strategies.case import Case, Request, TopkSpec

pytestmark = pytest.mark.vllm


@functools.cache
def target():
    from fuzzer.targets.flashmla_layer import FlashMLASparseLayer

    t = FlashMLASparseLayer("cpu")
    if t.unavailable():
        pytest.skip(t.unavailable())
    t.prepare()
    return t


def layer_case(reqs, num_decodes, kv_cache_dtype, heads=16, block_size=64, topk=128) -> Case:
    table, nxt = [], 1
    width = max(-(-r.seq_len // block_size) for r in reqs)
    for r in reqs:
        n = -(-r.seq_len // block_size)
        table.append(tuple(range(nxt, nxt + n)) + (0,) * (width - n))
        nxt += n
    # As vLLM's indexer: a sequence that fits in top-k selects every visible position.
    return Case(requests=tuple(reqs), num_decodes=num_decodes, block_size=block_size, block_table=tuple(table),
                topk_width=topk, topk=tuple(TopkSpec(topk if r.seq_len <= topk else 40) for r in reqs), heads=heads,
                kv_cache_dtype=kv_cache_dtype, seed=5).validate()


# vLLM's regression cases for issue 48611: a decode plus a short prefill; a short prefill with cached context.
DECODE_PLUS_SHORT_PREFILL = ([Request(1, 70), Request(5, 0)], 1)
SHORT_PREFILL_CACHED_CONTEXT = ([Request(1, 300), Request(3, 100)], 1)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8_ds_mla"])
@pytest.mark.parametrize("shape", [DECODE_PLUS_SHORT_PREFILL, SHORT_PREFILL_CACHED_CONTEXT], ids=["decode+prefill", "cached-context"])
def test_upstream_regression_shapes_pass_and_take_both_routes(kv_cache_dtype, shape):
    case = layer_case(*shape, kv_cache_dtype)
    obs = target().run(case)
    verdicts = target().oracle(case, obs)
    assert all(v.ok for v in verdicts), verdicts
    route = obs.notes["route"]
    from fuzzer.support.flashmla_runtime import layer_api

    if layer_api().dense_mha:
        assert route["mqa_tokens"] == 1 and route["mha_tokens"] == case.num_tokens - 1
        assert route["chunked_context"] == (shape is SHORT_PREFILL_CACHED_CONTEXT)
    else:  # 0.23: a sparse impl takes every token through forward_mqa; there is no dense-MHA route
        assert route["mqa_tokens"] == case.num_tokens and route["mha_tokens"] == 0
        assert "no dense-MHA route" in obs.notes["layer_routes"]
    assert obs.outputs["out"].shape == (case.num_tokens, case.heads * 128)


def test_gather_standin_reads_fp8_ds_mla_entries_as_flat_fp8():
    """The misuse behind issue 48611 bug 2, as the CUDA op does it: the first 576 bytes of a 656-byte entry,
    each an e4m3 code times the one scale; the entry's own tile scales are ignored."""
    from fuzzer.support.standins.cache_ops import gather_and_maybe_dequant_cache
    from fuzzer.support.standins.flashmla_ops import dequantize_fp8_ds_mla, quantize_fp8_ds_mla

    kv_c, k_pe = torch.randn(4, 512) * 3, torch.randn(4, 64)
    cache = quantize_fp8_ds_mla(kv_c, k_pe).view(2, 2, 656)
    dst = torch.zeros(4, 576, dtype=torch.bfloat16)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    gather_and_maybe_dequant_cache(cache, dst, i32(0, 1).view(1, 2), i32(0, 4), i32(0, 0, 0, 0), 4, "fp8_ds_mla",
                                   torch.ones(()), None)
    flat = cache.view(4, 656)[:, :576].view(torch.float8_e4m3fn).float().to(torch.bfloat16)
    assert torch.equal(dst.view(torch.int16), flat.view(torch.int16))
    right = dequantize_fp8_ds_mla(cache.view(4, 656)).to(torch.bfloat16)
    assert not torch.allclose(dst.float(), right.float(), atol=0.1)


def test_seed_bug_mutants_are_found_on_the_regression_shapes():
    """Bug 1 (full-batch req_id_per_token at the index group's call) and bug 2 (flat-fp8 context gather)."""
    t = target()  # skips where the layer target is unavailable
    import importlib.util

    if importlib.util.find_spec("vllm.v1.attention.backends.mla.index_group") is None:
        pytest.skip("bug 1's mutant patches the sparse-MLA index group's call site, which this vLLM release lacks "
                    "(0.26 and older convert top-k inside FlashMLASparseImpl)")
    import vllm.model_executor.layers.attention.mla_attention as mla
    import vllm.model_executor.layers.attention.sparse_mla_attention as sma
    import vllm.v1.attention.backends.mla.flashmla_sparse as fs
    import vllm.v1.attention.backends.mla.index_group as ig
    import vllm.v1.attention.backends.mla.sparse_utils as su

    from fuzzer.mutants import inject

    t = target()
    bf16, fp8 = layer_case(*DECODE_PLUS_SHORT_PREFILL, "bfloat16"), layer_case(*SHORT_PREFILL_CACHED_CONTEXT, "fp8_ds_mla")
    clean = [all(v.ok for v in t.oracle(c, t.run(c))) for c in (bf16, fp8)]
    patched = [(ig.SparseMLAIndexGroup, "convert_logical_to_physical_topk"), (mla.MLACommonBaseImpl, "_compute_prefill_context"),
               *((fs.FlashMLASparseImpl, m) for m in ("_forward_bf16_kv", "_forward_fp8_kv_mixed_batch",
                                                      "_forward_fp8_kv_separate_prefill_decode")),
               *((m, "triton_convert_req_index_to_global_index") for m in (su, ig, sma, fs))]
    saved = [(owner, name, vars(owner)[name]) for owner, name in patched]
    inject("remap-full-batch-req-id")
    inject("mha-context-flat-fp8-gather")
    try:
        a = t.oracle(bf16, t.run(bf16))
        e = t.oracle(fp8, t.run(fp8))
    finally:
        for owner, name, original in saved:  # the rest of the session runs unpatched vLLM
            setattr(owner, name, original)
    assert clean == [True, True]
    assert any(v.check == "memory" and "sparse_mla_index_remap_kernel" in v.detail for v in a), a
    assert any(not v.ok and v.check in ("output", "nan") for v in e), e
    # ... and the gathered context itself is judged against the bytes it came from (class E, directly).
    assert any(v.check == "gather" and v.bug_class == "E" for v in e), e


def test_flash_attn_varlen_standin_matches_dense_attention():
    """The FLASH_ATTN prefill backend's kernel stand-in (0.23/0.26 on a CPU): per-request causal attention aligned
    bottom-right, natural-log LSE [H, T], both return forms; an empty key range leaves undefined rows."""
    from fuzzer.support.standins.flash_attn_ops import flash_attn_varlen_func

    torch.manual_seed(0)
    q, k, v = torch.randn(5, 2, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 4)
    cq, ck = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 4, 7], dtype=torch.int32)
    out, lse = flash_attn_varlen_func(q, k, v, 3, cq, 4, ck, softmax_scale=0.5, causal=True, return_softmax_lse=True)
    for (q0, q1), (k0, k1) in (((0, 2), (0, 4)), ((2, 5), (4, 7))):
        s = torch.einsum("qhd,khd->hqk", q[q0:q1], k[k0:k1]) * 0.5
        sq, sk = q1 - q0, k1 - k0
        s = s.masked_fill(torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + (sk - sq), float("-inf"))
        assert torch.allclose(lse[:, q0:q1], torch.logsumexp(s, -1), atol=1e-5)
        assert torch.allclose(out[q0:q1], torch.einsum("hqk,khd->qhd", s.softmax(-1), v[k0:k1]), atol=1e-5)
    out2, lse2, _ = flash_attn_varlen_func(q, k, v, 3, cq, 4, ck, softmax_scale=0.5, causal=True, return_attn_probs=True)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    empty = torch.tensor([0, 0, 3], dtype=torch.int32)  # request 0 has no keys
    out3, lse3 = flash_attn_varlen_func(q, k, v, 3, cq, 3, empty, softmax_scale=0.5, return_softmax_lse=True)
    assert out3[:2].isnan().all() and (lse3[:, :2] == float("-inf")).all() and not out3[2:].isnan().any()


@pytest.mark.parametrize("name", ["vllm.flashmla_sparse.layer", "vllm.flashmla_sparse.layer.dcp"])
def test_cases_keep_vllm_batch_order(name):
    """The layer runs vLLM's whole forward as the model runner calls it, so it draws only batches in the runner's
    order: prefills with context first, padding rows only after a uniform decode batch, never before prefills
    (0.23/0.26 merge the context into the first qsl[num_prefills_with_context] prefill tokens only; 0.33's DCP
    context metadata mis-merges a short prefill's context behind a zero-length row)."""
    from hypothesis import HealthCheck, given, settings

    from fuzzer.targets.registry import TARGETS
    from strategies.profiles import PROFILES

    t = TARGETS[name]("cpu")  # cases are drawn before a target is prepared (a campaign's parent process)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(t.cases(PROFILES["cpu"]).strategy())
    def check(case):
        prefills = case.requests[case.num_decodes:]
        with_context = [r.context_len > 0 for r in prefills]
        assert with_context == sorted(with_context, reverse=True)
        assert not prefills or all(r.query_len for r in case.requests[:case.num_decodes])

    check()


def test_the_dense_mha_route_is_judged_with_the_bf16_keys_and_values_it_attends_with():
    """A step from the H200 gate (fp8_ds_mla, large values, 217 of its 229 tokens on the dense-MHA route with
    chunked context): judged in the latent form, the reference missed kv_b_proj's bf16 rounding of k_nope and v,
    and the route's output sat 1.33x (H200) and 1.46x (CPU) over the tolerance; rounded where vLLM rounds, 0.15x."""
    from fuzzer.support.flashmla_runtime import layer_api
    from tests.conftest import ROOT

    case = Case.from_json((ROOT / "tests" / "fixtures" / "layer-mha-large-values.case.json").read_text())
    obs = target().run(case)
    verdicts = target().oracle(case, obs)
    assert all(v.ok for v in verdicts), verdicts
    if layer_api().dense_mha:
        assert obs.notes["route"]["mha_tokens"] == 217
        assert [v.margin for v in verdicts if v.check == "output"][0] < 0.5
