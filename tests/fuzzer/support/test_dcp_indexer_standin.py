"""The stand-ins of the indexer's DCP top-k merge (fuzzer/support/standins/dcp_indexer.py) against the merge's contract,
written here: each rank's local top-k packed as (score, global id) through the interleaved ownership, every rank's
candidates side by side, the stable top-k of them is the top-k of the whole row (a higher score first, among equal
scores the smaller id), -1 after the row's candidates; the kernels' refusals and out-of-bounds reads."""

import pytest
import torch

from fuzzer.support.interp.sanitizer import SANITIZER
from fuzzer.support.standins import dcp_indexer as merge
from tests.fuzzer.support.sanitized import violations  # noqa: F401  (a fixture)

K = 512


def owner_local(pos: torch.Tensor, n: int, inter: int):
    return (pos // inter) % n, (pos // (n * inter)) * inter + pos % inter


def merged(scores: torch.Tensor, lengths: list[int], n: int, inter: int, k: int = K) -> torch.Tensor:
    """What every rank's merge leaves: each rank scores its shard (local positions), takes its local top-k (as the
    indexer's top-k kernels do: positions in its shard, -1 after), packs them, the ranks' candidates are all-gathered
    (concatenated along dim 1) and the stable top-k picks the global ids."""
    rows = scores.shape[0]
    packs = []
    for r in range(n):
        width = max(max(lengths), 1)
        logits = torch.full((rows, width), float("-inf"))
        local_topk = torch.full((rows, k), -1, dtype=torch.int32)
        for i, length in enumerate(lengths):
            pos = torch.arange(length)
            own, local = owner_local(pos, n, inter)
            mine = own == r
            logits[i, local[mine]] = scores[i, pos[mine]]
            count = int(mine.sum())
            if count:
                # ties by the lower local position (a lower global id): as the merge's own rule, so the rows' top-k
                # below is exact (vLLM's local kernels break ties either way; the oracle lets them)
                best = torch.sort(-logits[i, :count], stable=True).indices[:k]
                local_topk[i, : best.numel()] = best.to(torch.int32)
        packed = torch.empty(rows, k, 2)
        merge.pack_dcp_topk_candidates_cutedsl(logits, local_topk, packed, r, n, inter, None)
        packs.append(packed)
    out = torch.full((rows, k), 7, dtype=torch.int32)
    merge.stable_topk_from_gathered_candidates_cutedsl(torch.cat(packs, dim=1), k, out=out)
    return out


@pytest.mark.parametrize("n,inter", [(2, 1), (4, 1), (2, 16), (8, 4)])
def test_the_merge_is_the_rows_top_k(n, inter, violations):
    g = torch.Generator().manual_seed(n * 100 + inter)
    lengths = [900, 300, 1500]
    scores = torch.randn(3, 1500, generator=g)
    scores[2, 100:400] = 0.25  # ties at the cut: the smaller ids win
    out = merged(scores, lengths, n, inter)
    assert SANITIZER.violations[violations:] == []
    for i, length in enumerate(lengths):
        row = out[i]
        want = min(length, K)
        assert bool((row[:want] >= 0).all()) and bool((row[want:] == -1).all())
        s = scores[i, :length]
        # the global order: score descending, then id ascending
        order = sorted(range(length), key=lambda p: (-float(s[p]), p))[:want]
        assert sorted(row[:want].tolist()) == sorted(order)
        assert row[:want].tolist() == order  # the stand-in writes them highest key first


def test_a_short_row_is_its_whole_window_then_minus_one(violations):
    scores = torch.randn(1, 40, generator=torch.Generator().manual_seed(1))
    out = merged(scores, [40], 2, 1)
    assert sorted(out[0, :40].tolist()) == list(range(40)) and bool((out[0, 40:] == -1).all())


def test_pack_reads_only_valid_entries_and_bounds_checks_the_rest(violations):
    logits = torch.randn(2, 64)
    local = torch.full((3, K), -1, dtype=torch.int32)  # one more row than the logits hold
    local[:, :3] = torch.tensor([0, 5, 63], dtype=torch.int32)
    local[0, 3] = 100  # past the row: clamped to its last column, as the kernel does
    packed = torch.empty(3, K, 2)
    merge.pack_dcp_topk_candidates_cutedsl(logits, local, packed, 1, 2, 1, None)
    assert packed[0, :4, 0].tolist() == [float(logits[0, c]) for c in (0, 5, 63, 63)]
    assert packed[0, :4, 1].tolist() == [1.0, 11.0, 127.0, 201.0]  # (local // 1) * 2 + rank 1
    assert bool(torch.isneginf(packed[0, 4:, 0]).all()) and bool((packed[0, 4:, 1] == -1).all())
    bad = SANITIZER.violations[violations:]
    assert bad and bad[0].argument == "logits" and bad[0].op == "load"  # row 2 reads past the logits


def test_the_candidate_count_must_be_a_multiple_of_512():
    with pytest.raises(RuntimeError, match="multiple of 512"):
        merge.stable_topk_from_gathered_candidates_cutedsl(torch.zeros(1, 768, 2), 512)


def _candidates(world: int, rows: int, seed: int = 0) -> torch.Tensor:
    """Rank-major [world, rows, K, 2] fp32 candidates: scores with ties, distinct ids, some padding (-inf, -1)."""
    g = torch.Generator().manual_seed(seed)
    score = torch.randint(-8, 8, (world, rows, K), generator=g).float() / 4
    ids = torch.randperm(world * rows * K, generator=g).view(world, rows, K).float()
    pad = torch.rand(world, rows, K, generator=g) < 0.1
    return torch.stack([score.masked_fill(pad, float("-inf")), ids.masked_fill(pad, -1.0)], dim=-1)


def test_rank_major_candidates_select_as_the_side_by_side_form():
    """0.34 reads [world, rows, topk, 2] in place; with 32-bit fields it selects what 0.33's [rows, world * topk, 2]
    selects."""
    gathered = _candidates(2, 3)
    side_by_side = gathered.permute(1, 0, 2, 3).reshape(3, 2 * K, 2).contiguous()
    assert torch.equal(merge.stable_topk_from_gathered_candidates_cutedsl(gathered, K),
                       merge.stable_topk_from_gathered_candidates_cutedsl(side_by_side, K))


def test_narrow_keys_rank_the_high_score_bits_and_decode_ids_from_the_key():
    """score_bits 16: scores equal in their high half tie, and the smaller id wins; id_bits: the id decoded from the
    key keeps its low bits only (an id past them aliases)."""
    gathered = torch.full((1, 1, K, 2), -1.0)
    a, b = 1.0, torch.tensor(1.0).view(torch.int32).add(1).view(torch.float32).item()  # same high 16 bits, b > a
    gathered[0, 0, :2] = torch.tensor([[a, 7.0], [b, 9.0]])
    wide = merge.stable_topk_from_gathered_candidates_cutedsl(gathered, K)
    narrow = merge.stable_topk_from_gathered_candidates_cutedsl(gathered, K, score_bits=16)
    assert wide[0, :3].tolist() == [9, 7, -1] and narrow[0, :3].tolist() == [7, 9, -1]
    gathered[0, 0, 0] = torch.tensor([a, 1024.0 + 7])
    assert merge.stable_topk_from_gathered_candidates_cutedsl(gathered, K, id_bits=10)[0, :2].tolist() == [9, 7]


def test_rank_major_form_keeps_vllms_asserts():
    with pytest.raises(AssertionError, match="Expected \\[world_size, rows, 512, 2\\]"):
        merge.stable_topk_from_gathered_candidates_cutedsl(torch.zeros(2, 1, 256, 2), K)


def test_the_key_widths_are_vllms_own_where_the_release_has_them():
    vllm = pytest.importorskip("vllm")
    module = merge.standin_module()
    if not hasattr(module, "dcp_topk_id_bits"):
        pytest.skip(f"vLLM {vllm.__version__} keys whole 32-bit fields (no dcp_topk_id_bits)")
    assert module.dcp_topk_id_bits.__code__.co_filename.endswith("dcp_indexer_cutedsl.py")
    assert (module.dcp_topk_score_bits(torch.bfloat16), module.dcp_topk_score_bits(torch.float32)) == (16, 32)
    assert module.dcp_topk_id_bits(8192) == 13
