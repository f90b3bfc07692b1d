"""Verdicts for a whole sparse-MLA backend call: output and LSE against the fp32 reference, NaN/Inf,
rows with no valid index, and a KV cache that the call must leave byte-identical."""

from __future__ import annotations

import torch

from oracles import nvfp4_ds_mla
from oracles.attention import counted_attention, error_margin, sparse_mla_reference, tolerance
from oracles.fp8_ds_mla import dequantize, split_entry
from oracles.verdict import Verdict, passed
from strategies.tensors import KV_LORA_RANK, SM_SCALE, fp8_kv_scale, materialize_attention_inputs, materialize_layer_inputs


def reference_for(case, inputs=None, device: str = "cpu", slot_values=None, q=None, keep=None):
    """(out [T, H, 512], lse [T, H], valid_rows [T]) on `device`, from request-local positions and the case's
    own block table: independent of vLLM's remap. Positions outside [0, seq_len) are not selected. Computed
    in float64 on `device`: a GPU host judges its large cases on the GPU. `slot_values` (slots, rows) replaces
    the K/V of those physical slots: a quantized cache is judged by what its bytes hold. `keep` (bool [T, K])
    selects a subset of the top-k entries (one DCP rank's share)."""
    inp = inputs or materialize_attention_inputs(case, device)
    kv = torch.cat([inp.kv_c, inp.k_pe], dim=-1).float().to(device)
    if slot_values is not None:
        kv[slot_values[0].long().to(device)] = slot_values[1].float().to(device)
    topk = inp.index.topk_indices.long().to(device)
    rows, offsets, start = [], [], 0
    for r, req in enumerate(case.requests):
        rows.append(kv[inp.slot_of[r].to(device)])
        offsets.append(start)
        start += req.seq_len
    k_all = torch.cat(rows) if rows else torch.zeros(0, kv.shape[1], device=device)
    req_of = inp.index.req_id_per_token.long().to(device)
    offset = torch.tensor(offsets, dtype=torch.long, device=device)[req_of][:, None]
    seq_len = inp.index.seq_lens.long().to(device)[req_of][:, None]
    selected = (topk >= 0) & (topk < seq_len) & (True if keep is None else keep.to(device))
    indices = torch.where(selected, topk + offset, torch.full_like(topk, -1))
    q = inp.q.float() if q is None else q  # q: a layer's absorbed q (float64)
    out, lse = sparse_mla_reference(q.to(device), k_all, indices, SM_SCALE, 512)
    return out, lse, (indices >= 0).any(dim=1)


