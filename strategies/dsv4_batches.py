"""Hypothesis strategies for DeepSeek-V4 attention steps (Case.dsv4): what vLLM's FLASHMLA_SPARSE_DSV4 route sees.

A step holds decodes first (MTP: 1 + k tokens each, lengths that may differ, as DSv4's builders split with
require_uniform=False), then prefills (the first longer than 1 + k) with or without cached context, then padding
rows or padding tokens as a full graph pads a batch. Contexts run long relative to the window; the strategy places
chosen tokens where the kernels' edges are: a query whose window starts on an SWA block boundary, a sequence whose
last compressed state is complete, one token short, one token in, or partly filled, a C4 token whose indexer row
holds 0, 1, some or index_topk valid ids. Block tables are permuted or in order, with a spare column or none, and
the SWA blocks wholly behind every window may be back in the pool (the null block 0), as vLLM's sliding-window
manager leaves them. Sizes come from the profile (Profile.dsv4): a CPU step keeps its prefills' gathers short.

Every knob is a swarm knob (strategies.swarm); without a swarm each is drawn uniformly over its categories.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import strategies as st

from strategies.batches import CaseSpace, _domains
from strategies.case import (
    COMPRESS_RATIOS,
    DSV4_BLOCK_SIZE,
    PLAIN_BF16_RECORD,
    PLAIN_RECORDS,
    V41_BLOCK_SIZES,
    V41_COMPRESS_RATIOS,
    V41_SWA_BLOCK_SIZE,
    ROCM_ARCHS,
    Case,
    Dsv4,
    Request,
)
from strategies.profiles import Profile
from strategies.swarm import Swarm, category

SWA_BLOCK_SIZE = 64  # DeepseekV4SWACache's block size (tokens a page of the sliding-window cache)

DSV4_KNOBS = ("compress_ratio", "window_size", "topk_width", "heads", "decodes", "decode_query_len", "decode_lengths",
         "window_context", "padding_rows", "padded_tokens", "prefills", "prefill_context", "window_edge",
         "state_fill", "c4_valid", "c4_order", "attn_sink", "values", "table_layout", "table_last_column", "swa_freed",
              "max_model_len")
# DeepSeek-V4.1 only: its compressed K cache's block (SM90's 64 or 128), and whether the layer owns that cache or
# reads the one of the kv-source layer below it (compressed_cache_prefix).
DSV41_KNOBS = ("compressed_block", "kv_source", "kv_record")


# FlashInfer's SM100 layer (FLASHINFER_MLA_SPARSE_DSV4 / _DSV41): its plain-row caches and the packed KV layout.
FLASHINFER_KNOBS = ("cache_dtype", "page_pad")
ROCM_KNOBS = ("rocm_arch",)  # the ROCm layers' emulated arch
# Rows of other components a packed page holds past a cache's own: none (unpacked), a few, as many again.
PAGE_PADS = {"none": 0, "few": 8, "double": -1}


@dataclass(frozen=True)
class Dsv4Features:
    compress_ratios: tuple[int, ...] = COMPRESS_RATIOS
    version: str = "4"  # "4.1": DeepSeek-V4.1's layer (V41_FEATURES)
    kv_records: tuple[int, ...] = (584,)  # V4.1: also 528 (SM100's MXFP8 record) where the decode kernel reads it
    # FlashInfer's layer: the --kv-cache-dtype values it takes on SM100 (plain rows; Dsv4.cache_dtype), the window it
    # takes (its kernel's fixed 128 SWA columns; None: the profile's), the packed layouts (PAGE_PADS keys).
    cache_dtypes: tuple[str, ...] = ()
    window_sizes: tuple[int, ...] | None = None
    page_pads: tuple[str, ...] = ("none",)
    compressed_blocks: tuple[int, ...] = V41_BLOCK_SIZES  # V4.1: FlashMLA's 64 (SM90) or 128; FlashInfer's 128
    heads: tuple[int, ...] | None = None  # the q heads drawn (None: the profile's)
    mega_attn: bool = False  # FlashMLA's mega-attention layer (Dsv4.mega_attn)
    rocm_archs: tuple[str, ...] = ()  # the ROCm layers: the AMD archs they are emulated on (Dsv4.rocm_arch)
    latent_grid: bool = False  # the latents drawn on the record's values (Dsv4.latent_grid: side-by-side targets)


V41_FEATURES = Dsv4Features(compress_ratios=V41_COMPRESS_RATIOS, version="4.1", kv_records=(584, 528))
# FlashMLA's mega-attention layer (FLASHMLA_MEGA_ATTN_DSV41, SM100): the MXFP8 SWA record, fp8_ds_mla's MXFP8 or
# nvfp4_ds_mla's NVFP4 compressed record, the 128-token kernel block, the 64 heads of TP1.
MEGA_FEATURES = Dsv4Features(compress_ratios=V41_COMPRESS_RATIOS, version="4.1", kv_records=(528,),
                             cache_dtypes=("nvfp4_ds_mla", "fp8_ds_mla"), compressed_blocks=(128,), heads=(64,),
                             mega_attn=True)
FLASHINFER_FEATURES = Dsv4Features(cache_dtypes=("bfloat16", "fp8", "auto", "fp8_e4m3"), window_sizes=(128,),
                                   page_pads=tuple(PAGE_PADS))
# gfx950 (MI355X) and the un-tuned archs, whose decode takes the ops module's fallback kernel: gfx1201 (RDNA4), and
# for V4 gfx1250, where its forward_mqa passes the decode no positions (V4.1's layer reads no gfx1250 flag: as gfx1201)
ROCM_FEATURES = Dsv4Features(rocm_archs=ROCM_ARCHS)
ROCM_V41_FEATURES = replace(V41_FEATURES, kv_records=(584,), rocm_archs=ROCM_ARCHS[:2])
FLASHINFER_V41_FEATURES = replace(V41_FEATURES, kv_records=(584,), cache_dtypes=FLASHINFER_FEATURES.cache_dtypes,
                                  window_sizes=(128,), page_pads=tuple(PAGE_PADS), compressed_blocks=(128,))


def dsv4_knobs(p: Profile, f: Dsv4Features) -> dict[str, tuple[str, ...]]:
    s = p.dsv4
    names = DSV4_KNOBS + (DSV41_KNOBS if f.version == "4.1" else ()) + (FLASHINFER_KNOBS if f.cache_dtypes else ())
    names += ROCM_KNOBS if f.rocm_archs else ()
    if f.cache_dtypes and all(d in PLAIN_RECORDS for d in f.cache_dtypes):  # plain rows: the record follows the dtype
        names = tuple(n for n in names if n != "kv_record")
    if f.cache_dtypes and not any(d in PLAIN_RECORDS for d in f.cache_dtypes):  # packed records: no page padding
        names = tuple(n for n in names if n != "page_pad")
    return _domains(names, compress_ratio=map(str, f.compress_ratios),
                    window_size=map(str, f.window_sizes or s.window_sizes),
                    topk_width=map(str, s.topk_widths), heads=map(str, f.heads or s.heads),
                    table_layout=("arange", "permuted"),
                    compressed_block=map(str, f.compressed_blocks), kv_record=map(str, f.kv_records),
                    cache_dtype=f.cache_dtypes, page_pad=f.page_pads, rocm_arch=f.rocm_archs)


def dsv4_space(p: Profile, f: Dsv4Features) -> CaseSpace:
    knobs = dsv4_knobs(p, f)
    return CaseSpace(lambda swarm: dsv4_cases(p, f, knobs, swarm), knobs)


@st.composite
def dsv4_cases(draw, p: Profile, f: Dsv4Features, knobs: dict[str, tuple[str, ...]],
               swarm: Swarm | None = None) -> Case:
    s, swarm = p.dsv4, swarm or Swarm()

    def c(name: str) -> str:
        return category(draw, swarm, name, knobs[name])

    ratio, w = int(c("compress_ratio")), int(c("window_size"))
    topk, heads = int(c("topk_width")), int(c("heads"))
    v41 = f.version == "4.1"
    bs = V41_SWA_BLOCK_SIZE if v41 else SWA_BLOCK_SIZE
    compressed = ratio > (0 if v41 else 1)  # Dsv4.compressed
    indexed = ratio == 4 or (v41 and ratio in (1, 2))  # Dsv4.indexed
    block = int(c("compressed_block")) if v41 else DSV4_BLOCK_SIZE
    k = draw(st.integers(1, s.max_speculative)) if c("decode_query_len") == "mtp" else 0
    threshold = 1 + k
    mixed = bool(k) and c("decode_lengths") == "mixed"

    def prefill_cap(q: int) -> int:  # the longest sequence a prefill of q tokens may have (its gathers' cost)
        cap = q + s.max_prefill_context
        return min(cap, (s.max_prefill_compressed + 1) * ratio - 1) if compressed else cap

    budget, reqs = s.max_tokens, []
    n_dec = draw(st.integers(1, s.max_decodes)) if c("decodes") == "some" else 0
    if mixed and n_dec:  # at least two decodes, not all of one length
        n_dec = min(max(n_dec, 2), s.max_decodes)
        lengths = [draw(st.integers(1, threshold)) for _ in range(n_dec)]
        if len(set(lengths)) == 1:
            lengths[-1] = lengths[0] % threshold + 1
    for j in range(n_dec):
        q = lengths[j] if mixed else threshold
        if q > budget:
            break
        lo, hi = {"short": (q, w), "near": (w + 1, w + 2 * bs), "long": (w + 2 * bs + 1, s.max_context)}[c("window_context")]
        reqs.append(Request(q, draw(st.integers(max(lo, q), max(lo, q, hi))) - q))
        budget -= q
    num_decodes = len(reqs)
    many = c("prefills")
    count = {"none": 0, "one": 1, "several": draw(st.integers(min(2, s.max_prefills), s.max_prefills))}[many]
    if not reqs:
        count = max(count, 1)
    for j in range(count):
        lo = threshold + 1 if j == 0 else 1  # vLLM's split: the first prefill is longer than a decode
        if budget < lo:
            break
        q = draw(st.integers(lo, budget))
        cached = c("prefill_context") == "cached" and prefill_cap(q) > q
        reqs.append(Request(q, draw(st.integers(1, prefill_cap(q) - q)) if cached else 0))
        budget -= q
    if not reqs:  # no budget for the prefill a decode-less step needs
        reqs.append(Request(threshold + 1, 0))
    if num_decodes == len(reqs) and c("padding_rows") == "some":  # a padded decode-only batch: all decodes
        reqs += [Request(0, 0)] * draw(st.integers(1, 2))
        num_decodes = len(reqs)

    def cap(i: int) -> int:
        return s.max_context + reqs[i].query_len if i < num_decodes else prefill_cap(reqs[i].query_len)

    def place(i: int, position: int) -> None:
        """Request i's context such that one of its tokens sits at `position` (its last one where it can)."""
        r = reqs[i]
        if r.query_len and 0 <= position < cap(i):
            reqs[i] = Request(r.query_len, max(0, position - r.query_len + 1))

    live = [i for i, r in enumerate(reqs) if r.query_len]
    if c("window_edge") == "boundary":  # a query's window starts at a block boundary: position m * bs + w - 1
        i = live[0]
        m = draw(st.integers(1, max(1, (cap(i) - w) // bs)))
        place(i, m * bs + w - 1)
    if ratio > 1:
        fill = c("state_fill")
        i = live[-1]
        m = draw(st.integers(1, max(1, cap(i) // ratio)))
        delta = {"full": 0, "one_before": -1, "one_after": 1,
                 "partial": min(draw(st.integers(2, max(2, ratio - 2))), ratio - 1)}[fill]
        place(i, m * ratio + delta - 1)  # the sequence (its last token + 1) ends there
    if indexed:  # an indexer row with n = min((p + 1) // ratio, topk) valid ids: p's range for each n
        valid = c("c4_valid")
        i = live[len(live) // 2]
        r_ = ratio
        lo, hi = {"zero": (0, r_ - 2), "one": (r_ - 1, 2 * r_ - 2), "some": (2 * r_ - 1, r_ * topk - 2),
                  "all": (r_ * topk - 1, r_ * topk + 64)}[valid]
        if lo <= hi:  # ratio 1 has no position whose row is empty
            place(i, draw(st.integers(lo, hi)))

    # Block tables: the SWA cache's (blocks of bs tokens), and the compressed K cache's (blocks of `block` tokens).
    permuted = c("table_layout") == "permuted"
    spare = c("table_last_column") == "spare"
    freed = c("swa_freed") == "freed"
    swa_needed = [-(-r.seq_len // bs) for r in reqs]
    swa_first = [max(0, r.context_len - w + 1) // bs if freed and r.query_len else 0 for r in reqs]
    swa = _table(draw, [range(a, b) for a, b in zip(swa_first, swa_needed)], swa_needed, spare, permuted)
    comp = ()
    if compressed:
        needed = [-(-r.seq_len // block) for r in reqs]
        comp = _table(draw, [range(n) for n in needed], needed, spare, permuted)
    longest = max(r.seq_len for r in reqs)
    max_model_len = longest + draw(st.integers(0, 64)) if c("max_model_len") == "tight" else 0
    plain: dict = {}
    packed: dict = {}
    dtype = c("cache_dtype") if f.cache_dtypes else "fp8_ds_mla"
    if dtype in PLAIN_RECORDS:  # FlashInfer's plain rows, each cache's pages unpacked or packed
        pad = PAGE_PADS[c("page_pad")]
        plain = dict(cache_dtype=dtype, kv_record=PLAIN_RECORDS[dtype],
                     page_pad=bs if pad < 0 else pad)
    elif dtype != "fp8_ds_mla":  # nvfp4_ds_mla: V4.1's NVFP4 compressed record beside the MXFP8 SWA one
        packed = dict(cache_dtype=dtype)
    rocm = {"rocm_arch": c("rocm_arch")} if f.rocm_archs else {}
    kv_cache_dtype = (dtype if packed else "fp8_ds_mla" if not plain else
                      "bfloat16" if plain["kv_record"] == PLAIN_BF16_RECORD else "fp8")
    case = Case(
        requests=tuple(reqs), num_decodes=num_decodes, block_size=bs, block_table=swa, topk_width=topk, topk=(),
        heads=heads, kv_cache_dtype=kv_cache_dtype, values=c("values"), seed=draw(st.integers(0, 2**16)),
        padded_tokens=draw(st.integers(1, 4)) if c("padded_tokens") == "some" else 0,
        dsv4=Dsv4(compress_ratio=ratio, window_size=w, compressed_block_table=comp, num_speculative_tokens=k,
                  c4_order=c("c4_order") if indexed else "scored", attn_sink=c("attn_sink"),
                  max_model_len=max_model_len, **(dict(version="4.1", compressed_block_size=block,
                                                       kv_source=c("kv_source") if compressed else "own",
                                                       **({} if plain else {"kv_record": int(c("kv_record"))}))
                                                  if v41 else {}), **plain, **packed, **rocm,
                  **({"mega_attn": True} if f.mega_attn else {})),
    )
    d = case.dsv4
    # The ROCm layers read the 584-byte record only: a side-by-side step of V4.1's 528-byte one drops the arch it drew
    # (drawn anyway, so that the single-backend targets' cases keep their draws).
    if d.kv_record != 584 and d.rocm_arch:
        d = replace(d, rocm_arch="")
    if f.latent_grid and not plain:
        d = replace(d, latent_grid=d.kv_record)
    return replace(case, dsv4=d).validate()


def _table(draw, held: list[range], needed: list[int], spare: bool, permuted: bool) -> tuple[tuple[int, ...], ...]:
    """Rows of block ids (from 1; 0 is the null block): row i holds ids in the columns of `held[i]`, 0 elsewhere."""
    total = sum(len(h) for h in held)
    ids = list(range(1, total + 1))
    if permuted and total > 1:
        ids = [i + 1 for i in draw(st.permutations(range(total)))]
    width = max(max(needed, default=0), 1) + (1 if spare else 0)
    rows, k = [], 0
    for h in held:
        row = [0] * width
        for col in h:
            row[col] = ids[k]
            k += 1
        rows.append(tuple(row))
    return tuple(rows)


def dsv4_form(case: Case, fields: dict) -> Case:
    """`case` as one backend of a side-by-side target takes the step: the fields `fields` names set (Case's own, such
    as kv_cache_dtype, or the step's Dsv4 ones, such as cache_dtype and rocm_arch). The target runs the backend on
    it and the oracle judges the backend's part on it (the part's notes["case_fields"])."""
    own = {k: v for k, v in fields.items() if k in Case.__dataclass_fields__}
    step = {k: v for k, v in fields.items() if k not in own}
    return replace(case, **own, dsv4=replace(case.dsv4, **step)).validate()
