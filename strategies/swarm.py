"""Swarm testing (Groce et al., ISSTA 2012) and the knobs it turns.

A knob is one named choice the case strategies make (how many decodes, MTP or not, padding rows, where the -1
entries of a top-k row sit, the kv-cache dtype, ...), with a few categories: the values a swarm can pin and
combination coverage counts. Boundaries the kernels care about are categories of their own (a valid count of
0, 1, topk - 1 or topk; a prefill whose sequence ends at the dense-MHA threshold; a context ending on a block
edge; a block table whose last column is used), so a swarm draws them as often as any other value.

A `Swarm` pins some knobs for a batch of cases; the strategies draw every other knob uniformly over its
categories. Without a swarm (`None`) the strategies draw exactly as they always have (the `plain` search).
`case_features` reads the categories back from a case (plain data), so coverage is counted from what a case
is, not from what its batch asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from strategies.case import (
    ATTN_SINKS,
    C4_ORDERS,
    CUDAGRAPH_MODES,
    FP8_SCALES,
    INVALID_AT,
    ROCM_ARCHS,
    TOPK_PICKS,
    VALUE_KINDS,
    Case,
    pcp_splits,
)

TILE_EDGE_WIDTH = 4224  # top-k widths from here up are the `tile_edge` category (Profile.edge_topk_widths)


@dataclass(frozen=True)
class Knob:
    name: str
    values: tuple[str, ...]  # the categories; the first is the plain one (a swarm's "off")
    doc: str


def _knobs(*knobs: Knob) -> dict[str, Knob]:
    return {k.name: k for k in knobs}


# Every knob any case strategy turns; a strategy says which of them it draws (`index_knobs`, `attention_knobs`
# in strategies.batches), with the value sets of its profile and target.
KNOBS = _knobs(
    Knob("decodes", ("none", "some"), "decode requests in the step"),
    Knob("decode_query_len", ("one", "mtp"), "decode query length 1, or 1 + draft tokens (MTP)"),
    Knob("padding_rows", ("none", "some"), "zero-length rows after the decodes (CUDA-graph padding)"),
    Knob("decode_context", ("short", "long"), "a decode's cached context: up to an eighth of the profile's, or past half"),
    Knob("prefills", ("none", "one", "several"), "prefill and extend requests after the decodes"),
    Knob("prefill_len", ("short", "threshold", "long"),
         "a prefill's seq_len: below topk - 1 (dense MHA), within one of topk (the split), or past it"),
    Knob("prefill_context", ("none", "cached"), "a prefill with tokens already cached (prefix hit, chunked)"),
    Knob("block_edge", ("none", "some"), "a cached context or a sequence that ends exactly on a block boundary"),
    Knob("table_layout", ("arange", "permuted", "shared_prefix"), "how physical block ids are laid out"),
    Knob("table_last_column", ("spare", "used"), "a request's blocks fill the block table's last column"),
    Knob("idx_mapping", ("off", "on"), "a persistent block table: requests in arbitrary rows"),
    Knob("block_stride", ("off", "on"), "other layers' pages between this layer's blocks"),
    Knob("block_size", (), "tokens per block (values: the profile's)"),
    Knob("topk_width", (), "index_topk (values: the profile's widths, any other multiple of 128 up to 2048, and "
                           "`tile_edge`: where the index remap's tiling changes)"),
    Knob("topk_valid", ("zero", "one", "partial", "minus_one", "full"),
         "valid entries a row asks for: 0, 1, some, topk - 1, topk"),
    Knob("invalid_at", INVALID_AT, "where a row's -1 entries sit"),
    Knob("topk_pick", TOPK_PICKS, "which visible positions a row selects: any, or the newest (its last slots)"),
    Knob("past_seq", ("none", "some"), "entries past seq_len whose block is still in the table"),
    Knob("past_table", ("none", "some"), "entries whose block lies past the block table"),
    Knob("dcp", (), "DCP world size (values: the profile's)"),
    Knob("dcp_rank", ("first", "middle", "last"), "the rank whose view an index call computes"),
    Knob("dcp_interleave", ("one", "many"), "cp_kv_cache_interleave_size 1 or more"),
    Knob("cp_layout", (), "prefill context parallelism x DCP (x TP) ranks (values: the target's, e.g. pcp2.dcp4)"),
    Knob("pcp_prefill", ("split", "whole"), "a prefill split over the PCP ranks in head-tail chunks, or run whole on "
                                            "every rank (too short for every chunk)"),
    Knob("valid_counts", ("off", "on"), "return_valid_counts (and compaction where the release compacts)"),
    Knob("prefill_workspace", ("off", "on"), "prefill rows map into a gathered workspace"),
    Knob("token_rows", ("all", "decodes"), "the call site passes every top-k row or the decode rows only"),
    Knob("req_id_rows", ("match", "full_batch"), "req_id_per_token sliced like topk_indices, or the whole batch's"),
    Knob("heads", (), "query heads per rank (values: the target's)"),
    Knob("kv_cache_dtype", (), "kv-cache dtype (values: the target's)"),
    Knob("fp8_scale", FP8_SCALES, "fp8 scale convention: fp8_ds_mla's tile scales; a per-tensor fp8 cache's k_scale "
                                  "(pow2: 1.0, arbitrary: a calibrated checkpoint's)"),
    Knob("topk_rows", ("drawn", "indexer"), "top-k rows with drawn valid counts, or as the indexer fills them: "
                                            "min(visible positions, topk) valid each"),
    Knob("values", VALUE_KINDS, "what the cache and queries hold"),
    Knob("cudagraph", CUDAGRAPH_MODES, "the engine replays uniform decode steps from full CUDA graphs (or runs eagerly)"),
    Knob("trace", ("single", "short", "long"),
         "steps one engine ran before the case: none, one, or two to three (strategies.traces)"),
    Knob("mtp_draft", ("off", "on"), "the steps before the case include an MTP draft step: the step before's "
                                     "metadata updated in place (strategies.traces.draft_pair)"),
    # Indexer steps (strategies.indexer_batches)
    Knob("topk_backend", (), "the indexer's sparse_indexer_topk_backend (values: the target's)"),
    Knob("logits_budget", ("default", "tight"), "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB: vLLM's 512, or small enough "
                                                "that the builder splits the step's prefills into chunks"),
    # DeepSeek-V4 steps (strategies.dsv4_batches)
    Knob("compress_ratio", (), "DeepSeek-V4 layer type: 4 (C4A, the indexer's top-k), 128 (C128A, every compressed "
                               "entry), 1 (sliding window only)"),
    Knob("window_size", (), "sliding_window (values: the profile's)"),
    Knob("compressed_block", ("64", "128"), "DeepSeek-V4.1: the compressed K cache's block (SM90's 64, else 128)"),
    Knob("kv_record", ("584", "528"), "DeepSeek-V4.1: the caches' record, V4's 584 bytes or SM100's interleaved "
                                      "528-byte MXFP8 one"),
    Knob("cache_dtype", ("bfloat16", "fp8", "auto", "fp8_e4m3"), "DeepSeek-V4 on FlashInfer's SM100 layer: the "
                                                                   "--kv-cache-dtype of its plain-row caches"),
    Knob("page_pad", ("none", "few", "double"), "DeepSeek-V4 on FlashInfer's SM100 layer: rows of other components "
                                                "after each cache page's own (vLLM's packed KV layout, issue 47783)"),
    Knob("kv_source", ("own", "shared"), "DeepSeek-V4.1: the layer owns its compressed cache, or reads the kv-source "
                                         "layer's (compressed_cache_prefix)"),
    Knob("rocm_arch", ROCM_ARCHS, "DeepSeek-V4 on the ROCm layers: the emulated AMD arch, gfx950's tuned decode or "
                                  "an un-tuned arch's fallback kernel (Dsv4.rocm_arch)"),
    Knob("decode_lengths", ("uniform", "mixed"), "MTP decodes of one query length, or of several (require_uniform=False)"),
    Knob("window_context", ("short", "near", "long"),
         "a decode's sequence: within the window (clipped at position < window), up to two blocks past it, or far past"),
    Knob("window_edge", ("inside", "boundary"), "a query's window starts exactly on an SWA block boundary"),
    Knob("state_fill", ("full", "one_before", "one_after", "partial"),
         "a sequence's last compressed state: complete (seq_len % ratio == 0), one token short, one token into the next, "
         "partly filled"),
    Knob("c4_valid", ("zero", "one", "some", "all"),
         "valid ids in a C4 token's indexer row: min((pos + 1) // 4, index_topk) is 0, 1, some, index_topk"),
    Knob("c4_order", C4_ORDERS, "the order of a C4 row's valid ids: by score, or ascending (the short-context fill)"),
    Knob("attn_sink", ATTN_SINKS, "the layer's attention sink per head"),
    Knob("swa_freed", ("kept", "freed"), "SWA blocks wholly behind every query's window back in the pool (null block 0)"),
    Knob("padded_tokens", ("none", "some"), "tokens past the last request (graph padding: slot -1, position 0)"),
    Knob("max_model_len", ("large", "tight"), "the engine's max_model_len: far past the step, or just past its "
                                              "longest sequence (C128A row width, prefill chunk plan)"),
    Knob("step5_groups", ("1", "2"), "Step5: KV groups (KV heads) a rank, each with its own indexer rows"),
    Knob("step5_heads", ("8", "4", "16"), "Step5: query heads per KV group"),
    Knob("step5_index_heads", ("4", "2"), "Step5: real indexer heads per group (padded to 8)"),
    Knob("step5_topk", (), "Step5: sparse_config.topk, closed regions a query keeps (values: the profile's)"),
    Knob("step5_context", ("short", "edge", "long"),
         "Step5: a request's closed regions against topk: fewer (every one kept), within one of topk, far more"),
    Knob("step5_region_edge", ("any", "closes", "opens"),
         "Step5: the last step's token closes its 8-token region (position % 8 == 7: the summary is written), "
         "opens one (% 8 == 0), or anywhere"),
    Knob("step5_steps", ("one", "several"), "Step5: decode steps one engine runs (ring rows and summaries carried)"),
    Knob("step5_regions", ("distinct", "ties"), "Step5: closed regions with repeated keys (equal scores at the cut)"),
    Knob("step5_defer_clear", ("off", "on"), "Step5: the model's deferred inactive-row clear (gated decode)"),
    Knob("step5_batch", ("few", "many"), "Step5: a few decodes, or more (token, KV group) rows than 128: the attention "
                                         "kernel's single split (sparse_decode_splits), short contexts"),
    Knob("step5_kv", ("bfloat16", "fp8", "fp8_calibrated"), "Step5: the KV cache, bf16 or e4m3 with k/v scale 1.0 or "
                                                            "a calibrated checkpoint's"),
)


@dataclass(frozen=True)
class Swarm:
    """The knobs one batch of cases pins, each to one category."""

    pins: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name, _ in self.pins:
            if name not in KNOBS:
                raise ValueError(f"swarm pins an unknown knob {name!r} (known: {', '.join(KNOBS)})")

    def pinned(self, name: str) -> str | None:
        return dict(self.pins).get(name)

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.pins) or "-"


def category(draw, swarm: Swarm | None, name: str, values: tuple[str, ...] | None = None) -> str | None:
    """A knob's category for one draw: the swarm's pin, else one drawn uniformly; None without a swarm (the
    caller then draws as the plain strategy always has)."""
    if swarm is None:
        return None
    values = values or KNOBS[name].values
    pin = swarm.pinned(name)
    # A pin is drawn too, as the one index it allows: Hypothesis records the category's index either way, so a
    # failure stored under one swarm replays as the same case under any other (a rerun, another fleet worker).
    i = values.index(pin) if pin is not None and pin in values else None
    return values[draw(st.integers(0, len(values) - 1) if i is None else st.integers(i, i))]


# -- what a case is, knob by knob -------------------------------------------------------------------------
def valid_category(valid: int, width: int) -> str:
    return {0: "zero", 1: "one", width - 1: "minus_one", width: "full"}.get(valid, "partial")


def prefill_len_category(seq_len: int, width: int) -> str:
    return "short" if seq_len < width - 1 else "threshold" if seq_len <= width + 1 else "long"


def dcp_rank_category(rank: int, size: int) -> str:
    return "first" if rank == 0 else "last" if rank == size - 1 else "middle"


def case_features(case: Case, domains: dict[str, tuple[str, ...]], max_context: int) -> dict[str, frozenset[str]]:
    """The categories `case` takes for each knob of `domains` (a strategy's knobs and their values); a knob
    that does not apply to the case (the decode query length of a step without decodes) is absent; `max_context`
    is the profile's (what a long context is). Knobs
    taken per request (top-k rows, prefills) may take several categories in one case."""
    reqs, n_dec, bs = case.requests, case.num_decodes, case.block_size
    decodes = [r for r in reqs[:n_dec] if r.query_len]
    prefills = [(i, r) for i, r in enumerate(reqs) if i >= n_dec and r.query_len]
    f: dict[str, set[str]] = {
        "decodes": {"some" if decodes else "none"},
        "padding_rows": {"some" if any(r.query_len == 0 for r in reqs) else "none"},
        "prefills": {"none" if not prefills else "one" if len(prefills) == 1 else "several"},
        "block_edge": {"some" if any(r.context_len and (r.context_len % bs == 0 or r.seq_len % bs == 0)
                                     for r in reqs) else "none"},
        "table_layout": {_table_layout(case)},
        "table_last_column": {"used" if any(case.block_table[case.table_row(i)][-1] != 0 and r.seq_len
                                            for i, r in enumerate(reqs)) else "spare"},
        "idx_mapping": {"on" if case.idx_mapping is not None else "off"},
        "block_stride": {"on" if case.block_stride_rows else "off"},
        "block_size": {str(bs)},
        "topk_width": {"tile_edge" if case.topk_width >= TILE_EDGE_WIDTH else str(case.topk_width)},
        "topk_valid": {valid_category(t.valid, case.topk_width) for t in case.topk},
        "invalid_at": {t.invalid_at for t in case.topk},
        "topk_pick": {t.pick for t in case.topk},
        "past_seq": {"some" if any(t.past_seq for t in case.topk) else "none"},
        "past_table": {"some" if any(t.past_table for t in case.topk) else "none"},
        "dcp": {str(case.dcp.size)},
        "valid_counts": {"on" if case.call.valid_counts else "off"},
        "prefill_workspace": {"on" if case.call.prefill_workspace else "off"},
        "token_rows": {case.call.token_rows},
        "req_id_rows": {case.call.req_id_rows},
        "heads": {str(case.heads)},
        "kv_cache_dtype": {case.kv_cache_dtype},
        "values": {case.values},
        "cudagraph": {case.cudagraph},
        "trace": {"single" if not case.earlier else "short" if len(case.earlier) == 1 else "long"},
        "mtp_draft": {"on" if any(s.mtp_draft for s in case.steps) else "off"},
    }
    if decodes:
        f["decode_query_len"] = {"one" if decodes[0].query_len == 1 else "mtp"}
        f["decode_context"] = {"long" if 2 * r.context_len >= max_context else "short" for r in decodes}
    if prefills:
        f["prefill_len"] = {prefill_len_category(r.seq_len, case.topk_width) for _, r in prefills}
        f["prefill_context"] = {"cached" if r.context_len else "none" for _, r in prefills}
    if case.dcp.size > 1:
        f["dcp_rank"] = {dcp_rank_category(case.dcp.rank, case.dcp.size)}
        f["dcp_interleave"] = {"one" if case.dcp.interleave == 1 else "many"}
    if case.dcp.pcp > 1:
        f["cp_layout"] = {case.dcp.layout}
        if prefills:
            f["pcp_prefill"] = {"split" if pcp_splits(r.query_len, case.dcp.pcp) else "whole" for _, r in prefills}
    if case.kv_cache_dtype in ("fp8_ds_mla", "fp8"):
        f["fp8_scale"] = {case.fp8_scale}
    if case.topk:
        f["topk_rows"] = {"indexer" if all(t.valid == case.topk_width for t in case.topk) else "drawn"}
    if case.dsv4 is not None:
        f.update(dsv4_features(case, decodes))
    if case.step5 is not None:
        f.update(step5_features(case))
    if case.indexer is not None:
        f["topk_backend"] = {case.indexer.topk_backend}
        f["logits_budget"] = {"default" if case.indexer.max_logits_mb == 512 else "tight"}
        f["padded_tokens"] = {"some" if case.padded_tokens else "none"}
    out = {}
    for name, values in domains.items():
        if name in f:  # a value outside the strategy's categories (a width past the profile's) counts as "other"
            out[name] = frozenset(v if v in values else "other" for v in f[name])
    return out


def dsv4_features(case: Case, decodes) -> dict[str, set[str]]:
    """The DeepSeek-V4 knobs' categories of a case (Case.dsv4)."""
    d, bs, w = case.dsv4, case.block_size, case.dsv4.window_size
    positions = [p for r in case.requests for p in range(r.context_len, r.seq_len)]
    f: dict[str, set[str]] = {
        "compress_ratio": {str(d.compress_ratio)},
        "window_size": {str(w)},
        "window_edge": {"boundary" if any(p - w + 1 >= bs and (p - w + 1) % bs == 0 for p in positions) else "inside"},
        "attn_sink": {d.attn_sink},
        "swa_freed": {"freed" if any(0 in row[: -(-r.seq_len // bs)] for r, row in
                                     zip(case.requests, (case.block_table[case.table_row(i)]
                                                         for i in range(len(case.requests))))) else "kept"},
        "padded_tokens": {"some" if case.padded_tokens else "none"},
        "max_model_len": {"tight" if d.max_model_len else "large"},
    }
    if decodes:
        f["decode_query_len"] = {"mtp" if d.num_speculative_tokens else "one"}
        f["window_context"] = {"short" if r.seq_len <= w else "near" if r.seq_len <= w + 2 * bs else "long"
                               for r in decodes}
        if d.num_speculative_tokens:
            f["decode_lengths"] = {"uniform" if len({r.query_len for r in decodes}) == 1 else "mixed"}
    if d.cache_dtype != "fp8_ds_mla":
        f["cache_dtype"] = {d.cache_dtype}
        f["page_pad"] = {"none" if not d.page_pad else "double" if d.page_pad == bs else "few"}
    if d.rocm_arch:
        f["rocm_arch"] = {d.rocm_arch}
    if d.version == "4.1":
        f["compressed_block"] = {str(d.compressed_block_size)}
        if d.cache_dtype == "fp8_ds_mla":
            f["kv_record"] = {str(d.kv_record)}
        if d.compressed:
            f["kv_source"] = {d.kv_source}
    if d.compress_ratio > 1:
        fill = {0: "full", d.compress_ratio - 1: "one_before", 1: "one_after"}
        f["state_fill"] = {fill.get(r.seq_len % d.compress_ratio, "partial") for r in case.requests if r.query_len}
    if d.indexed:
        width = case.topk_width
        counts = {min((p + 1) // d.compress_ratio, width) for p in positions}
        f["c4_valid"] = {"zero" if n == 0 else "one" if n == 1 else "all" if n == width else "some" for n in counts}
        f["c4_order"] = {d.c4_order}
    return f


def step5_features(case: Case) -> dict[str, set[str]]:
    """The Step5 DSA knobs' categories of a case (Case.step5), read back as strategies.step5_batches draws them."""
    x, reqs = case.step5, [r for r in case.requests if r.query_len]

    def context(r) -> str:  # a request's closed 8-token regions against the top-k of regions
        closed = r.context_len // 8
        return "edge" if abs(closed - x.region_topk) <= 1 else "short" if closed < x.region_topk else "long"

    last = reqs[0].context_len % 8 if reqs else None
    return {
        "step5_groups": {str(x.groups)},
        "step5_heads": {str(case.heads // x.groups)},
        "step5_index_heads": {str(x.index_heads)},
        "step5_topk": {str(x.region_topk)},
        "step5_context": {context(r) for r in reqs},
        "step5_region_edge": {"closes" if last == 7 else "opens" if last == 0 else "any"},
        "step5_steps": {"one" if x.steps == 1 else "several"},
        "step5_regions": {x.regions},
        "step5_defer_clear": {"on" if x.defer_inactive_clear else "off"},
        "step5_batch": {"many" if len(reqs) * x.groups > 128 else "few"},
        "step5_kv": {"bfloat16" if case.kv_cache_dtype == "bfloat16"
                     else "fp8_calibrated" if case.fp8_scale == "arbitrary" else "fp8"},
        "padded_tokens": {"some" if case.padded_tokens else "none"},
    }


def _table_layout(case: Case) -> str:
    rows = [case.block_table[case.table_row(i)] for i in range(len(case.requests))]
    ids = [b for row in rows for b in row if b]
    if len(ids) != len(set(ids)):
        return "shared_prefix"
    return "arange" if ids == sorted(ids) else "permuted"


# -- the index remap's call modes ------------------------------------------------------------------------
# Each call mode is a specialisation of the remap kernel that a call site selects through its arguments. A bug in
# one of them shows only when a case pairs that mode with whatever else the bug needs (the full-batch
# req_id_per_token, say). The search pins the pairs no case has covered yet, the rarest first
# (fuzzer.search.combinations). These modes are the ones fuzzer.mutants._kernel_patch.CALL_MODES breaks:
# "valid_counts" counts on one tile, "compaction" counts on the multi-tile path (the atomic slot allocator), and
# "plain" uses none of them. Several can hold at once; "plain" holds alone.
CALL_MODES = ("plain", "valid_counts", "compaction", "prefill_workspace", "idx_mapping", "block_stride")
_MODE_FLAGS = ("valid_counts", "prefill_workspace", "idx_mapping", "block_stride")  # the knobs that select a mode


def remap_single_tile(width: int) -> bool:
    """Whether the remap counts a row of this top-k width in one tile (vLLM's `_remap_tiling` with counting: powers
    of two and widths up to 4096)."""
    return width & (width - 1) == 0 or width <= 4096


def call_modes(case: Case) -> frozenset[str]:
    """The call modes of the index remap that `case` calls it in."""
    modes = set()
    if case.call.valid_counts:
        modes.add("valid_counts" if remap_single_tile(case.topk_width) else "compaction")
    if case.call.prefill_workspace:
        modes.add("prefill_workspace")
    if case.idx_mapping is not None:
        modes.add("idx_mapping")
    if case.block_stride_rows and case.block_stride_rows != case.block_size:
        modes.add("block_stride")
    return frozenset(modes or {"plain"})


def call_mode_pins(mode: str, domains: dict[str, tuple[str, ...]]) -> dict[str, str] | None:
    """Pins that put a batch's cases in `mode`. None where this space draws no case in that mode (a space that
    does not turn the knob; compaction without `tile_edge` widths). Valid counts leave the width unpinned, so a
    third of that batch counts on the multi-tile path instead."""
    if mode == "plain":
        return {k: "off" for k in _MODE_FLAGS if k in domains}
    if mode == "compaction":
        return {"valid_counts": "on", "topk_width": "tile_edge"} if "tile_edge" in domains.get("topk_width", ()) \
            and "valid_counts" in domains else None
    return {mode: "on"} if mode in domains else None


def call_mode_partners(mode: str, domains: dict[str, tuple[str, ...]]) -> list[tuple[str, str]]:
    """The categories of other knobs that a case in `mode` can take: the pairs to cover. The knobs that select
    the mode are not partners, and neither is a width that moves a valid-counts case off its tile."""
    own = set(_MODE_FLAGS) if mode == "plain" else set(call_mode_pins(mode, domains) or ())
    return [(k, v) for k, vs in domains.items() if k not in own for v in vs
            if not (mode == "valid_counts" and (k, v) == ("topk_width", "tile_edge"))]


# A pin that only means something with other knobs in some categories (a decode query length needs decodes):
# a swarm that pins the first pins those too, or drops the first where one of them is pinned otherwise.
_PREFILLS = ("prefills", ("one", "several"))
REQUIRES: dict[tuple[str, str | None], tuple[tuple[str, tuple[str, ...] | None], ...]] = {
    ("decode_query_len", None): (("decodes", ("some",)),),
    ("decode_context", None): (("decodes", ("some",)),),
    ("padding_rows", "some"): (("decodes", ("some",)),),
    ("decodes", "none"): (_PREFILLS,),  # a step has at least one request with tokens
    ("prefills", "none"): (("decodes", ("some",)),),
    ("prefill_len", None): (_PREFILLS,),
    ("prefill_context", None): (_PREFILLS,),
    ("pcp_prefill", None): (_PREFILLS,),
    ("prefill_workspace", "on"): (_PREFILLS, ("dcp", ("1",))),
    ("req_id_rows", "full_batch"): (("token_rows", ("decodes",)), _PREFILLS),
    ("token_rows", "decodes"): (("decodes", ("some",)),),
    ("table_layout", "shared_prefix"): (("decode_context", ("long",)),),  # whole cached blocks to share
    ("dcp_rank", None): (("dcp", None),),  # None: any value but "1"
    ("dcp_interleave", None): (("dcp", None),),
    ("fp8_scale", None): (("kv_cache_dtype", ("fp8_ds_mla", "fp8")),),
    ("decode_lengths", None): (("decode_query_len", ("mtp",)),),
    ("window_context", None): (("decodes", ("some",)),),
    ("state_fill", None): (("compress_ratio", ("4", "128", "2")),),
    # V4's "1" is its sliding-window layer: a V4.1 swarm does not pin these two (they are drawn for its ratios 1, 2)
    ("c4_valid", None): (("compress_ratio", ("4",)),),
    ("c4_order", None): (("compress_ratio", ("4",)),),
    ("kv_source", None): (("compress_ratio", ("1", "2")),),
}


def category_share(name: str, value: str, domains: dict[str, tuple[str, ...]], depth: int = 3) -> float:
    """About how often a case drawn with nothing pinned takes `value` of knob `name`: one in its knob's categories,
    times the share of what it requires (REQUIRES; the full-batch req_id_per_token needs the decode rows passed,
    decodes, prefills: 1/2 x 1/2 x 1/2 x 2/3). A category at the end of such a chain is what chance is slowest to
    make in a batch."""
    values = domains.get(name, ())
    share = 1 / len(values) if values else 1.0
    if depth == 0:
        return share
    for other, allowed in REQUIRES.get((name, value)) or REQUIRES.get((name, None)) or ():
        if other not in domains:
            continue
        ok = [v for v in domains[other] if (v in allowed if allowed else v != "1")]
        share *= sum(category_share(other, v, domains, depth - 1) for v in ok)
    return share


def coherent(pins: dict[str, str], domains: dict[str, tuple[str, ...]], rng, keep: set[str] = frozenset()) -> Swarm:
    """A swarm of `pins` whose requirements hold: each pin's requirement is pinned with it (a category `rng`
    picks), and a pin whose requirement is pinned to something else is dropped, unless it is in `keep` (then the
    other one goes)."""
    pins = dict(pins)
    for _ in range(3):  # requirements chain at most twice (req_id_rows -> token_rows -> decodes)
        for name in list(pins):
            needs = REQUIRES.get((name, pins.get(name))) or REQUIRES.get((name, None)) or ()
            for other, allowed in needs:
                if name not in pins or other not in domains:
                    continue
                allowed = tuple(v for v in domains[other] if (v in allowed if allowed else v != "1"))
                if other in pins and pins[other] in allowed:
                    continue
                if allowed and (other not in pins or (name in keep and other not in keep)):
                    pins[other] = rng.choice(allowed)
                else:
                    del pins[name]
    return Swarm(tuple(sorted(pins.items())))