def fp8_query(q: torch.Tensor, scale: float | None) -> torch.Tensor | None:
    """The query a backend that takes it quantized is handed (MLAAttention's per-tensor fp8 quantization with the
    layer's q_scale, QuantFP8: x times the fp32 reciprocal of the scale, saturated at +-448, e4m3), as the values it
    means: the reference attends over those, as it does over a quantized cache's read-back values. None: not quantized."""
    if scale is None:
        return None
    s = torch.tensor(scale, dtype=torch.float32, device=q.device)
    return (q.float() * s.reciprocal()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * s


def judge_fp8_ds_mla_entries(case, inputs, slots, entries):
    """The 656-byte entries the cache writer produced, read back: (slots, dequantized rows) for the reference,
    and a verdict if they do not hold the values written (scale convention, layout; classes K and E).

    The kernels consume the entries' values, so the output is judged against attention over exactly those
    (rounded to bf16, as the kernels dequantize), with bf16's tolerance: the quantization error itself is
    judged here, once, at the fp8 bound."""

    device = inputs.kv_c.device  # judged where the inputs live (a 4K-context batch holds ~60K entries)
    entries, slots = entries.to(device), slots.to(device)
    values = dequantize(entries).to(torch.bfloat16).float()
    want = torch.cat([inputs.kv_c, inputs.k_pe], dim=-1)[slots.long()].float()
    # e4m3 keeps 3 mantissa bits (2^-4 relative) down to its subnormal step, 2^-9 times the tile's scale;
    # the RoPE half is bf16 written as bf16.
    scale = split_entry(entries)[1].float().repeat_interleave(128, dim=-1)
    bound = torch.cat([2**-4 * want[:, :512].abs() + 2**-9 * scale, 2**-8 * want[:, 512:].abs()], dim=-1)
    bad = ~((values - want).abs() <= bound + 1e-30)
    verdict = None
    if bad.any():
        row, col = (int(x) for x in bad.nonzero()[0])
        verdict = Verdict("cache_write", False, f"fp8_ds_mla entry of slot {int(slots[row])} reads back {values[row, col]:.4g} "
                                                f"at element {col}, written {want[row, col]:.4g} ({int(bad.sum())} elements off)",
                          "K" if col < 512 else "E", where="cache_write")
    return (slots, values), verdict


def judge_fp8_entries(case, inputs, slots, entries):
    """A per-tensor fp8 cache (kv_cache_dtype "fp8", 576 e4m3 bytes a token): the entries read back, (slots,
    dequantized rows) for the reference, and a verdict if they do not hold the values written (class K).

    Both parts of an entry were written as e4m3(x / k_scale) (vLLM's concat_and_cache_mla) and mean x: a reader
    multiplies each byte by the layer's k_scale, and the reference attends over exactly that, rounded to bf16 as a
    kernel's in-register dequantization gives it. The quantization error itself is judged here, once: 3 mantissa
    bits (2^-4 relative) down to e4m3's subnormal step (2^-9) times the scale."""
    device = inputs.kv_c.device
    entries, slots = entries.to(device), slots.to(device)
    k_scale = fp8_kv_scale(case)
    values = (entries.view(torch.uint8).view(torch.float8_e4m3fn).float() * k_scale).to(torch.bfloat16).float()
    want = torch.cat([inputs.kv_c, inputs.k_pe], dim=-1)[slots.long()].float()
    bad = ~((values - want).abs() <= 2**-4 * want.abs() + 2**-9 * k_scale + 2**-8 * values.abs() + 1e-30)
    verdict = None
    if bad.any():
        row, col = (int(x) for x in bad.nonzero()[0])
        verdict = Verdict("cache_write", False, f"fp8 entry of slot {int(slots[row])} reads back {values[row, col]:.4g} "
                                                f"(k_scale {k_scale:.4g}) at element {col}, written {want[row, col]:.4g} "
                                                f"({int(bad.sum())} elements off)", "K", where="cache_write")
    return (slots, values), verdict


def judge_nvfp4_ds_mla_entries(case, inputs, slots, entries):
    """The 352-byte nvfp4_ds_mla entries the cache writer produced, read back by the format's own decoder
    (oracles/nvfp4_ds_mla.py): (slots, values) for the reference (exact in bf16, as the kernels dequantize them), and
    a verdict if they do not hold the values written within the format's bound (class K for the NoPE, E for the
    RoPE)."""
    device = inputs.kv_c.device
    entries, slots = entries.to(device).view(torch.uint8), slots.to(device)
    values = nvfp4_ds_mla.dequantize(entries)
    want = torch.cat([inputs.kv_c, inputs.k_pe], dim=-1)[slots.long()].float()
    bad = ~((values - want).abs() <= nvfp4_ds_mla.error_bound(want, entries) + 1e-30)
    verdict = None
    if bad.any():
        row, col = (int(x) for x in bad.nonzero()[0])
        verdict = Verdict("cache_write", False, f"nvfp4_ds_mla entry of slot {int(slots[row])} reads back "
                                                f"{values[row, col]:.4g} at element {col}, written {want[row, col]:.4g} "
                                                f"({int(bad.sum())} elements off)", "K" if col < 512 else "E",
                          where="cache_write")
    return (slots, values), verdict


def judge_cache_entries(case, inputs, slots, entries):
    """A quantized cache's entries read back: (slots, values) for the reference, and a verdict if they are off."""
    if case.kv_cache_dtype == "fp8":
        return judge_fp8_entries(case, inputs, slots, entries)
    if case.kv_cache_dtype == "nvfp4_ds_mla":
        return judge_nvfp4_ds_mla_entries(case, inputs, slots, entries)
    return judge_fp8_ds_mla_entries(case, inputs, slots, entries)


def attention_tolerance(case, inputs) -> tuple[float, float]:
    """vLLM's test tolerances are for values of order 1: atol scales with the largest V the case holds, so
    tiny values are not waved through and large ones (bf16 P and output rounding) are not flagged."""
    # A quantized cache is judged through its read-back values (judge_fp8_ds_mla_entries): bf16 from there.
    atol, rtol = tolerance("bfloat16", "bfloat16")
    return atol * (max(float(inputs.kv_c.float().abs().max()), 1e-6) if inputs.kv_c.numel() else 1.0), rtol


# The index remap's grid follows req_id_per_token: an access past one of its other per-token arrays (the top-k
# rows it reads, the rows and counts it writes) means its per-token arguments cover different tokens (class A);
# past the block table, a request row or block out of range (class C).
REMAP_KERNEL, REMAP_ROW_ARGUMENTS = "index_remap", ("token_indices_ptr", "out_ptr", "valid_count_ptr")
# Other kernels whose grid follows one per-token array and which index another by it (kernel name part ->
# arguments): FLASHINFER_MLA_SPARSE_SM90's device clamp reads req_id_per_token at each planned work item's row, and
# FlashInfer's kernel (attnfuzz's stand-in) reads q and writes out at the plan's rows.
ROW_ARGUMENTS = {REMAP_KERNEL: REMAP_ROW_ARGUMENTS, "_clamp_work_kv_end": ("req_id_per_token",),
                 "BatchMLAPagedAttentionWrapper": ("q_nope", "o")}


# A kernel that checks its arguments before launching refuses the same contract break as an error: FA3's mha_fwd
# (the real one on a GPU host, and its stand-in) takes one seqused_k count a batch, and a full batch's counts with a
# token subset (the seed bug at FLASH_ATTN_MLA_SPARSE's call site) stop there, before any memory is touched.
ROW_CONTRACT_ERRORS = ("seqused_k must have shape (batch_size)",)


def _memory_class(violation) -> str:
    argument = getattr(violation, "argument", None)
    row_contract = any(kernel in violation.kernel and argument in arguments for kernel, arguments in ROW_ARGUMENTS.items())
    return "A" if row_contract else "C"


def _call_verdicts(obs) -> tuple[list[Verdict], bool]:
    """Memory violations, a raised error (nothing else to judge then), a cache the call wrote."""
    verdicts = [Verdict("memory", False, v.describe(), _memory_class(v), where=v.kernel) for v in obs.memory]
    for what in obs.notes.get("guard", []):  # sentinel bytes around the harness's buffers
        verdicts.append(Verdict("memory", False, what, "C", where="guard:" + what.split("`")[1]))
    for what in obs.notes.get("buffer_overrun", []):
        verdicts.append(Verdict("memory", False, what, "A", where="buffer_overrun"))
    if obs.error_type is not None:
        row_contract = any(message in str(obs.error) for message in ROW_CONTRACT_ERRORS)
        return verdicts + [Verdict("error", False, f"{obs.error_type}: {obs.error}", "A" if row_contract else "",
                                   where=obs.error_type)], False
    if obs.notes.get("cache_changed"):
        verdicts.append(Verdict("cache", False, f"the KV cache changed during an attention call that must only read "
                                                f"it: {obs.notes['cache_changed']}", "H", where="cache"))
    return verdicts, True


def _read_back(case, inputs, obs, verdicts):
    if case.kv_cache_dtype in ("fp8_ds_mla", "fp8", "nvfp4_ds_mla") and "cache_entries" in obs.outputs:
        slot_values, write_verdict = judge_cache_entries(case, inputs, obs.outputs["cache_slots"],
                                                         obs.outputs["cache_entries"])
        verdicts += [write_verdict] if write_verdict else []
        return slot_values
    return None


def _output_verdicts(out, out_ref, valid_rows, atol, rtol) -> tuple[list[Verdict], float]:
    verdicts = []
    bad = ~torch.isfinite(out)
    if bad.any():
        t, h, _ = (int(x) for x in bad.nonzero()[0])
        kind = "row with no valid index" if not valid_rows[t] else "valid row"
        verdicts.append(Verdict("nan", False, f"{int(bad.sum())} non-finite outputs; first token {t} head {h} "
                                              f"({kind}; reference is finite)", "I", where="nan"))
    empty = ~valid_rows
    if empty.any() and torch.isfinite(out[empty]).all() and out[empty].abs().max() > 0:
        t = int(empty.nonzero()[0])
        verdicts.append(Verdict("empty_row", False, f"token {t} selects no valid index but its output is not 0 "
                                                    f"(max |out| {out[t].abs().max():.3g})", "B", where="empty_row"))
    finite = torch.isfinite(out)
    margin = error_margin(torch.where(finite, out, out_ref), out_ref, atol, rtol)
    if margin > 1:
        err = ((out - out_ref).abs() / (atol + rtol * out_ref.abs())).nan_to_num(0)
        t, h, d = (int(x) for x in (err == err.max()).nonzero()[0])
        verdicts.append(Verdict("output", False, f"output off by {margin:.2f}x the tolerance (atol {atol:.3g}, rtol {rtol}); "
                                                 f"worst at token {t} head {h} dim {d}: {out[t, h, d]:.4g} vs "
                                                 f"{out_ref[t, h, d]:.4g}", margin=margin, where="output"))
    return verdicts, margin


def judge_attention(case, obs) -> list[Verdict]:
    """An impl-level call (forward_mqa): latent output [T, H, 512] and LSE."""
    return attention_judgement(case, obs)[0]


def attention_judgement(case, obs):
    """judge_attention's verdicts, and what it judged them with (inputs, the fp8 read-back, the reference
    output), for an oracle that judges more of the same call (None where the call gave nothing to judge)."""
    verdicts, go_on = _call_verdicts(obs)
    if not go_on:
        return verdicts, None
    inputs = materialize_attention_inputs(case, obs.device)
    slot_values = _read_back(case, inputs, obs, verdicts)
    q = fp8_query(inputs.q, obs.notes.get("query_fp8_scale"))  # a backend handed a quantized query
    out_ref, lse_ref, valid_rows = reference_for(case, inputs, device=obs.device, slot_values=slot_values, q=q)
    judged = (inputs, slot_values, out_ref)
    out = obs.outputs["out"].to(obs.device).float()
    if out.shape != out_ref.shape:
        return verdicts + [Verdict("output", False, f"output shape {tuple(out.shape)}, expected {tuple(out_ref.shape)}",
                                   "J", where="shape")], judged
    atol, rtol = attention_tolerance(case, inputs)
    found, margin = _output_verdicts(out, out_ref, valid_rows, atol, rtol)
    verdicts += found
    lse = obs.outputs.get("lse")
    if lse is not None:
        lse_margin = error_margin(lse.to(obs.device).float(), lse_ref, 1e-2, 1e-2)
        if lse_margin > 1:
            verdicts.append(Verdict("lse", False, f"LSE off by {lse_margin:.2f}x the tolerance", "G", margin=lse_margin,
                                    where="lse"))
    verdicts += padded_row_verdicts(case, obs)
    if not [v for v in verdicts if v.check != "padded_rows"]:
        verdicts.append(passed("output", f"{case.num_tokens} tokens within tolerance", margin=margin))
    return verdicts, judged


def padded_row_verdicts(case, obs) -> list[Verdict]:
    """A full CUDA graph's padding tokens (rows num_tokens.. of the output the backend wrote, `out_padded`): no
    reference exists for them (their top-k rows hold no valid index), but what vLLM writes there must be finite:
    the model's next layers read those rows (its residual stream and MoE routing run on every graph row)."""
    pad = obs.outputs.get("out_padded")
    if pad is None or pad.numel() == 0:
        return []
    bad = ~torch.isfinite(pad.float()).reshape(pad.shape[0], -1).all(dim=1)
    if bool(bad.any()):
        first = int(bad.nonzero()[0])
        return [Verdict("padded_rows", False, f"{int(bad.sum())} of {pad.shape[0]} padding tokens' output rows hold "
                        f"NaN or Inf (first: row {case.num_tokens + first})", "H", where="padded_rows")]
    return [passed("padded_rows", f"{pad.shape[0]} rows finite")]


def layer_reference_for(case, layer_inputs, device: str = "cpu", slot_values=None, mha_tokens: int = 0,
                        mha_rows: torch.Tensor | None = None, own_from: torch.Tensor | None = None):
    """(out [T, H, 128], valid_rows): the layer's output, v-projected through W_UV, for the route vLLM gave each
    token: the last `mha_tokens` (or the tokens `mha_rows` marks, bool [T]) took dense MHA (`mha_reference`, with
    `own_from` as there), the others forward_mqa, which attends in the latent space with q absorbed through W_UK."""
    inp = layer_inputs.attention
    q = layer_inputs.latent_q()
    # The MQA route attends with q_nope absorbed through W_UK by a bf16 bmm (`mqa_ql_nope`, fp32 accumulation):
    # the kernel's input is that bf16 tensor, so the reference takes it rounded the same way. With large values
    # the rounding alone moves scores by more than bf16's output tolerance covers (a false finding on the H200).
    q = q.float().to(torch.bfloat16).double().where(
        torch.arange(q.shape[-1], device=q.device) < KV_LORA_RANK, q)
    out, _, valid_rows = reference_for(case, inp, device, slot_values, q=q)
    _, w_uv = layer_inputs.w_uk_uv()
    out = torch.einsum("thl,hvl->thv", out.double(), w_uv.to(out.device)).float()
    if mha_rows is not None and bool(mha_rows.any()):
        rows = mha_rows.to(out.device)
        out[rows] = mha_reference(case, layer_inputs, device, slot_values, 0, rows, own_from).float().to(out.device)
    elif mha_tokens:
        first = case.num_tokens - mha_tokens
        out[first:] = mha_reference(case, layer_inputs, device, slot_values, first).float()
    return out, valid_rows


def mha_reference(case, layer_inputs, device: str, slot_values, first: int, rows: torch.Tensor | None = None,
                  own_from: torch.Tensor | None = None) -> torch.Tensor:
    """float64 [T - first, H, 128]: tokens `first..T-1` (whole requests; or the tokens `rows` marks, bool [T]) as
    vLLM's dense-MHA route computes them, over the positions their top-k rows select (the route is taken when those
    are every visible position).

    That route projects each key's latent through kv_b_proj, a bf16 GEMM: k_nope = bf16(W_UK kv_c) and
    v = bf16(W_UV kv_c) per head, and attends with the layer's q_nope and q_pe as given. The rounding of k_nope
    and v moves scores by up to a few hundredths with large values, more than the latent (absorbed) form shows,
    so the reference rounds where vLLM does. The step's own tokens come from kv_c as given (the route projects
    them before the cache write), the context from what the cache holds (`slot_values`: a quantized cache's
    read-back, rounded to bf16 as the context gather produces it). `own_from` (int [T]): each token's first
    position handed to the route as given, those before it read from the cache (under PCP a chunk's context holds
    the step's earlier chunks, written before the attention); default: its request's context length."""
    inp = layer_inputs.attention
    kv = torch.cat([inp.kv_c, inp.k_pe], dim=-1).double().to(device)
    w_uk, w_uv = (w.to(device) for w in layer_inputs.w_uk_uv())
    q = layer_inputs.q.double().to(device)
    topk = inp.index.topk_indices.long().to(device)
    if rows is None:
        rows = torch.arange(case.num_tokens) >= first
    rows = rows.cpu()
    outs = []
    for r, req in enumerate(case.requests):
        t0 = case.token_start(r)
        mine = rows[t0 : t0 + req.query_len].nonzero().flatten()
        if not len(mine):
            continue
        starts = (own_from[t0 : t0 + req.query_len].cpu() if own_from is not None
                  else torch.full((req.query_len,), req.context_len))
        for start in sorted({int(starts[i]) for i in mine}):  # the tokens that read the same positions from the cache
            toks = mine[starts[mine] == start]
            keys = kv[inp.slot_of[r].to(device)]  # [S, 576], position by position
            if slot_values is not None and start:  # the context as the cache holds it
                held = torch.full((inp.num_slots, kv.shape[1]), float("nan"), dtype=torch.float64, device=device)
                held[slot_values[0].long().to(device)] = slot_values[1].double().to(device)
                keys[:start] = held[inp.slot_of[r][:start].to(device)]
            k_nope = torch.einsum("sl,hnl->shn", keys[:, :KV_LORA_RANK], w_uk).to(torch.bfloat16).double()
            v = torch.einsum("sl,hvl->shv", keys[:, :KV_LORA_RANK], w_uv).to(torch.bfloat16).double()
            heads = k_nope.shape[1]
            k = torch.cat([k_nope, keys[:, None, KV_LORA_RANK:].expand(-1, heads, -1)], dim=-1)
            idx = topk[t0 + toks.to(device)]
            valid = (idx >= 0) & (idx < req.seq_len)
            counts = torch.zeros(len(toks), req.seq_len + 1, dtype=torch.float64, device=device)
            counts.scatter_add_(1, torch.where(valid, idx, req.seq_len), valid.double())
            att = counted_attention(q[t0 + toks.to(device)], k, v, counts[:, : req.seq_len], SM_SCALE)
            outs.append((t0 + toks, att))
    if not outs:
        return torch.zeros(0, *q.shape[1:2], w_uv.shape[1], dtype=torch.float64, device=device)
    order = torch.cat([t for t, _ in outs]).argsort().to(device)  # token order, as `rows` marks them
    return torch.cat([o for _, o in outs])[order]


def judge_gathered_context(case, inputs, slot_values, slots, rows) -> list[Verdict]:
    """The context rows the dense-MHA path gathered (and dequantized) must equal what the cache bytes at those
    slots hold: bf16 rows as written, fp8_ds_mla entries dequantized by their own tile scales and rounded to
    bf16 (class E: a layout-unaware gather reads them as flat fp8)."""
    device = inputs.kv_c.device
    slots, rows = slots.to(device).long(), rows.to(device).float()
    if slot_values is not None:  # fp8_ds_mla: the read-back dequantization of the written entries
        table = torch.full((inputs.num_slots, rows.shape[-1]), float("nan"), device=device)
        table[slot_values[0].to(device).long()] = slot_values[1].to(device).float()
        want = table[slots]
    else:
        want = torch.cat([inputs.kv_c, inputs.k_pe], dim=-1)[slots].float()
    bad = ~((rows - want).abs() <= 2**-8 * want.abs() + 1e-30)  # bf16 rounding of the same value at most
    if not bad.any():
        return []
    i, col = (int(x) for x in bad.nonzero()[0])
    return [Verdict("gather", False, f"context K/V gathered for dense MHA: slot {int(slots[i])} element {col} is "
                                     f"{rows[i, col]:.4g}, the cache bytes there hold {want[i, col]:.4g} "
                                     f"({int(bad.any(dim=-1).sum())} of {len(rows)} rows off)", "E", where="gather")]


def layer_tolerance(case, layer_inputs) -> tuple[float, float]:
    """bf16's 1e-2, scaled by the size V can reach: max |kv_c| times the largest W_UV row norm."""
    atol, rtol = tolerance("bfloat16", "bfloat16")
    _, w_uv = layer_inputs.w_uk_uv()
    kv = layer_inputs.attention.kv_c
    v_scale = (float(kv.float().abs().max()) if kv.numel() else 1.0) * float(w_uv.norm(dim=-1).max())
    return atol * max(v_scale, 1e-6), rtol


def judge_layer(case, obs) -> list[Verdict]:
    """A layer-level call (MLAAttention.forward_impl): output [T, H * 128] after W_UV, whichever route
    vLLM took for each token (the target records how many tail tokens went to dense MHA)."""
    return layer_judgement(case, obs)[0]


def layer_judgement(case, obs):
    """judge_layer's verdicts, and what it judged them with ((reference [T, H, 128], its valid rows, atol,
    rtol), or None where the call gave nothing to judge), for an oracle that judges more of the same call."""
    verdicts, go_on = _call_verdicts(obs)
    if not go_on:
        return verdicts, None
    layer_inputs = materialize_layer_inputs(case, obs.device)
    slot_values = _read_back(case, layer_inputs.attention, obs, verdicts)
    if "gathered_rows" in obs.outputs:
        verdicts += judge_gathered_context(case, layer_inputs.attention, slot_values, obs.outputs["gathered_slots"],
                                           obs.outputs["gathered_rows"])
    mha_tokens = int(obs.notes.get("route", {}).get("mha_tokens", 0))
    out_ref, valid_rows = layer_reference_for(case, layer_inputs, obs.device, slot_values, mha_tokens)
    atol, rtol = layer_tolerance(case, layer_inputs)
    judged = (out_ref, valid_rows, atol, rtol)
    out = obs.outputs["out"].to(obs.device).float()
    if out.numel() != out_ref.numel():
        return verdicts + [Verdict("output", False, f"output shape {tuple(out.shape)}, expected {tuple(out_ref.shape)}",
                                   "J", where="shape")], judged
    found, margin = _output_verdicts(out.view(out_ref.shape), out_ref, valid_rows, atol, rtol)
    verdicts += found
    verdicts += padded_row_verdicts(case, obs)
    if not [v for v in verdicts if v.check != "padded_rows"]:
        verdicts.append(passed("output", f"{case.num_tokens} tokens within tolerance", margin=margin))
    return verdicts, judged
