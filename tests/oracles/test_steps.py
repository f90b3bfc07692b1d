"""The `graph` check (oracles/steps.py): a replayed step against the same step run eagerly, bit for bit, except the
tokens whose top-k rows the two runs left as the same ids in another order (vLLM's top-k kernels promise no order)."""

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


def test_other_ids_are_compared():
    """A replay that read a stale length or query selects other ids: its rows stay compared."""
    eager = observed(None, None).outputs["out"].clone()
    eager[1] += 1
    other = TOPK.clone()
    other[1] = torch.tensor([0, 1, 2, -1])
    (v,) = graph_verdicts(observed(eager, other))
    assert not v.ok and "first row 1" in v.detail, v
