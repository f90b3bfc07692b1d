"""Verdicts for a DeepSeek-V4 or V4.1 attention step (vLLM's FLASHMLA_SPARSE_DSV4 / _DSV41 routes): the metadata its builders made,
checked exactly against each kernel's definition; the caches' records against the values written; and the output
against an fp64 reference of DeepSeek-V4's sparse attention built from positions, the window, the compress ratio,
the C4 top-k and the block tables, never from vLLM's metadata.

The reference, for the token at position p of request r (ratio R, window W, index_topk K):
    keys = the SWA cache's records of r's positions max(0, p - W + 1) .. p
         + C4 (V4.1: C1, C2): the compressed entries top-k[t, :min((p + 1) // R, K)] (local entry ids)
           C128: every compressed entry 0 .. (p + 1) // 128 - 1
V4.1 differs from V4 only in which layers read what: ratio 0 is the sliding-window-only layer, ratios 1 and 2 read
the indexer's top-k like C4 (ratio 1: one compressed entry per token), there is no C128A; the record on every arch
but SM100 is V4's 584 bytes (fp8_ds_mla_v4), on SM100 the interleaved 528-byte MXFP8 one (fp8_ds_mla_v41).
    out_h = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink_h}),  s_j = 512^-0.5 q_h . k_j,  K = V = the record's value
read from the cache bytes at the slots the case's own block tables give (fp8_ds_mla_v4 decodes them). Only the
case's heads are judged (vLLM pads q with zero heads to 64 or 128; the model drops their output). The ROCm layer
(`Dsv4.rocm_arch` set) hands its output on with the RoPE taken back out of its last 64 dims: the reference is
rotated back by each token's position (`gptj_rope(..., inverse=True)`) before it is compared.
"""

from __future__ import annotations

import torch

from oracles import fp8_ds_mla_v4, fp8_ds_mla_v41, nvfp4_ds_mla_v41, plain_rows
from oracles.attention import error_margin, sparse_mla_reference, tolerance
from oracles.plain_rows import PlainRows
from oracles.verdict import Verdict, passed
from strategies.case import PLAIN_FP8_RECORD
from strategies.dsv4_tensors import (  # the RoPE (theta, dims, rotation) is the case's: strategies' too
    COMPRESS_ROPE_THETA,
    ROPE_DIM,
    ROPE_THETA,
    c4_valid_count,
    compressed_slots,
    gptj_rope,
    materialize_dsv4_inputs,
    swa_slots,
    written_swa_positions,
)

SCALE = 512**-0.5
# vLLM's DeepSeek-V4 kernels: a memory fault inside one is a metadata or gather indexing bug (class N).
DSV4_KERNELS = ("swa_indices", "c128a", "C128A", "compressed_slot", "CompressedSlot", "global_topk", "GlobalTopk",
                "dequantize_and_gather", "DequantizeAndGather", "combine_topk", "CombineTopk", "prefill_metadata",
                "PrefillMetadata", "flash_mla", "SWAIndices", "sparse_mla_dsv4")


def split(case) -> tuple[int, int, int, int]:
    """(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens) as split_decodes_and_prefills gives them
    at threshold 1 + k: padding tokens go with the decodes in a decode-only batch, else with the prefills."""
    n, nd = len(case.requests), case.num_decodes
    if nd == n:
        return n, 0, case.num_actual_tokens, 0
    tokens = case.token_start(nd)
    return nd, n - nd, tokens, case.num_actual_tokens - tokens


def window(case, position: int) -> range:
    return range(max(0, position - case.dsv4.window_size + 1), position + 1)


def _tokens(case):
    """(request, position) of every token of the step, None for padding tokens."""
    out = [(i, p) for i, r in enumerate(case.requests) for p in range(r.context_len, r.seq_len)]
    return out + [None] * case.padded_tokens


def _indices_rows(rows: list[list[int]], width: int) -> torch.Tensor:
    out = torch.full((len(rows), width), -1, dtype=torch.int64)
    for t, row in enumerate(rows):
        out[t, : len(row)] = torch.tensor(row[:width], dtype=torch.int64)
    return out


