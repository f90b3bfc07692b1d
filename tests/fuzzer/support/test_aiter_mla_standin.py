"""attnfuzz's stand-in of AITER's MLA decode as vLLM's ROCM_AITER_MLA_SPARSE calls it (gfx950): the buffer shapes of
get_mla_metadata_info_v1, the work plan of get_mla_metadata_v1 in its documented layout, mla_decode_fwd in
persistent and split-KV mode. At the edges: empty rows, -1 entries, the last row of the last page and one past it,
fp8 scales; what AITER refuses and what the stand-in does not model (could-not-test). No vLLM."""

import math

import pytest
import torch

from fuzzer.support.errors import StandInRefused
from fuzzer.support.standins import aiter_mla as am
from tests.fuzzer.support.sanitized import violations_during as _violations

H, D, V, SCALE = 16, 576, 512, 0.1
I32 = dict(dtype=torch.int32)


@pytest.fixture(autouse=True)
def _clear():
    am.UNDOCUMENTED.clear()
    yield
    am.UNDOCUMENTED.clear()


def _plan(kv_indptr, heads=H, max_tokens=64, split=2, dtype=torch.bfloat16):
    """The six buffers as vLLM's builder sizes them (max_num_batched_tokens), planned for one query a batch."""
    shapes = am.get_mla_metadata_info_v1(max_tokens, 1, heads, dtype, dtype, is_sparse=True, fast_mode=True)
    bufs = [torch.full(torch.Size([s]) if isinstance(s, int) else s, -7, dtype=t) if t != torch.uint64
            else torch.zeros(s, dtype=torch.int64) for s, t in shapes]
    meta, work_indptr, work_info, reduce_indptr, final_map, partial_map = bufs
    n = kv_indptr.numel() - 1
    am.get_mla_metadata_v1(torch.arange(n + 1, **I32), kv_indptr, torch.ones(n, **I32), heads, 1, True, meta,
                           work_info, work_indptr, reduce_indptr, final_map, partial_map, page_size=1,
                           kv_granularity=16, max_seqlen_qo=1, uni_seqlen_qo=1, fast_mode=True,
                           max_split_per_batch=split, dtype_q=dtype, dtype_kv=dtype)
    return dict(work_meta_data=meta, work_indptr=work_indptr, work_info_set=work_info, reduce_indptr=reduce_indptr,
                reduce_final_map=final_map, reduce_partial_map=partial_map)


def _decode(q, rows, kv_indptr, kv_indices, plan=None, **kw):
    n = q.shape[0]
    o = torch.full((n, q.shape[1], V), float("nan"), dtype=torch.bfloat16)
    am.mla_decode_fwd(q, rows.view(-1, 1, 1, D), o, torch.arange(n + 1, **I32), kv_indptr, kv_indices,
                      torch.ones(n, **I32), 1, sm_scale=SCALE, **(plan or {}), **kw)
    return o


def _reference(q, rows, kv_indptr, kv_indices, scale=SCALE, v_scale=1.0):
    out = []
    for t in range(q.shape[0]):
        k = rows[kv_indices[kv_indptr[t]:kv_indptr[t + 1]].long()].float()
        out.append(torch.softmax((q[t].float() @ k.T) * scale, -1) @ k[:, :V] * v_scale)
    return torch.stack(out)


def _inputs(lengths, rows=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(rows, D, generator=g).bfloat16()
    q = torch.randn(len(lengths), H, D, generator=g).bfloat16()
    indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], **I32)
    indices = torch.randint(0, rows, (int(indptr[-1]),), generator=g, dtype=torch.int32)
    return q, cache, indptr, indices


def test_info_shapes_follow_aiter_for_gfx950():
    """get_mla_metadata_info_v1 for vLLM's call (max tokens, one query, heads padded to 16, sparse, fast mode)."""
    shapes = am.get_mla_metadata_info_v1(100, 1, 16, torch.bfloat16, torch.bfloat16, is_sparse=True)
    assert [s for s, _ in shapes] == [2, 257, (100 + 255, 8), 101, (100, 2), min(100 + 255, 510)]
    assert [t for _, t in shapes] == [torch.uint64] + [torch.int32] * 5
    # 128 bf16 heads: one 128-wide tile a batch; fp8 64 heads too
    assert am.get_mla_metadata_info_v1(8, 1, 128, torch.bfloat16, torch.bfloat16, True)[3][0] == 8 + 1
    assert am.get_mla_metadata_info_v1(8, 1, 64, am.FP8, am.FP8, True)[3][0] == 8 + 1


def test_persistent_plan_splits_and_merges_to_the_split_kv_answer():
    """A plan that splits long rows (max_split_per_batch 2) gives the attention the split-KV path gives: the merge
    is by LSE. The plan is in the documented layout: one work item per piece, partial slots for split batches."""
    q, cache, indptr, indices = _inputs([1, 40, 200, 17])
    plan = _plan(indptr, split=2)
    ends = plan["work_indptr"]
    works = plan["work_info_set"][: int(ends[-1])]
    assert works[:, 0].tolist() == [0, 1, 1, 2, 2, 3, 3]  # lengths 1 (one piece), 40, 200, 17 (two each)
    assert works[0, 1] == -1 and (works[1:, 1] >= 0).all()
    assert works[2, 5] == indptr[2] and works[1, 4] == indptr[1]  # pieces cover each batch's range exactly
    assert (plan["reduce_indptr"][5:] == plan["reduce_indptr"][4]).all()  # tiles past the batch: empty groups
    persistent = _decode(q, cache, indptr, indices, plan)
    split_kv = _decode(q, cache, indptr, indices)
    expected = _reference(q, cache, indptr, indices)
    assert torch.allclose(persistent.float(), expected, atol=2e-2)
    assert torch.allclose(persistent.float(), split_kv.float(), atol=1e-2)


