"""The checks a reproducer runs, as functions `fuzzer.artifacts.repro` copies verbatim into repro.py.

Each returns the problems it sees, in words (an empty list: no bug). They use torch only, and only what
they are passed: the script calls the one its finding names (`ReproSpec.judge`) after vLLM's call returned
(`judge_index_contract` also when it raised: for that call a clear error is the right answer).
"""

from __future__ import annotations

import torch


def judge_index(out, valid_counts, expected, compacted):
    """Row by row against the documented remap; with compaction only the valid set matters."""
    problems = []
    out, exp = out.cpu().tolist(), expected.tolist()
    for r, (o, e) in enumerate(zip(out, exp)):
        want = sorted(x for x in e if x >= 0)
        if valid_counts is not None and int(valid_counts[r]) != len(want):
            problems.append(f"row {r}: valid count {int(valid_counts[r])}, expected {len(want)}")
        elif compacted and (sorted(o[: len(want)]) != want or any(x != -1 for x in o[len(want):])):
            problems.append(f"row {r}: valid prefix {sorted(o[: len(want)])[:8]}..., expected {want[:8]}...")
        elif not compacted and o != e:
            j = next(j for j in range(len(e)) if o[j] != e[j])
            problems.append(f"row {r}: out[{r}, {j}] = {o[j]}, expected {e[j]} (topk_indices[{r}, {j}])")
    return problems


def judge_index_contract(error, req_id_per_token, topk_indices):
    """req_id_per_token and topk_indices cover different tokens: the only right answer is a clear error."""
    if error is not None:
        return []
    return [f"accepted req_id_per_token of {req_id_per_token.shape[0]} rows with topk_indices "
            f"of {topk_indices.shape[0]} rows (the grid follows req_id, the output topk_indices)"]


def compare_to_reference(out, expected, atol, rtol, what="output", heads=None):
    """Problems of `out` against attnfuzz's fp32 reference: |out - ref| <= atol + rtol |ref| per element, and
    finite where the reference is. `heads`: heads per rank (a DCP step's merged output), named in each problem."""
    problems, rank = [], (lambda h: "") if heads is None else (lambda h: f" (rank {h // heads}'s heads)")
    bad = ~torch.isfinite(out)
    if bad.any():
        t, h, _ = bad.nonzero()[0].tolist()
        problems.append(f"{int(bad.sum())} non-finite outputs, first token {t} head {h}{rank(h)}; the fp32 reference is finite")
    err = ((out - expected).abs() / (atol + rtol * expected.abs())).nan_to_num(0)
    if err.max() > 1:
        t, h, d = (err == err.max()).nonzero()[0].tolist()
        problems.append(f"{what} off by {err.max():.2f}x the tolerance at token {t} head {h}{rank(h)} dim {d}: "
                        f"{out[t, h, d]:.4g} vs fp32 reference {expected[t, h, d]:.4g}")
    return problems


def judge_attention(out, expected, cache, before, atol, rtol):
    """The output against attnfuzz's fp32 reference, the rows of padding tokens finite, and the paged cache byte for byte against its copy from
    before the call (attention must not write it)."""
    problems, expected = [], expected.float().cpu()
    padded = out[expected.shape[0]:]  # CUDA-graph padding tokens: no reference, but the next layers read them
    bad = ~torch.isfinite(padded.float()).flatten(1).all(dim=1)
    if bool(bad.any()):
        problems.append(f"{int(bad.sum())} of {padded.shape[0]} padding tokens' output rows hold NaN or Inf "
                        f"(first: row {expected.shape[0] + int(bad.nonzero()[0])})")
    out = out[: expected.shape[0]]
    if out.numel() != expected.numel():
        problems.append(f"output has shape {tuple(out.shape)}; expected {tuple(expected.shape)} (the heads of this rank)")
        out = expected  # nothing more to compare
    problems += compare_to_reference(out.float().cpu().view(expected.shape), expected, atol, rtol)
    if not torch.equal(cache.view(torch.uint8), before.view(torch.uint8)):
        problems.append("the KV cache changed during attention")
    return problems


