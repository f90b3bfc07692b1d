"""attnfuzz's stand-in of FlashInfer's BatchMLAPagedAttentionWrapper (fa3, SM90) as vLLM's FLASHINFER_MLA_SPARSE_SM90
drives it: reserved graph buffers, the flat CSR plan (one batch row per query token, the top-k slots as pages of one
token), the planner's int-workspace layout that vLLM's clamp rewrites, the kernel's semantics and checks. No vLLM."""

import importlib.util
import inspect
import warnings

import pytest
import torch

from fuzzer.support import cudagraphs
from fuzzer.support.interp.sanitizer import SANITIZER
from fuzzer.support.standins import flashinfer_mla as fi

H, MAX_TOKENS, WIDTH = 16, 8, 256


def _wrapper(max_tokens=MAX_TOKENS, width=WIDTH):
    ws = torch.empty(128 << 20, dtype=torch.uint8)  # vLLM reserves 128 MiB (partial outputs need 17 MiB at 132 SMs)
    bufs = dict(qo_indptr=torch.zeros(max_tokens + 1, dtype=torch.int32),
                kv_indptr=torch.zeros(max_tokens + 1, dtype=torch.int32),
                kv_indices=torch.zeros(max_tokens * width, dtype=torch.int32),
                kv_len_arr=torch.zeros(max_tokens, dtype=torch.int32))
    return fi.BatchMLAPagedAttentionWrapper(ws, use_cuda_graph=True, backend="fa3", **bufs), bufs


