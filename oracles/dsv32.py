"""The oracle of DeepSeek-V3.2 / GLM-5's attention module (`vllm.dsv32.attention`): its indexer feeding its sparse MLA,
judged stage by stage from what the target recorded of one step (the top-k buffer, the index cache, each layer's
output and the route vLLM gave the tokens).
  * the indexer, as `vllm.indexer` is judged (oracles/indexer.py); where every token took dense MHA the op leaves
    the step's rows as it found them (vLLM's short-prefill skip), so its rows are judged only where it scored them;
  * route (F): a dense-MHA token attends its whole causal window, which is the sparse result only where the window
    fits the top-k; a forward_mqa token reads the row the indexer made, which is never all -1 (its window holds
    its own position): an unscored row means the indexer and the MLA layer disagree on the token's route;
  * attention, layer by layer (the indexer's, then a skip_topk layer reusing its top-k): the output after W_UV
    against the dense fp32 reference (oracles/attention_judge.py) over the rows the indexer left in the buffer (a
    dense-MHA token's unscored row: its causal window); CUDA-graph padding tokens' output rows finite.
Under DCP (`vllm.dsv32.attention.dcp`, `judge_dsv32_dcp`) the same checks judge every rank's step as the undivided
module, plus every rank's merged top-k alike; a quantized MLA cache is judged by the entries read back.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from oracles.attention_judge import (
    _call_verdicts,
    _output_verdicts,
    judge_cache_entries,
    layer_reference_for,
    layer_tolerance,
    padded_row_verdicts,
)
from oracles.dcp import after_zero_length_entry, undivided
from oracles.indexer import judge_indexer
from oracles.verdict import Verdict, passed
from strategies.indexer_tensors import attention_view
from strategies.tensors import materialize_layer_inputs

LAYER_OUTPUTS = ("out", "out_skip_topk")  # layer 0 (the indexer's), layer 1 (skip_topk)


def judge_dsv32(case, obs) -> list[Verdict]:
    verdicts, go_on = _call_verdicts(obs)
    n, mha = case.num_tokens, int(obs.notes.get("route", {}).get("mha_tokens", 0))
    if not go_on:  # the routes vLLM gave before it raised still say whether a token left for dense MHA too wide
        view = attention_view(case)
        return verdicts + wide_mha_verdicts(view, token_positions(view), n - min(mha, n), "")
    o = obs.outputs
    buffer = o["topk_indices_buffer"]
    unscored = bool((buffer[:n] == -1).all()) if n else False
    verdicts += judge_indexer(case, obs, rows_scored=not (mha == n and unscored))
    for layer, name in enumerate(LAYER_OUTPUTS):
        if name in o:
            verdicts += layer_verdicts(case, obs, layer, name, mha)
    return verdicts


def token_positions(case) -> torch.Tensor:
    return torch.cat([torch.arange(r.context_len, r.seq_len) for r in case.requests] or [torch.zeros(0, dtype=torch.long)])


def wide_mha_verdicts(view, pos: torch.Tensor, first_mha: int, label: str, mha_rows=None) -> list[Verdict]:
    """Tokens first_mha.. (or those `mha_rows` marks) took dense MHA: each attends its whole causal window, the sparse
    result only if it fits."""
    width = view.topk_width
    took = torch.arange(len(pos), device=pos.device) >= first_mha if mha_rows is None else mha_rows.to(pos.device)
    wide = (took & (pos + 1 > width)).nonzero().flatten()
    if not len(wide):
        return []
    t = int(wide[0])
    return [Verdict("route", False, f"{label}{len(wide)} tokens took dense MHA over causal windows wider than the top-k "
                    f"({width}); first: token {t} at position {int(pos[t])} attends {int(pos[t]) + 1} positions where "
                    f"the indexer selects {width}", "F", where="route.mha")]


def layer_verdicts(case, obs, layer: int, name: str, mha: int, view=None) -> list[Verdict]:
    """One layer's route and output, with the top-k rows the indexer left in the buffer. `view`: the layer's
    attention case (default: `attention_view(case, layer)`); a quantized MLA cache is judged by what its bytes hold
    (`<name>.cache_slots` / `<name>.cache_entries`: the entries the layer's writes left, read back). The dense-MHA
    tokens are the last `mha`, or those the outputs name (`mha_rows`, bool [T], with `mha_own_from`: under PCP each
    rank decides for its own rows, and a chunk's earlier positions come from the cache)."""
    dev = obs.device
    view = attention_view(case, layer) if view is None else view
    n, width = view.num_tokens, view.topk_width
    mha_rows, own_from = obs.outputs.get("mha_rows"), obs.outputs.get("mha_own_from")
    took = (torch.arange(n, device=dev) >= n - mha) if mha_rows is None else mha_rows[:n].to(dev)
    rows = obs.outputs["topk_indices_buffer"][:n].to(dev).clone()
    pos = token_positions(view).to(dev)
    label = "" if layer == 0 else "skip_topk layer: "
    verdicts = wide_mha_verdicts(view, pos, 0, label, took)
    empty = (~took & (rows == -1).all(dim=1)).nonzero().flatten()
    if len(empty):
        t = int(empty[0])
        verdicts.append(Verdict("route", False, f"{label}{len(empty)} of {int((~took).sum())} tokens took forward_mqa "
                                f"with top-k rows the indexer left unscored (all -1); first: token {t} at position "
                                f"{int(pos[t])}", "F", where="route.mqa"))
    # A dense-MHA token's unscored row: the causal window it attends (the sparse result where it fits the top-k).
    col = torch.arange(width, device=dev)
    window = torch.where(col[None, :] <= pos[:, None], col[None, :], -1).to(rows.dtype)

    def attending(rows):  # the layer's inputs with these top-k rows
        rows = torch.where((took & (rows == -1).all(dim=1))[:, None], window, rows)
        index = dataclasses.replace(li.attention.index, topk_indices=rows)
        return dataclasses.replace(li, attention=dataclasses.replace(li.attention, index=index))

    li = materialize_layer_inputs(view, dev)
    li = attending(rows)
    slot_values = None
    if f"{name}.cache_entries" in obs.outputs:
        slot_values, wrong = judge_cache_entries(view, li.attention, obs.outputs[f"{name}.cache_slots"],
                                                 obs.outputs[f"{name}.cache_entries"])
        if wrong is not None:
            verdicts.append(dataclasses.replace(wrong, detail=label + wrong.detail) if layer else wrong)
    def reference(li):
        return (layer_reference_for(view, li, dev, slot_values, mha) if mha_rows is None else
                layer_reference_for(view, li, dev, slot_values, mha_rows=took, own_from=own_from))

    out_ref, valid_rows = reference(li)
    # Under PCP the TP ranks of a token run its top-k each (over the whole gathered context, for their own heads): a
    # tie chosen otherwise is theirs to choose, so each rank's heads are judged with the rows that rank picked.
    by_tp = obs.outputs.get("topk_by_tp")  # [TP, rows, width]
    for t, picked in enumerate(() if by_tp is None else by_tp):
        picked = picked[:n].to(dev)
        if not torch.equal(picked, obs.outputs["topk_indices_buffer"][:n].to(dev)):
            heads = slice(t * out_ref.shape[1] // len(by_tp), (t + 1) * out_ref.shape[1] // len(by_tp))
            out_t, valid_t = reference(attending(picked))
            out_ref[:, heads], valid_rows = out_t[:, heads], valid_rows & valid_t
    atol, rtol = layer_tolerance(view, li)
    out = obs.outputs[name].to(dev).float()
    if out.numel() != out_ref.numel():
        return verdicts + [Verdict("output", False, f"{label}output shape {tuple(out.shape)}, expected "
                                   f"{tuple(out_ref.shape)}", "J", where=f"{name}.shape")]
    found, margin = _output_verdicts(out.view(out_ref.shape), out_ref, valid_rows, atol, rtol)
    found += padded_row_verdicts(view, SimpleNamespace(outputs={"out_padded": obs.outputs.get(name + "_padded")}))
    if layer:
        found = [dataclasses.replace(v, detail=label + v.detail, where=f"skip_topk.{v.where}") for v in found]
    verdicts += found
    if not [v for v in verdicts if not v.ok]:
        verdicts.append(passed("output", f"{label}{n} tokens within tolerance ({mha} on dense MHA)", margin=margin))
    return verdicts


# -- under decode context parallelism (`vllm.dsv32.attention.dcp`) -------------------------------------------------

def undivided_trace(case, heads: bool):
    """The trace as one rank holding the whole context, step by step (`oracles.dcp.undivided`: blocks of
    block_size x DCP size, the same table); `heads`: every rank's heads too (an attention view), else the heads
    as they are (the indexer's, which every rank holds whole)."""

    def one(step):
        whole = undivided(step)
        return whole if heads else dataclasses.replace(whole, heads=step.heads)

    return dataclasses.replace(one(case), earlier=tuple(one(e) for e in case.earlier))


def _topk_verdict(whole, obs, rows: torch.Tensor, wrong_rows: list[int] | None = None) -> list[Verdict]:
    """The indexer's `topk` verdict on these rows in place of the buffer's."""
    outputs = {**obs.outputs, "topk_indices_buffer": rows}
    return [v for v in judge_indexer(whole, SimpleNamespace(outputs=outputs, error_type=None), wrong_rows=wrong_rows)
            if v.check == "topk"]


def known_pattern(case, verdicts: list[Verdict], wrong_rows: list[int]) -> list[Verdict]:
    """A failed `topk` whose every wrong row comes right after an entry with no keys on some DCP rank, named as that
    vLLM 0.33.0 bug (`topk:topk:after_zero_length`): a signature of its own, so that knowing it masks no other
    top-k finding."""
    if not wrong_rows or not all(after_zero_length_entry(case, r) for r in wrong_rows):
        return verdicts
    return [dataclasses.replace(v, where="topk:after_zero_length", detail=v.detail + "; every wrong row is the first "
                                "after a request with no keys on some DCP rank (DeepGEMM's SM90 paged logits score "
                                "it with that request's query: docs/bug-reports/vllm-0.33.0-deepgemm-sm90-paged-"
                                "logits-zero-length-request.md)")
            if v.check == "topk" and not v.ok else v for v in verdicts]


def _other_rank_rows(whole, obs) -> str:
    """The differing rows as the other rank holds them, judged as the indexer's: whether both ranks picked a top-k,
    so that they chose differently only among scores equal within the kernels' rounding (a choice the top-k kernels
    leave unspecified, which ranks that each run the top-k cannot rely on)."""
    if "dcp_topk_other" not in obs.outputs:
        return ""
    found = _topk_verdict(whole, obs, obs.outputs["dcp_topk_other"])
    if found and found[0].ok:
        return ("; both ranks' rows are a top-k of the same scores: they chose differently among scores tied within "
                "the kernels' rounding, which the top-k kernels leave unspecified")
    return f"; the other rank's rows, judged alone: {found[0].detail if found else 'not judged'}"


def judge_dsv32_dcp(case, obs) -> list[Verdict]:
    """A step of the module under DCP, every rank's: judged as the undivided module would be (`judge_dsv32`'s
    checks over the whole context). The indexer's merged top-k (rank 0's buffer) from the index cache's bytes as
    the ranks wrote them, put back in undivided slots; each layer's output, every rank's heads in rank order,
    against the reference over the undivided context with every rank's heads, from the fp8_ds_mla entries the
    ranks wrote; `dcp_topk` (G): every rank of a DCP group holds the same rows (they attend over shards of one
    selection); under PCP each TP rank's own rows (`topk_by_tp`) judged as a top-k too. A wrong output under DCP points at the split and merge (class G) unless another check names a class."""
    whole = undivided_trace(case, heads=False)
    verdicts, go_on = _call_verdicts(obs)
    n, mha = whole.num_tokens, int(obs.notes.get("route", {}).get("mha_tokens", 0))
    if not go_on:
        view = undivided_trace(attention_view(case), heads=True)
        return verdicts + wide_mha_verdicts(view, token_positions(view), n - min(mha, n), "")
    o = obs.outputs
    if (differ := o.get("dcp_topk_rows_differ")) is not None and len(differ):
        verdicts.append(Verdict("dcp_topk", False, f"{len(differ)} of the step's {whole.num_actual_tokens} top-k rows "
                                f"differ between ranks after the global merge (first row {int(differ[0])}): the ranks "
                                f"attend over different selections{_other_rank_rows(whole, obs)}", "G",
                                where="dcp_topk"))
    unscored = bool((o["topk_indices_buffer"][:n] == -1).all()) if n else False
    wrong: list[int] = []
    verdicts += known_pattern(case, judge_indexer(whole, obs, not (mha == n and unscored), wrong), wrong)
    for t, rows in enumerate(() if o.get("topk_by_tp") is None else o["topk_by_tp"]):  # TP peers' own rows (PCP)
        if not torch.equal(rows[:n], o["topk_indices_buffer"][:n]):
            wrong = []
            verdicts += [dataclasses.replace(v, detail=f"TP rank {t}'s rows: {v.detail}", where=f"tp{t}.{v.where}")
                         for v in known_pattern(case, _topk_verdict(whole, obs, rows, wrong), wrong) if not v.ok]
    for layer, name in enumerate(LAYER_OUTPUTS):
        if (differ := o.get(f"{name}.replica_slots_differ")) is not None and len(differ):
            label = "skip_topk layer: " if layer else ""
            verdicts.append(Verdict("cp_replica", False, f"{label}{len(differ)} MLA cache "
                                    f"slots of the step differ between ranks that hold the same shard (first slot "
                                    f"{int(differ[0])}): a rank missed or mis-wrote another rank's tokens", "G",
                                    where=f"{name}.cp_replica"))
        if name in o:
            view = undivided_trace(attention_view(case, layer), heads=True)
            verdicts += layer_verdicts(whole, obs, layer, name, mha, view)
    return [dataclasses.replace(v, bug_class=v.bug_class or "G")
            if not v.ok and v.check in ("output", "nan") else v for v in verdicts]