def test_empty_row_is_left_as_it_was_and_said_not_public():
    """A batch of no KV entries (a CUDA-graph padding token's row): the reference's answer is 0/0; AITER's is not
    public. The stand-in writes nothing there and says so."""
    q, cache, indptr, indices = _inputs([3, 0, 5])
    out = _decode(q, cache, indptr, indices)
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()
    assert any("no KV entries" in what for what, _ in am.UNDOCUMENTED)


def test_padding_tokens_past_the_plan_are_never_written():
    """Persistent mode follows the plan: q rows in no work item (padding tokens past the planned batch, as vLLM
    plans only its real tokens) are not written, whatever kv_indptr says about them."""
    q, cache, indptr, indices = _inputs([3, 5, 0, 0])
    plan = _plan(indptr[:3])  # the builder plans the 2 real tokens
    out = _decode(q, cache, indptr, indices, plan)
    assert not out[:2].isnan().any() and out[2:].isnan().all()


def test_minus_one_and_past_the_cache_are_violations_and_skipped():
    """kv_indices entries outside the cache (-1, or one past the last page's last row) are out-of-bounds loads;
    the last row itself is inside."""
    q, cache, indptr, indices = _inputs([3, 3])
    indices = torch.tensor([0, 95, -1, 4, 96, 5], **I32)  # 95: the last row of the cache
    out, found = _violations(lambda: _decode(q, cache, indptr, indices))
    assert len(found) == 2 and {v.argument for v in found} == {"kv_buffer"}
    keep = torch.tensor([0, 95, 4, 5], **I32)
    expected = _reference(q, cache, torch.tensor([0, 2, 4], **I32), keep)
    assert torch.allclose(out.float(), expected, atol=2e-2)


def test_plan_range_past_kv_indices_is_a_violation():
    q, cache, indptr, indices = _inputs([4, 4])
    plan = _plan(indptr)
    plan["work_info_set"][1, 5] = 50  # batch 1's range past the 8 indices
    _, found = _violations(lambda: _decode(q, cache, indptr, indices, plan))
    assert [v.argument for v in found] == ["kv_indices"]


def test_fp8_scales_scale_scores_and_values():
    """fp8 query over an fp8 cache: scores x sm_scale x q_scale x kv_scale, values x kv_scale (test_mla_sparse.py's
    ref_masked_attention); the scales are one-element fp32 tensors, as vLLM's layer holds them."""
    q, cache, indptr, indices = _inputs([6, 9])
    qs, ks = 0.5, 2.0
    q8, c8 = (q.float() / qs).to(am.FP8), (cache.float() / ks).to(am.FP8)
    out = _decode(q8, c8, indptr, indices, _plan(indptr, dtype=am.FP8), q_scale=torch.tensor([qs]),
                  kv_scale=torch.tensor([ks]))
    expected = _reference(q8.float(), c8.float(), indptr, indices, scale=SCALE * qs * ks, v_scale=ks)
    assert torch.allclose(out.float(), expected, atol=3e-2)


def test_return_lse_is_natural_log():
    q, cache, indptr, indices = _inputs([5])
    n = 1
    o = torch.empty((n, H, V), dtype=torch.bfloat16)
    _, lse = am.mla_decode_fwd(q, cache.view(-1, 1, 1, D), o, torch.arange(2, **I32), indptr, indices,
                               torch.ones(1, **I32), 1, sm_scale=SCALE, return_lse=True)
    k = cache[indices.long()].float()
    assert torch.allclose(lse[0], torch.logsumexp((q[0].float() @ k.T) * SCALE, -1), atol=1e-4)
    assert not math.isnan(float(lse[0, 0]))


def test_stale_plan_is_followed_and_said_not_public():
    q, cache, indptr, indices = _inputs([4, 4])
    plan = _plan(indptr)
    later = torch.tensor([0, 2, 8], **I32)
    _decode(q, cache, later, indices, plan)
    assert any("another kv_indptr" in what for what, _ in am.UNDOCUMENTED)


@pytest.mark.parametrize("kw,what", [
    (dict(page_size=64), "page_size"), (dict(cp_world_size=2), "CP"), (dict(return_logits=True), "return_logits")])
def test_forms_vllm_never_passes_are_refused(kw, what):
    q, cache, indptr, indices = _inputs([2])
    with pytest.raises(StandInRefused, match=what):
        _decode(q, cache, indptr, indices, **kw)


def test_aiter_s_own_refusals():
    q, cache, indptr, indices = _inputs([2])
    with pytest.raises(AssertionError, match="logit_cap"):
        _decode(q, cache, indptr, indices, logit_cap=30.0)
    with pytest.raises(StandInRefused, match="fp8 query over a bf16 cache"):
        _decode(q.float().to(am.FP8), cache, indptr, indices)


def test_importable_only_inside_the_block():
    import importlib.util

    with am.importable() as aiter:
        from aiter import dtypes, get_mla_metadata_info_v1  # noqa: F401
        from aiter.mla import mla_decode_fwd

        assert mla_decode_fwd is am.mla_decode_fwd and aiter.dtypes.fp8 is torch.float8_e4m3fn
    assert importlib.util.find_spec("aiter") is None
