"""`vllm.flashattn_sparse` (FLASH_ATTN_MLA_SPARSE) and its FA3 stand-in; MTP draft steps on metadata updated in
place (`update_draft_decode_metadata`), through the CLI."""

import json

import pytest
import torch

from fuzzer.support.interp.sanitizer import SANITIZER
from fuzzer.support.standins.flash_attn_ops import flash_attn_varlen_func
from tests.conftest import ROOT, attnfuzz, python, run_repro


def _paged(q, k, v, q_v, block_table, seqused_k):
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return flash_attn_varlen_func(q=q, k=k, v=v, q_v=q_v, max_seqlen_q=1, cu_seqlens_q=cu,
                                  max_seqlen_k=block_table.shape[1], seqused_k=seqused_k, block_table=block_table,
                                  softmax_scale=0.1, causal=True, return_softmax_lse=True)


def test_the_fa3_paged_standin_reads_each_token_s_pages_with_the_qv_score():
    """vLLM's sparse call: one query token per batch, its top-k rows as a page table of page size 1, the latent
    as q_v (score q.k + q_v.v). No key: output 0 and LSE -inf (FA3's store_zero)."""
    g = torch.Generator().manual_seed(0)
    rows, heads = 10, 4
    kv = torch.randn(rows, 1, 1, 24, generator=g)
    k, v = kv[..., 16:], kv[..., :16]
    q, q_v = torch.randn(3, heads, 8, generator=g), torch.randn(3, heads, 16, generator=g)
    table = torch.tensor([[4, 7, -1], [2, 2, 9], [-1, -1, -1]], dtype=torch.int32)
    out, lse = _paged(q, k, v, q_v, table, torch.tensor([2, 3, 0], dtype=torch.int32))
    for t, n in ((0, 2), (1, 3)):
        keys = table[t, :n].long()
        s = (q[t] @ k[keys, 0, 0].T + q_v[t] @ v[keys, 0, 0].T) * 0.1
        torch.testing.assert_close(out[t], torch.softmax(s, -1) @ v[keys, 0, 0])
        torch.testing.assert_close(lse[:, t], torch.logsumexp(s, -1))
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.isinf(lse[:, 2]).all()


def test_a_page_outside_the_cache_is_a_memory_violation():
    q, kv = torch.zeros(1, 1, 8), torch.zeros(4, 1, 1, 24)
    before = len(SANITIZER.violations)
    out = _paged(q, kv[..., 16:], kv[..., :16], torch.zeros(1, 1, 16), torch.tensor([[1, 4]], dtype=torch.int32),
                 torch.tensor([2], dtype=torch.int32))[0]
    found = SANITIZER.violations[before:]
    del SANITIZER.violations[before:]
    assert len(found) == 1 and found[0].argument == "k" and not found[0].inside_allocation
    assert torch.isfinite(out).all()  # the key it could not read is skipped, not read as garbage


def test_the_fa3_standin_refuses_a_seqused_k_of_another_batch_as_fa3_does():
    """The real FA3 (H200) refused the seed bug's full-batch counts with a token subset before launching: so must its
    stand-in, rather than read the extra counts."""
    q, kv = torch.zeros(2, 1, 8), torch.zeros(4, 1, 1, 24)
    table = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"seqused_k must have shape \(batch_size\)"):
        _paged(q, kv[..., 16:], kv[..., :16], torch.zeros(2, 1, 16), table, torch.ones(3, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="seqused_k must have dtype int32"):
        _paged(q, kv[..., 16:], kv[..., :16], torch.zeros(2, 1, 16), table, torch.ones(2, dtype=torch.int64))


def test_the_fa3_check_s_cases_run_through_the_standin():
    """bench/fa3_check.py (the stand-in against the real FA3 on the GPU host) with the stand-in on both sides."""
    done = python("bench/fa3_check.py", "--cases", "12", "--against", "standins", cwd=ROOT, timeout=300)
    assert done.returncode == 0 and "12 cases, 0 differ" in done.stdout, done.stdout + done.stderr


@pytest.mark.vllm
def test_a_draft_update_bug_is_found_by_mtp_draft_steps_and_reproduced(tmp_path):
    """The builder's in-place update for MTP draft steps, broken: found (class M, the `draft` check: the draft
    step on updated metadata against the same step on metadata built for it) by a default campaign, whose
    traces hold draft steps; its reproducer runs the draft step as the speculator does. (With single steps,
    `--max-steps 1`, nothing finds it: docs/benchmarks.md, "vLLM's compiled cache ops" (its last sentence).)"""
    r = attnfuzz("run", "--target", "vllm.flashattn_sparse", "--inject", "flashattn-draft-update-last-token",
                 "--seed", "1", "--no-shrink", "--reruns", "0", "--max-examples", "40", "--max-findings", "1",
                 "--json", str(tmp_path / "t.json"), "--repros", str(tmp_path / "repros"), state=tmp_path / "state")
    assert r.returncode == 1, r.stdout + r.stderr
    (finding, *_) = json.loads((tmp_path / "t.json").read_text())["findings"]
    assert "M" in finding["bug_classes"] and any(v["check"] == "draft" for v in finding["verdicts"])
    assert finding["emulated"][0] == "flash_attn_varlen_func"  # the CPU has no FA3: named in every result
    repro = run_repro(tmp_path / "repros" / finding["id"])
    assert repro.returncode == 1 and "update_draft_decode_metadata" in repro.stdout, repro.stdout + repro.stderr