def _plan(w, bufs, lens, heads=H, kv_dtype=torch.bfloat16, kpe=64):
    """vLLM's _SM90State._plan: every row one query token, rows past the step's tokens empty."""
    n, max_tokens = len(lens), bufs["kv_len_arr"].numel()
    qo = torch.clamp(torch.arange(max_tokens + 1, dtype=torch.int32), max=n)
    kv_len = torch.zeros(max_tokens, dtype=torch.int32)
    kv_len[:n] = torch.tensor(lens, dtype=torch.int32)
    kv = torch.zeros(max_tokens + 1, dtype=torch.int32)
    kv[1:] = torch.cumsum(kv_len, 0)
    with warnings.catch_warnings():  # FlashInfer 0.7 deprecates the positional form vLLM calls (once per wrapper)
        warnings.simplefilter("ignore", DeprecationWarning)
        w.plan(qo, kv, bufs["kv_indices"][: max(int(kv[-1]), 1)], kv_len, heads, 512, kpe, 1, False, 0.1,
               q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
    return kv


def _reference(q, kv_rows, pages, kv, counts):
    out = []
    for t, c in enumerate(counts):
        k = kv_rows[pages[int(kv[t]): int(kv[t]) + c].long()]
        s = (q[t].float() @ k.T) * 0.1
        out.append(torch.softmax(s, -1) @ k[:, :512] if c else torch.zeros(q.shape[1], 512))
    return torch.stack(out)


@pytest.mark.parametrize("heads,fp8,one_work_a_chunk", [(16, False, False), (128, False, False), (16, True, False),
                                                       (128, True, True)])
def test_run_is_attention_over_each_row_s_pages_with_splits_clusters_and_fp8_dequant(heads, fp8, one_work_a_chunk,
                                                                                     monkeypatch):
    """Long rows are split over KV chunks and merged; 128 heads take clusters of 2 CTAs; an fp8 cache is read as
    bf16(bf16(x) * bf16(scale)), ckv_scale for the latent and kpe_scale for RoPE. The emulation's chunks of works
    (and of merged rows) change nothing but its memory."""
    if one_work_a_chunk:
        monkeypatch.setitem(fi.CHUNK_BYTES, "cpu", 1)
    g = torch.Generator().manual_seed(1)
    w, bufs = _wrapper()
    lens = [3, 200, 1, 50, 0, 120]
    kv = _plan(w, bufs, lens, heads, torch.float8_e4m3fn if fp8 else torch.bfloat16)
    assert w._plan_info[0] == (2 if heads == 128 else 1) and w._planned_backend._works > len(lens)  # split KV
    n = int(kv[-1])
    pages = torch.randint(0, 300, (n,), generator=g, dtype=torch.int32)
    bufs["kv_indices"][:n] = pages
    q = torch.randn(len(lens), heads, 576, generator=g).bfloat16()
    cache = torch.randn(300, 1, 576, generator=g) * 0.5
    if fp8:
        cache = cache.to(torch.float8_e4m3fn)
        rows = torch.cat([(cache[:, 0, :512].float() * 1.5).bfloat16(), (cache[:, 0, 512:].float() * 0.5).bfloat16()], -1)
        out = w.run(q[..., :512], q[..., 512:], cache[..., :512], cache[..., 512:], ckv_scale=1.5, kpe_scale=0.5)
    else:
        cache = cache.bfloat16()
        rows = cache[:, 0]
        out = w.run(q[..., :512], q[..., 512:], cache[..., :512], cache[..., 512:])
    torch.testing.assert_close(out.float(), _reference(q, rows.float(), pages, kv, lens), atol=2e-2, rtol=2e-2)


def test_the_int_workspace_holds_flashinfer_s_work_arrays_and_a_clamped_kv_end_shortens_rows():
    """vLLM reads q_indptr/kv_start/kv_end at the plan's offsets (MLAPlanInfo, 16-byte aligned arrays of 16,384
    int32) and rewrites kv_end in place: the kernel then attends to each row's first kv_end - kv_start entries."""
    g = torch.Generator().manual_seed(2)
    w, bufs = _wrapper()
    lens = [30, 30, 30]
    kv = _plan(w, bufs, lens)
    info = w._plan_info
    assert len(info) == 18 and info[2:4] == [0, 4 * fi.MAX_WORKS] and info[1] == fi.EMULATED_SMS
    ws = w._planned_backend._int_workspace_buffer.view(torch.int32)
    works = int(ws[info[15] // 4 + info[1]])  # work_indptr[num_clusters]: the works vLLM's clamp visits
    rows = ws[info[2] // 4: info[2] // 4 + works]
    assert sorted(rows.tolist()) == [0, 1, 2]  # one work per row (none past the KV split limit, 32), by q_indptr
    ws[info[14] // 4: info[14] // 4 + works] = 7  # _clamp_work_kv_end: each row's exact count
    n = int(kv[-1])
    pages = torch.randint(0, 64, (n,), generator=g, dtype=torch.int32)
    bufs["kv_indices"][:n] = pages
    q = torch.randn(3, H, 576, generator=g).bfloat16()
    cache = torch.randn(64, 1, 576, generator=g).bfloat16()
    out = w.run(q[..., :512], q[..., 512:], cache[..., :512], cache[..., 512:])
    torch.testing.assert_close(out.float(), _reference(q, cache[:, 0].float(), pages, kv, [7, 7, 7]), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("one_work_a_chunk", [False, True])
def test_pages_outside_the_cache_and_rows_past_q_are_memory_violations_and_skipped(one_work_a_chunk, monkeypatch):
    if one_work_a_chunk:  # each chunk's checks reported at the launch's end, as in one
        monkeypatch.setitem(fi.CHUNK_BYTES, "cpu", 1)
    w, bufs = _wrapper()
    kv = _plan(w, bufs, [4, 4])
    bufs["kv_indices"][: int(kv[-1])] = torch.tensor([1, 2, 99, 3, 1, 1, 1, 1], dtype=torch.int32)
    cache = torch.randn(10, 1, 576).bfloat16()
    q = torch.randn(2, H, 576).bfloat16()
    before = len(SANITIZER.violations)
    out = w.run(q[..., :512], q[..., 512:], cache[..., :512], cache[..., 512:])
    found = SANITIZER.violations[before:]
    del SANITIZER.violations[before:]
    assert {v.argument for v in found} == {"ckv_cache"} and torch.isfinite(out).all()  # page 99 skipped
    q1 = torch.randn(1, H, 576).bfloat16()  # the plan's second row has no query row
    bufs["kv_indices"][2] = 2
    before = len(SANITIZER.violations)
    w.run(q1[..., :512], q1[..., 512:], cache[..., :512], cache[..., 512:])
    found = SANITIZER.violations[before:]
    del SANITIZER.violations[before:]
    assert {v.argument for v in found} == {"q_nope", "o"}


def test_misuse_raises_as_flashinfer_does():
    w, bufs = _wrapper()
    cache = torch.zeros(4, 1, 576, dtype=torch.float8_e4m3fn)
    q = torch.zeros(1, H, 576, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="called before plan"):
        w.run(q[..., :512], q[..., 512:], cache[..., :512], cache[..., 512:], ckv_scale=1.0, kpe_scale=1.0)
    _plan(w, bufs, [2], kv_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="kpe_scale is required"):
        w.run(q[..., :512], q[..., 512:], cache[..., :512], cache[..., 512:], ckv_scale=1.0)
    with pytest.raises(ValueError, match="does not match the planned kv_data_type"):
        bf = cache.to(torch.bfloat16)
        w.run(q[..., :512], q[..., 512:], bf[..., :512], bf[..., 512:], ckv_scale=1.0, kpe_scale=1.0)
    with pytest.raises(ValueError, match="insufficient or incompatible capacity"):  # reserved buffers: exact shapes
        w.plan(torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
               torch.zeros(2, dtype=torch.int32), H, 512, 64, 1, False, 0.1, q_data_type=torch.bfloat16,
               kv_data_type=torch.bfloat16)
    w2, bufs2 = _wrapper()
    _plan(w2, bufs2, [2])
    with pytest.raises(ValueError, match="only valid when kv_data_type is FP8"):
        bf = cache.to(torch.bfloat16)
        w2.run(q[..., :512], q[..., 512:], bf[..., :512], bf[..., 512:], ckv_scale=1.0, kpe_scale=1.0)


def test_forms_vllm_never_calls_are_refused_not_modelled():
    """Another backend, no graph mode, plan(metadata=) or an LSE mode, and run()'s out=, lse, per-token
    ckv_scale_arr, query= and sinks: StandInRefused (could not test), never a FlashInfer answer made up."""
    from fuzzer.support.errors import StandInRefused

    ws = torch.empty(1 << 20, dtype=torch.uint8)
    for kw in (dict(backend="fa2"), dict(use_cuda_graph=False)):
        with pytest.raises(StandInRefused):
            fi.BatchMLAPagedAttentionWrapper(ws, **kw)
    w, bufs = _wrapper()
    with pytest.raises(StandInRefused, match="lse_mode"):
        w.plan(lse_mode="base2")
    _plan(w, bufs, [2], kv_dtype=torch.float8_e4m3fn)
    cache = torch.zeros(4, 1, 576, dtype=torch.float8_e4m3fn)
    q = torch.zeros(1, H, 576, dtype=torch.bfloat16)
    args = (q[..., :512], q[..., 512:], cache[..., :512], cache[..., 512:])
    for kw in (dict(out=torch.empty(1, H, 512)), dict(return_lse=True), dict(sinks=torch.zeros(H)),
               dict(ckv_scale_arr=torch.ones(4, 1, 4))):
        with pytest.raises(StandInRefused, match=next(iter(kw)) if "return_lse" not in kw else "return_lse"):
            w.run(*args, ckv_scale=1.0, kpe_scale=1.0, **kw)
    with pytest.raises(StandInRefused):
        w.run(*args, None, torch.empty(1, H), True, ckv_scale=1.0, kpe_scale=1.0)  # out, lse, return_lse positional
    assert w.run(*args, ckv_scale=1.0, kpe_scale=1.0).shape == (1, H, 512)  # vLLM's form still runs


def test_vllm_detects_the_sm90_api_and_flashinfer_is_importable_only_inside_the_block():
    """vllm.utils.flashinfer.has_flashinfer_sm90_nope_mla looks for a keyword-only `ckv_scale_arr` in run()."""
    params = inspect.signature(fi.BatchMLAPagedAttentionWrapper.run).parameters
    assert params["ckv_scale_arr"].kind is inspect.Parameter.KEYWORD_ONLY
    assert importlib.util.find_spec("flashinfer") is None
    with fi.importable():
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        assert BatchMLAPagedAttentionWrapper is fi.BatchMLAPagedAttentionWrapper
    assert importlib.util.find_spec("flashinfer") is None


def test_an_emulated_graph_replays_the_launch_it_captured():
    """A captured launch keeps its grid: replayed after a plan of another cluster size (128 heads, 12 then 4 of 8
    rows: clusters of 2, then of 1), the capture's grid runs half the new plan's clusters; rows stay unwritten."""
    w, bufs = _wrapper(max_tokens=8)
    cache = torch.randn(64, 1, 576).bfloat16()
    bufs["kv_indices"].random_(0, 64)
    static_q = torch.randn(8, 128, 576).bfloat16()

    def forward(metadata):
        return {"out": w.run(static_q[..., :512], static_q[..., 512:], cache[..., :512], cache[..., 512:])}

    _plan(w, bufs, [16] * 8, heads=128)
    graph = cudagraphs.FullGraph(forward, lambda: None, "cpu")
    assert w._plan_info[0] == 2
    _plan(w, bufs, [16] * 4, heads=128)  # the step's plan: 4 real tokens, clusters of 1
    assert w._plan_info[0] == 1
    replayed, eager = graph.replay()["out"], forward(None)["out"]
    assert torch.isfinite(eager[:4]).all() and not torch.isfinite(replayed[:4]).all()


def test_flashinfer_itself_runs_only_on_a_gpu_host_that_has_it_and_passes_vllm_s_gate(monkeypatch):
    """The target takes FlashInfer's own wrapper where `flashinfer.mla` imports on a GPU host and vLLM's gate passes;
    the stand-in everywhere else, and wherever ATTNFUZZ_STANDIN_OPS=1."""
    import sys
    import types

    from fuzzer.support import flashinfer_runtime as rt

    top, mla = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.mla")
    top.__version__, mla.BatchMLAPagedAttentionWrapper = "0.7.2.post1", object
    top.mla = mla
    monkeypatch.setitem(sys.modules, "flashinfer", top)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    monkeypatch.setattr(rt, "vllm_gate", lambda: True)
    monkeypatch.delenv("ATTNFUZZ_STANDIN_OPS", raising=False)
    rt.real_flashinfer.cache_clear()
    try:
        assert rt.real_flashinfer("cuda") == "0.7.2.post1" and rt.real_flashinfer("cpu") is None
        assert "0.7.2.post1" in rt.flashinfer_part("cuda")
        rt.real_flashinfer.cache_clear()
        monkeypatch.setattr(rt, "vllm_gate", lambda: False)  # too old for vLLM: the stand-in
        assert rt.real_flashinfer("cuda") is None
        rt.real_flashinfer.cache_clear()
        monkeypatch.setattr(rt, "vllm_gate", lambda: True)
        monkeypatch.setenv("ATTNFUZZ_STANDIN_OPS", "1")
        assert rt.real_flashinfer("cuda") is None
    finally:
        rt.real_flashinfer.cache_clear()