def expected_metadata(case, c128a_width: int | None = None) -> dict[str, torch.Tensor]:
    """Each metadata tensor vLLM's DSv4 builders expose, from its definition. `c128a_width`: the C128A rows' width."""
    d = case.dsv4
    nd, npf, td, tp = split(case)
    tokens = _tokens(case)
    md: dict[str, torch.Tensor] = {"split": torch.tensor([nd, npf, td, tp])}
    md["token_to_req_indices"] = torch.tensor([t[0] if t else 0 for t in tokens])  # padding tokens map to 0
    md["is_valid_token"] = torch.tensor([t is not None for t in tokens])

    def swa_rows(part):
        rows = [swa_slots(case, t[0], torch.tensor(list(window(case, t[1])))).tolist() if t else [] for t in part]
        return _indices_rows(rows, d.window_size)[:, None, :], torch.tensor([len(r) for r in rows])

    if td:
        md["decode_swa_indices"], md["decode_swa_lens"] = swa_rows(tokens[:td])
    if tp:
        md["prefill_swa_indices"], md["prefill_swa_lens"] = swa_rows(tokens[td:])
        md["prefill_gather_lens"] = torch.tensor([r.query_len + min(r.context_len, d.window_size - 1)
                                                  for r in case.requests[nd:]])
    if not d.compressed:
        return md
    ratio = d.compress_ratio
    md["compressed_slot_mapping"] = torch.tensor([
        int(compressed_slots(case, t[0], torch.tensor([t[1] // ratio]))[0]) if t and (t[1] + 1) % ratio == 0 else -1
        for t in tokens])
    if ratio == 128 and c128a_width is not None:
        def visible(t):
            return min((t[1] + 1) // 128, c128a_width) if t else 0

        if td:
            rows = [compressed_slots(case, t[0], torch.arange(visible(t))).tolist() if t else [] for t in tokens[:td]]
            md["c128a_decode_indices"] = _indices_rows(rows, c128a_width)[:, None, :]
            md["c128a_decode_lens"] = torch.tensor([visible(t) for t in tokens[:td]])
        if tp:
            md["c128a_prefill_indices"] = _indices_rows([list(range(visible(t))) for t in tokens[td:]], c128a_width)
    return md


def c128a_visible(case) -> int:
    """The most compressed entries a token of the step sees at ratio 128: the C128A rows' least width."""
    return max(((p + 1) // 128 for _, p in filter(None, _tokens(case))), default=0)


def judge_metadata(case, outputs) -> list[Verdict]:
    """Every metadata tensor the target recorded (outputs "md.<name>") against its definition, exactly."""
    width = outputs["md.c128a_decode_indices"].shape[-1] if "md.c128a_decode_indices" in outputs else \
        outputs["md.c128a_prefill_indices"].shape[-1] if "md.c128a_prefill_indices" in outputs else None
    verdicts = []
    if width is not None:
        need = c128a_visible(case)
        if width % 128 or width < need:
            verdicts.append(Verdict("metadata", False, f"C128A top-k rows are {width} wide: a multiple of 128 holding "
                                                       f"every visible compressed entry ({need}) is what the kernels "
                                                       f"take", "N", where="metadata:c128a_width"))
    want = expected_metadata(case, width)
    for name, expected in want.items():
        got = outputs.get(f"md.{name}")
        if got is None:
            verdicts.append(Verdict("metadata", False, f"{name}: the builders gave none, expected {tuple(expected.shape)}",
                                    "N", where=f"metadata:{name}"))
            continue
        got = got.cpu().to(expected.dtype)
        if got.shape != expected.shape:
            verdicts.append(Verdict("metadata", False, f"{name}: shape {tuple(got.shape)}, expected "
                                                       f"{tuple(expected.shape)}", "N", where=f"metadata:{name}"))
            continue
        bad = (got != expected).reshape(len(got), -1).any(dim=1).nonzero().flatten() if got.dim() else \
            ([0] if got != expected else [])
        if len(bad):
            row = int(bad[0])
            g, e = got[row].flatten(), expected[row].flatten()
            col = int((g != e).nonzero()[0]) if g.numel() > 1 else 0
            verdicts.append(Verdict("metadata", False, f"{name}: {len(bad)} of {len(got)} rows differ from the "
                                                       f"definition; row {row} [{col}] is {g[col].item()}, "
                                                       f"expected {e[col].item()}", "N", where=f"metadata:{name}"))
    return verdicts or [passed("metadata", f"{len(want)} metadata tensors as defined")]


def _records(case, swa_pages, compressed_pages, device) -> tuple[dict, list[Verdict]]:
    """The records the reference reads, decoded from the cache bytes, per cache: {(cache, request): (slots, values)},
    and a verdict per cache whose records do not hold the values written (the writer's bytes against the format)."""
    inputs = materialize_dsv4_inputs(case, device)
    d = case.dsv4
    caches = [("swa", swa_pages, case.block_size, d.kv_record)]
    if d.compressed:
        caches.append(("compressed", compressed_pages, d.entries_per_block, d.compressed_record))
    found, verdicts = {}, []
    for name, pages, entries, record in caches:
        v4 = (PlainRows(record) if record in plain_rows.DTYPES else  # the record's own decoder
              fp8_ds_mla_v41 if record == fp8_ds_mla_v41.ENTRY else
              nvfp4_ds_mla_v41 if record == nvfp4_ds_mla_v41.ENTRY else fp8_ds_mla_v4)
        worst = None
        for i, _ in enumerate(case.requests):
            if name == "swa":
                pos = written_swa_positions(case, i)
                slots, written = swa_slots(case, i, pos), inputs.swa_values[i][pos.to(device)]
            else:
                pos = torch.arange(len(inputs.compressed_values[i]))
                slots, written = compressed_slots(case, i, pos), inputs.compressed_values[i]
            records = v4.read_records(pages.to(device), slots, entries)
            values = v4.dequantize(records)
            found[name, i] = (pos, values)
            bad = ~((values - written.float()).abs() <= v4.error_bound(written, records) + 1e-30)
            if bad.any() and worst is None:
                row, col = (int(x) for x in bad.nonzero()[0])
                worst = (f"{name} cache: request {i}'s {'position' if name == 'swa' else 'compressed entry'} "
                         f"{int(pos[row])} (slot {int(slots[row])}) reads back {values[row, col]:.4g} at element "
                         f"{col}, written {written[row, col].float():.4g}")
        if worst:
            verdicts.append(Verdict("cache_write", False, worst, "K", where=f"cache_write:{name}"))
    return found, verdicts


def reference(case, records, device: str = "cpu"):
    """(out [num_actual_tokens, heads, 512] float32, max |key|) from the decoded records; padding rows 0."""
    d, inputs = case.dsv4, materialize_dsv4_inputs(case, device)
    table, base, rows = [], 0, []
    offsets = {}
    for key, (pos, values) in records.items():
        lookup = torch.full((int(pos.max()) + 1 if len(pos) else 0,), -1, dtype=torch.long)
        lookup[pos] = torch.arange(len(pos)) + base
        offsets[key] = lookup
        table.append(values)
        base += len(pos)
    kv = torch.cat(table).to(device) if table else torch.zeros(0, 512, device=device)
    topk = inputs.topk_indices.cpu().long()
    for t, tok in enumerate(_tokens(case)):
        if tok is None:
            rows.append([])
            continue
        r, p = tok
        row = offsets["swa", r][list(window(case, p))].tolist()
        n = (p + 1) // d.compress_ratio if d.compressed else 0
        if d.indexed:
            row += offsets["compressed", r][topk[t, : c4_valid_count(p, case.topk_width, d.compress_ratio)]].tolist()
        elif d.compress_ratio == 128:
            row += offsets["compressed", r][:n].tolist()
        rows.append(row)
    indices = _indices_rows(rows, max((len(r) for r in rows), default=0) or 1).to(device)
    q = inputs.q[:, : case.heads].to(device)
    if d.kv_record == PLAIN_FP8_RECORD:  # a per-tensor fp8 cache's layer hands its kernel q in e4m3 (q_scale 1.0)
        q = q.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    q = q.double()
    if d.mega_attn:  # the mega kernel ropes q itself at each token's position
        q = gptj_rope(q, inputs.positions.to(device))
    out, lse = sparse_mla_reference(q, kv, indices, SCALE, 512)
    sink = inputs.attn_sink[: case.heads].to(device).double()
    out = out.double() * torch.sigmoid(lse.double() - sink[None]).nan_to_num(0.0)[..., None]
    if d.mega_attn or d.rocm_arch:  # both layers hand the output on with the RoPE taken back out
        out = gptj_rope(out, inputs.positions.to(device), rope_theta(case), inverse=True)
    return out.float(), float(kv.abs().max()) if kv.numel() else 1.0


def rope_theta(case) -> float:
    """The layer's RoPE base: the mega layer's harness gives it one 10000 table; the ROCm layer uses the compressed
    layers' (V4: ratio > 1; V4.1: ratio > 0), else the main one."""
    d = case.dsv4
    if d.mega_attn:
        return ROPE_THETA
    return COMPRESS_ROPE_THETA if d.compress_ratio > (0 if d.version == "4.1" else 1) else ROPE_THETA


def roped_frame(case, out: torch.Tensor, device: str = "cpu") -> torch.Tensor:
    """out [tokens, heads, 512] as FlashMLA's and FlashInfer's layers hand theirs on, the RoPE still in its last 64
    dims: where the layer (ROCm's, the mega one) took it back out, it is put back at each token's position and the
    layer's theta (float64). The frame `vllm.dsv4.all` compares its backends' outputs in."""
    d = case.dsv4
    out = out.to(device).double()
    if not (d.mega_attn or d.rocm_arch):
        return out
    positions = materialize_dsv4_inputs(case, device).positions[: out.shape[0]].to(device)
    return gptj_rope(out, positions, rope_theta(case))


def frame_tolerance(y: torch.Tensor, atol: float, rtol: float) -> torch.Tensor:
    """The elementwise tolerance around y [tokens, heads, 512] in the RoPE'd frame: atol + rtol |y| on the NoPE dims;
    on the RoPE dims sqrt(2) atol + rtol times the norm of the element's pair. Turning an output back into the frame
    (`roped_frame`) mixes each pair's errors: an error within atol + rtol |x| of each element of a pair stays, after
    any rotation, within that bound (a component is at most the pair's norm, and the norm is the rotation's
    invariant)."""
    y = y.double()
    magnitude = y.abs()
    pairs = y[..., -ROPE_DIM:].unflatten(-1, (ROPE_DIM // 2, 2)).norm(dim=-1).nan_to_num(0.0)  # a NaN: its own inf
    magnitude[..., -ROPE_DIM:] = pairs.repeat_interleave(2, dim=-1)
    scale = torch.ones_like(y)
    scale[..., -ROPE_DIM:] = 2**0.5
    return atol * scale + rtol * magnitude


def reference_for(case, swa_pages, compressed_pages, device: str = "cpu"):
    """(out [num_actual_tokens, heads, 512] float32, atol, rtol, verdicts on the records) of the step whose caches
    hold these bytes: the reference over the records they hold, and its tolerance (bf16's, atol scaled by the
    largest key)."""
    records, verdicts = _records(case, swa_pages, compressed_pages, device)
    out, key_scale = reference(case, records, device)
    atol, rtol = tolerance("bfloat16", "bfloat16")
    if case.dsv4.mega_attn:  # the mega kernel's output is MXFP8: half an e4m3 step (2^-4 relative) more
        rtol += 2**-4
    return out, atol * max(key_scale, 1e-6), rtol, verdicts


def _memory_class(violation) -> str:
    return "N" if any(k in violation.kernel for k in DSV4_KERNELS) else "C"


def judge_dsv4(case, obs) -> list[Verdict]:
    verdicts = [Verdict("memory", False, v.describe(), _memory_class(v), where=v.kernel) for v in obs.memory]
    for what in obs.notes.get("buffer_overrun", []):
        verdicts.append(Verdict("memory", False, what, "N", where="buffer_overrun:" + what.split(":")[0]))
    if obs.error_type is not None:
        return verdicts + [Verdict("error", False, f"{obs.error_type}: {obs.error}", where=obs.error_type)]
    if obs.notes.get("cache_changed"):
        verdicts.append(Verdict("cache", False, f"a cache changed during the attention call, which must only read it: "
                                                f"{obs.notes['cache_changed']}", "H", where="cache"))
    outputs = {k: v for k, v in obs.outputs.items()}
    verdicts += [v for v in judge_metadata(case, outputs) if not v.ok]
    device = obs.device
    out_ref, atol, rtol, write_verdicts = reference_for(case, outputs["swa_pages"], outputs.get("compressed_pages"),
                                                        device)
    verdicts += write_verdicts
    out = outputs["out"].to(device).float()
    if out.shape[0] != case.num_actual_tokens or out.shape[1] < case.heads or out.shape[2] != 512:
        return verdicts + [Verdict("shape", False, f"output shape {tuple(out.shape)}, expected "
                                                   f"[{case.num_actual_tokens}, >= {case.heads}, 512]", "J", where="shape")]
    out = out[:, : case.heads]
    real = case.num_tokens
    pad = out[real:]
    touched = ~torch.isnan(pad) & (pad != 0)
    if touched.any():
        t = real + int(touched.nonzero()[0][0])
        verdicts.append(Verdict("empty_row", False, f"padding token {t} (slot -1, no request) got output "
                                                    f"{float(out[t][~torch.isnan(out[t])].abs().max()):.3g}: it "
                                                    f"selects no key, so its row stays as it was or is 0", "C",
                                where="empty_row"))
    out, out_ref = out[:real], out_ref[:real]
    bad = ~torch.isfinite(out)
    if bad.any():
        t, h, _ = (int(x) for x in bad.nonzero()[0])
        verdicts.append(Verdict("nan", False, f"{int(bad.sum())} non-finite outputs; first token {t} head {h} (the "
                                              f"reference is finite: an unwritten cache slot read?)", "N", where="nan"))
    margin = error_margin(torch.where(torch.isfinite(out), out, out_ref), out_ref, atol, rtol)
    if margin > 1:
        t, h, c = _worst(out, out_ref, atol, rtol, non_finite=0.0)  # non-finite outputs: the `nan` check's
        kept = _rope_kept_rows(case, out, out_ref, atol, rtol, device)
        verdicts.append(Verdict("output", False, f"output off by {margin:.2f}x the tolerance (atol {atol:.3g}, rtol "
                                                 f"{rtol}); worst at token {t} head {h} dim {c}: {out[t, h, c]:.4g} vs "
                                                 f"{out_ref[t, h, c]:.4g}" + (f"; tokens {kept} match the reference "
                                                 "with the RoPE not taken back out" if kept else ""), "N",
                                margin=margin, where="output:rope_not_inverted" if kept else "output"))
    second = _second_opinion(outputs.get("cpu_layer_out"), out_ref, atol, rtol, case.heads)
    if not verdicts:
        verdicts.append(passed("output", f"{real} tokens within tolerance; metadata as defined", margin=margin))
    return verdicts + second


def _rope_kept_rows(case, out, ref, atol: float, rtol: float, device: str) -> list[int]:
    """On a layer that hands its output on inverse-RoPE'd (mega, ROCm): the tokens off the tolerance, if every one of
    them is within it of the reference with the RoPE left in (the rotation skipped on them: its own signature, apart
    from other wrong outputs); else []."""
    d = case.dsv4
    if not (d.mega_attn or d.rocm_arch):
        return []
    off = ((out - ref).abs() > atol + rtol * ref.abs()).flatten(1).any(1)
    positions = materialize_dsv4_inputs(case, device).positions[: out.shape[0]].to(device)
    kept = gptj_rope(ref.double(), positions, rope_theta(case)).float()
    if not off.any() or error_margin(out[off], kept[off], atol, rtol) > 1:
        return []
    return off.nonzero().flatten().tolist()


def _worst(out, ref, atol: float, rtol: float, non_finite: float) -> tuple[int, int, int]:
    """(token, head, dim) of the element furthest outside the tolerance; a non-finite one counts as `non_finite`."""
    err = ((out - ref).abs() / (atol + rtol * ref.abs())).nan_to_num(non_finite)
    return tuple(int(x) for x in (err == err.max()).nonzero()[0])


def _second_opinion(cpu_out, out_ref, atol: float, rtol: float, heads: int) -> list[Verdict]:
    """vLLM's CPU layer's output (its own DeepSeek-V4 implementation, where the host has it), every real token,
    against the same reference: a disagreement is reported as its own check, never used as the reference."""
    if cpu_out is None:
        return []
    rows = min(cpu_out.shape[0], out_ref.shape[0])
    cpu, ref = cpu_out[:rows, :heads].to(out_ref.device).float(), out_ref[:rows]
    margin = error_margin(torch.where(torch.isfinite(cpu), cpu, ref), ref, atol, rtol)
    if bool(torch.isfinite(cpu).all()) and margin <= 1:
        return [passed("cpu_second_opinion", f"vLLM's CPU layer agrees on {rows} tokens", margin=margin)]
    t, h, c = _worst(cpu, ref, atol, rtol, non_finite=float("inf"))
    return [Verdict("cpu_second_opinion", False, f"vLLM's CPU layer (DeepseekV4CPUAttention.forward_mqa) off by "
                                                 f"{margin:.2f}x the tolerance on token {t} head {h} dim {c}: "
                                                 f"{cpu[t, h, c]:.4g} vs {ref[t, h, c]:.4g}", "N", margin=margin,
                    where="cpu_second_opinion")]