def judge_dcp(out, expected, lses, expected_lses, heads, atol, rtol, lse_tol):
    """The merged heads (rank r holds `heads` of them, in rank order) against the fp32 reference over the
    undivided context; each rank's LSE against the reference over that rank's share (-inf where it holds none
    of a row's selected tokens: the merge's identity)."""
    problems = compare_to_reference(out.float().cpu(), expected.float().cpu(), atol, rtol, "merged output", heads)
    for r, lse in sorted(lses.items()):
        want, lse = expected_lses[r].float().cpu(), lse.float().cpu()
        empty = torch.isneginf(want).all(dim=1)  # rows where rank r holds none of the selected tokens
        if empty.any() and not torch.isneginf(lse[empty]).all():
            problems.append(f"rank {r} holds none of some rows' selected tokens but returns LSE "
                            f"{lse[empty].max():.4g} there, not -inf (the merge's identity)")
            continue
        both = torch.isfinite(want)
        lerr = ((lse - want).abs() / (lse_tol + lse_tol * want.abs()))[both]
        if lerr.numel() and lerr.max() > 1:
            problems.append(f"rank {r}: LSE over its share off by {lerr.max():.2f}x the tolerance")
    return problems


def judge_dsv4(out, expected, metadata, expected_metadata, caches, before, atol, rtol):
    """A DeepSeek-V4 step: each metadata tensor the builders made exactly against its definition (C128A top-k rows
    may be any multiple of 128 wide that holds every visible entry, -1 past them: the builder picks the width); the
    step's tokens and heads against attnfuzz's reference (fp64, saved in fp32); padding tokens' rows left NaN (as
    the output was filled) or 0; each cache byte for byte as before the call (attention only reads them)."""
    problems = []
    for name, want in expected_metadata.items():
        got = metadata.get(name)
        if got is None:
            problems.append(f"metadata {name}: the builders gave none, expected shape {tuple(want.shape)}")
            continue
        got, want = got.cpu().long(), want.cpu().long()
        if "c128a" in name and name.endswith("indices") and got.shape[:-1] == want.shape[:-1]:
            if got.shape[-1] % 128 or got.shape[-1] < want.shape[-1]:
                problems.append(f"metadata {name}: rows {got.shape[-1]} wide; the kernels take a multiple of 128 "
                                f"holding every visible compressed entry ({want.shape[-1]})")
                continue
            want = torch.nn.functional.pad(want, (0, got.shape[-1] - want.shape[-1]), value=-1)
        if got.shape != want.shape:
            problems.append(f"metadata {name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
            continue
        differs = got != want
        bad = (differs.flatten(1).any(dim=1) if differs.dim() > 1 else differs).nonzero().flatten()
        if len(bad):
            row = int(bad[0])
            g, w = got[row].flatten(), want[row].flatten()
            col = int((g != w).nonzero()[0])
            problems.append(f"metadata {name}: {len(bad)} of {len(got)} rows differ from the definition; row {row} "
                            f"[{col}] is {g[col].item()}, expected {w[col].item()}")
    tokens, heads, width = expected.shape
    if out.shape[0] < tokens or out.shape[1] < heads or out.shape[2] != width:
        problems.append(f"output has shape {tuple(out.shape)}; expected [>= {tokens}, >= {heads}, {width}]")
    else:  # vLLM pads q to 64 or 128 heads; the model drops the padded heads' output
        problems += compare_to_reference(out[:tokens, :heads].float().cpu(), expected.float().cpu(), atol, rtol)
        pad = out[tokens:].float().cpu()
        touched = ~torch.isnan(pad) & (pad != 0)
        if touched.any():
            problems.append(f"padding token {tokens + int(touched.nonzero()[0][0])} (slot -1, no request) got "
                            f"output: it selects no key, so its row stays as it was or is 0")
    for name, now, was in zip(("SWA", "compressed"), caches, before):
        if was is not None and not torch.equal(now, was):
            problems.append(f"the {name} cache changed during attention: "
                            f"{int((now != was).flatten(1).any(dim=1).sum())} of {len(was)} pages")
    return problems


# What a script copies for each judge: helpers first.
FUNCTIONS = {"index": (judge_index,), "index_contract": (judge_index_contract,),
             "attention": (compare_to_reference, judge_attention), "dcp": (compare_to_reference, judge_dcp),
             "dsv4": (compare_to_reference, judge_dsv4)}
