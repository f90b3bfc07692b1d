"""The `graph` check (oracles/steps.py): a replayed step against the same step run eagerly, bit for bit, on the tokens
whose top-k rows the two runs left as the same ids in the same order (vLLM's top-k kernels promise no order and may
break a tie at the k-th score either way; the replay's own top-k is judged by the step's judge)."""

import torch

from fuzzer.observation import Observation
from oracles.steps import graph_verdicts

TOPK = torch.tensor([[3, 1, 2, 0], [0, 1, -1, -1], [5, 4, 3, 2]], dtype=torch.int32)


def observed(out_eager, topk_eager):
    out = torch.arange(12, dtype=torch.bfloat16).view(3, 4)
    return Observation("t", "cpu", outputs={"out": out, "out_eager": out_eager, "topk_indices_buffer": TOPK,
                                            "topk_eager": topk_eager})


def test_a_row_whose_topk_came_in_another_order_is_not_compared():
    eager = observed(None, None).outputs["out"].clone()
    eager[0] += 1
    reordered = TOPK.clone()
    reordered[0] = torch.tensor([0, 1, 2, 3])
    (v,) = graph_verdicts(observed(eager, reordered))
    assert v.ok and "1 of 3 rows not compared" in v.detail, v


def test_other_bits_on_the_same_topk_rows_are_class_m():
    eager = observed(None, None).outputs["out"].clone()
    eager[2] += 1
    (v,) = graph_verdicts(observed(eager, TOPK.clone()))
    assert not v.ok and v.bug_class == "M" and "1 of 3 rows (first row 2)" in v.detail, v


def test_another_selection_is_left_to_the_topk_check_and_named():
    """On an H100 the replay and the eager run of a 2,048-wide indexer step differed in rows whose ids differed: a
    tie at the k-th score may go either way. Those rows are named, not compared; the replay's top-k is judged
    against the reference as a set (judge_indexer), which a stale length or query fails."""
    eager = observed(None, None).outputs["out"].clone()
    eager[1] += 1
    eager[0] += 1
    other, reordered = TOPK.clone(), TOPK.clone()
    other[1] = torch.tensor([0, 1, 2, -1])
    other[0] = torch.tensor([0, 1, 2, 3])
    (v,) = graph_verdicts(observed(eager, other))
    assert v.ok and "2 of 3 rows not compared: 1 with their top-k ids in another order; 1 with another top-k " \
        "selection" in v.detail, v
