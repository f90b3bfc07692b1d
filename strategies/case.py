"""The case: one step of a sparse-MLA backend, as plain data, with the steps one engine ran before it.

A case says what the backend sees (requests in vLLM's batch order, the block table, how each query row
picks its top-k, dtypes, DCP split) and, for kernel targets, how the call site calls the kernel. It holds
no tensors: `strategies.tensors` builds them from it deterministically, on any device. Cases are frozen,
compare by value and round-trip through JSON; `Case.from_dict` names the field that is wrong.

A trace is a case whose `earlier` holds the steps the same engine ran before it, oldest first: one builder,
one impl, one KV cache and one set of persistent buffers across them, as vLLM's model runner keeps them. An
earlier step is a case of its own (same engine fields, no `earlier` of its own); `Case.steps` gives every
step with its history, and `strategies.tensors` gives each the cache contents its history wrote. A case
without earlier steps is one fresh step, as before.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from strategies.errors import CaseError  # noqa: F401 (re-exported: `from strategies.case import CaseError`)

SCHEMA = 1
# "fp8": vLLM's per-tensor fp8 (e4m3) cache, [576] bytes a token, both parts divided by the layer's k_scale (the
# kv-cache dtype FLASHINFER_MLA_SPARSE_SM90 takes; FLASHMLA_SPARSE turns "fp8" into fp8_ds_mla instead).
# "nvfp4_ds_mla": SM100's NVFP4 entry (DeepSeek-V3.2: 352 bytes a token; DeepSeek-V4.1: the MXFP8 sliding-window record
# with a 288-byte NVFP4 compressed record).
KV_CACHE_DTYPES = ("bfloat16", "fp8_ds_mla", "fp8", "nvfp4_ds_mla")
# Writer/reader scale conventions (bug class K). fp8_ds_mla: the entries' tile scales (powers of two, arbitrary
# fp32, or powers of two a reader truncates to e8m0). "fp8": the layer's per-tensor k_scale, pow2 = 1.0 (vLLM's
# default, no scale in the checkpoint), arbitrary = a checkpoint's calibrated scale (strategies.tensors.fp8_kv_scale).
FP8_SCALES = ("pow2", "arbitrary", "e8m0_trunc")
FP8_PER_TENSOR_SCALES = ("pow2", "arbitrary")
VALUE_KINDS = ("normal", "large", "tiny", "zero_tiles")
INVALID_AT = ("tail", "head", "scattered", "leading_tiles")
# Which visible positions a row's valid entries are: any (spread), or the newest ones, as an indexer that
# favours the local window picks them (recent: every row then selects the last slots of its block table).
TOPK_PICKS = ("spread", "recent")
CUDAGRAPH_MODES = ("none", "full")  # vLLM's CUDAGraphMode for the attention: NONE (eager) or FULL
TOKEN_ROWS = ("all", "decodes")  # which rows of topk_indices the call site passes
REQ_ID_ROWS = ("match", "full_batch")  # req_id_per_token sliced like topk_indices, or the whole batch's
MAX_DECODE_QUERY_LEN = 4  # uniform decodes incl. MTP (1 + up to 3 draft tokens)
# DeepSeek-V4 (Case.dsv4): compress ratios (1: sliding window only, 4: C4A with the indexer's top-k, 128: C128A over
# every compressed entry), how the indexer orders a C4 row's valid ids, and what the layer's attention sink holds.
COMPRESS_RATIOS = (4, 128, 1)
# DeepSeek-V4.1 (Dsv4.version "4.1"): 0 sliding window only, 1 a full-length compressed cache, 2 one compressed entry
# per two tokens; both compressed kinds attend over the indexer's top-k (vllm/models/deepseek_v41/sparse_mla.py).
V41_COMPRESS_RATIOS = (1, 2, 0)
DSV4_VERSIONS = ("4", "4.1")
# V4.1's compressed K cache block: the backend's kernel block size, 64 on SM90 and 128 elsewhere
# (DeepseekV4SparseMLABackend.get_supported_kernel_block_sizes); its SWA cache's is 32 (DeepseekV4Attention).
V41_BLOCK_SIZES = (64, 128)
V41_SWA_BLOCK_SIZE = 32
# Dsv4.rocm_arch: the archs the ROCm DeepSeek-V4 layers can be emulated on (all with OCP e4m3 caches): gfx950,
# and the un-tuned gfx1201 and gfx1250 (the decode's fallback kernel)
ROCM_ARCHS = ("gfx950", "gfx1201", "gfx1250")
C4_ORDERS = ("scored", "ascending")  # top_k_per_row by score (any order), or the short-context fill's 0, 1, 2, ...
ATTN_SINKS = ("finite", "none", "large")  # weights of order 1, -inf (no sink: make_attention_sink's init), ~ +6
# The indexer (Case.indexer): the sparse_indexer_topk_backend values vLLM 0.33.0 resolves on an SM90 CUDA host
# ("auto": cooperative for <= 64 rows, then persistent for widths 512/1024/2048, else per_row; "torch": its
# Python reference; deep_select / aiter / flashinfer need SM100, ROCm or FlashInfer's top-k).
INDEXER_TOPK_BACKENDS = ("auto", "per_row", "persistent", "cooperative", "torch")
# An explicit "cooperative" refuses a decode batch of more rows than this (vLLM raises at the step: a configuration
# error, not a bug to find; indexer_topk.py AUTO_COOPERATIVE_MAX_ROWS); "auto" goes on to persistent there.
COOPERATIVE_MAX_ROWS = 64
INDEXER_MAX_SPECULATIVE = 3  # MTP draft tokens: next_n 1-4 (SM90's paged logits take 1, 2, 4 natively; 3 flattens)
PLAIN_BF16_RECORD, PLAIN_FP8_RECORD = 1024, 512  # a DeepSeek-V4 plain-row cache's bytes a token (512 values)
PLAIN_RECORDS = {"auto": PLAIN_BF16_RECORD, "bfloat16": PLAIN_BF16_RECORD, "fp8": PLAIN_FP8_RECORD,
                 "fp8_e4m3": PLAIN_FP8_RECORD}
DSV4_CACHE_DTYPES = ("fp8_ds_mla", "nvfp4_ds_mla", *PLAIN_RECORDS)
V41_NVFP4_RECORD = 288  # V4.1's NVFP4 compressed record (nvfp4_ds_mla; the SWA cache keeps the 528-byte one)
DSV4_BLOCK_SIZE = 256  # tokens a block of the compressed K cache covers (the backend's kernel block size)
DSV4_MAX_SPECULATIVE = 7


@dataclass(frozen=True)
class Request:
    query_len: int  # tokens scheduled this step; 0 = a padding row (CUDA-graph padding)
    context_len: int  # tokens already in the KV cache (computed earlier or a prefix-cache hit)

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len


@dataclass(frozen=True)
class TopkSpec:
    """How the indexer fills each query row of one request (topk_indices are request-local positions)."""

    valid: int  # wanted in-sequence, causally visible positions per row (capped by what is visible)
    invalid_at: str = "tail"  # where the -1 entries sit: tail, head, scattered, or whole leading 16-wide tiles
    past_seq: int = 0  # entries >= seq_len whose block is still inside the block table
    past_table: int = 0  # entries whose block lies beyond the block table's width
    pick: str = "spread"  # which visible positions the valid entries are (TOPK_PICKS)


@dataclass(frozen=True)
class Dcp:
    size: int = 1  # decode-context-parallel world size
    rank: int = 0  # the rank whose view the call computes
    interleave: int = 1  # cp_kv_cache_interleave_size: tokens per rank-group
    # Prefill context parallelism (PCP) with DCP: `pcp` ranks each take two head-tail chunks of every prefill
    # long enough to split (the others every rank whole), `tp` TP ranks each (the world: pcp x tp ranks, the
    # step's heads split over the TP ranks). DCP spans the PCP ranks (size == pcp) or all of them (pcp * tp),
    # as vLLM's ParallelConfig allows; size 1: PCP alone (every rank holds the whole cache, decodes sharded over
    # the PCP ranks). pcp 1: DCP alone, which reuses the TP ranks (tp unused, 1); or, with size 1, TP alone: `tp`
    # ranks each holding the whole cache and its share of the heads (the world ShardQ splits prefill tokens over).
    pcp: int = 1
    tp: int = 1

    @property
    def layout(self) -> str:
        """The PCP x DCP (x TP) layout's name: pcp2.dcp4, pcp2.dcp2.tp2, ... ("dcp<size>" without PCP)."""
        if self.pcp == 1:
            return f"tp{self.tp}" if self.tp > 1 else f"dcp{self.size}"
        if self.size == 1:
            return f"pcp{self.pcp}" + (f".tp{self.tp}" if self.tp > 1 else "")
        return f"pcp{self.pcp}.dcp{self.size}" + (f".tp{self.tp}" if self.tp > 1 and self.size == self.pcp else "")

    @property
    def tp_ranks(self) -> int:
        """The TP ranks the step's heads are split over: DCP alone reuses its ranks as TP ranks; under PCP (or TP
        alone), `tp`."""
        return self.tp if self.pcp > 1 or self.tp > 1 else self.size


@dataclass(frozen=True)
class IndexCall:
    """How a call site invokes the index kernels (kernel targets only)."""

    valid_counts: bool = False  # return_valid_counts (and compaction where the release compacts)
    prefill_workspace: bool = False  # HAS_PREFILL_WORKSPACE: prefill rows map into a gathered workspace
    token_rows: str = "all"  # "decodes": only the MQA subset of topk_indices is passed
    req_id_rows: str = "match"  # "full_batch": req_id_per_token not sliced (the call site of vLLM PR 47327)

    @property
    def breaks_row_contract(self) -> bool:
        return self.token_rows == "decodes" and self.req_id_rows == "full_batch"


@dataclass(frozen=True)
class Dsv4:
    """A DeepSeek-V4 attention step (vLLM's FLASHMLA_SPARSE_DSV4 route): `Case.block_size` and `Case.block_table`
    are the sliding-window (SWA) cache's, `Case.topk_width` the indexer's index_topk, `Case.topk` empty (the
    indexer's rows follow from positions: a C4 token at position p holds min((p + 1) // 4, index_topk) distinct
    compressed ids, valid ids first), `Case.kv_cache_dtype` fp8_ds_mla (the 584-byte V4 record)."""

    compress_ratio: int = 4  # 1 (SWA only), 4 (C4A) or 128 (C128A)
    window_size: int = 128  # sliding_window: the newest tokens each query attends to, itself included
    # Per request (Case.table_row), the compressed K cache's blocks of DSV4_BLOCK_SIZE tokens (256 // ratio
    # compressed entries each); empty for ratio 1, which has no compressed cache.
    compressed_block_table: tuple[tuple[int, ...], ...] = ()
    # MTP draft tokens: a decode is one of the leading requests of query_len <= 1 + k (lengths may differ; vLLM's
    # DSv4 builders split with require_uniform=False).
    num_speculative_tokens: int = 0
    c4_order: str = "scored"
    attn_sink: str = "finite"
    # The engine's max_model_len (0: the harness's default, far past any context): it sizes the C128A top-k rows
    # and bounds the prefill workspace a chunk may take (the chunk plan), so a tight one packs prefills apart.
    max_model_len: int = 0
    # "4.1": DeepSeek-V4.1's layer (FLASHMLA_SPARSE_DSV41), ratios V41_COMPRESS_RATIOS, its compressed K cache in
    # blocks of `compressed_block_size` tokens; "4": DeepSeek-V4's, blocks of DSV4_BLOCK_SIZE.
    version: str = "4"
    compressed_block_size: int = DSV4_BLOCK_SIZE
    # V4.1: "own", the layer is its compressed cache's kv source; "shared", it reads the cache (and the metadata
    # keyed by its prefix) of the kv-source layer below it, as V4.1's kv_source_layer_ids share one.
    kv_source: str = "own"
    # The bytes a cache record takes: 584, V4's record (V4.1 off SM100 too); 528, V4.1's MXFP8 record, which its
    # layer writes on SM100 (`_use_v41_mxfp8_kv_record`), interleaved: each token's scales after its data.
    kv_record: int = 584
    # The engine's --kv-cache-dtype as the layer resolves it (_resolve_dsv4_kv_cache_dtype): "fp8_ds_mla" (FlashMLA's
    # layouts above); FlashInfer's SM100 layer (FLASHINFER_MLA_SPARSE_DSV4/_DSV41) stores plain rows: "auto" and
    # "bfloat16" a bf16 row (kv_record PLAIN_BF16_RECORD), "fp8" and "fp8_e4m3" a per-tensor e4m3 row
    # (PLAIN_FP8_RECORD, k_scale 1.0, Case.kv_cache_dtype "fp8").
    cache_dtype: str = "fp8_ds_mla"
    # Rows of other components a page holds after this cache's (0: none): vLLM's packed KV layout (#44577) puts a
    # block's KV components in one allocation, so each cache's per-block stride spans block + pad rows.
    page_pad: int = 0
    # V4.1 on FlashMLA's mega-attention layer (FLASHMLA_MEGA_ATTN_DSV41, SM100): q reaches the kernel unroped (it
    # applies GPT-J RoPE to the last 64 dims at each token's position), and the output leaves it inverse-roped and
    # cast to MXFP8; the case's q is the unroped one.
    mega_attn: bool = False
    # The AMD arch a ROCm layer (ROCM_FLASHMLA_SPARSE_DSV4/_DSV41) is emulated on, "" for the NVIDIA layers: the ROCm
    # layer's forward_mqa hands its output on inverse-RoPE'd (ROCM_ARCHS; the 584-byte record only).
    rocm_arch: str = ""
    # The record whose values the latents are drawn on (0: bf16 as drawn; 584 or 528: each latent rounded to what that
    # record holds of it, its decoding): caches of other formats (a plain bf16 row, the same record written again) then
    # hold exactly the same keys, so backends that store the step differently attend over the same values
    # (`vllm.dsv4.all`, `vllm.dsv41.all`).
    latent_grid: int = 0
    # The mega layer's q is the drawn q with its RoPE taken back out (GPT-J, theta 10000, rounded to bf16): the kernel's
    # own roping gives back the q the other layers take, within a bf16 rounding of the last 64 dims.
    q_rope_removed: bool = False

    @property
    def entries_per_block(self) -> int:
        """Compressed entries a block of the compressed K cache holds; 0 for V4.1's sliding-window layer (ratio 0)."""
        return self.compressed_block_size // self.compress_ratio if self.compress_ratio else 0

    @property
    def compressed_record(self) -> int:
        """The compressed K cache's record: V4.1's 288-byte NVFP4 one under nvfp4_ds_mla, else the SWA cache's."""
        return V41_NVFP4_RECORD if self.cache_dtype == "nvfp4_ds_mla" else self.kv_record

    @property
    def compressed(self) -> bool:
        """The layer reads a compressed K cache: V4's ratios 4 and 128, V4.1's 1 and 2."""
        return self.compress_ratio > (0 if self.version == "4.1" else 1)

    @property
    def indexed(self) -> bool:
        """The layer's compressed keys are the indexer's top-k rows (C4A; V4.1's C1A and C2A), not every entry."""
        return self.compress_ratio == 4 or (self.version == "4.1" and self.compress_ratio in (1, 2))


@dataclass(frozen=True)
class IndexerStep:
    """A DeepSeek-V3.2 / GLM-5 indexer step (`vllm.indexer`): the indexer makes every request's top-k rows itself
    (Case.topk is empty), over `Case.heads` index heads of 128 dims, into a persistent buffer Case.topk_width wide."""

    topk_backend: str = "auto"  # kernel_config.sparse_indexer_topk_backend
    num_speculative_tokens: int = 0  # MTP: the builder's decode threshold is 1 + this
    # VLLM_SPARSE_INDEXER_MAX_LOGITS_MB (vLLM's default 512): the builder's prefill chunks hold at most this many MB
    # of fp32 logits; 0 puts every request in a chunk of its own, one query row per sub-chunk
    max_logits_mb: int = 512
    # DeepSeek-V3.2's attention module around the indexer (`vllm.dsv32.attention`): its MLA heads per rank (0: the
    # indexer alone), and whether a second layer with no indexer of its own (skip_topk) attends with the first's top-k
    attention_heads: int = 0
    skip_topk_layer: bool = False
    # The SMs DeepGEMM's paged logits are scheduled over (the builder's num_compute_units and DeepGEMM's
    # set_num_sms): 0 the device's (an H100/H200's 132; the CPU's stand-ins model one). Fewer give each SM's share
    # several requests at steps a CPU affords, so its traversal crosses request boundaries there too.
    num_sms: int = 0
    # ShardQ (0.34+: TP ranks split a prefill step's tokens, `dcp.tp` of them): attention_config's
    # sparse_mla_shard_q_min_tokens, the fewest prefill tokens a step splits (0: vLLM's default, 1024)
    shardq_min_tokens: int = 0


# Step5's DSA (Case.step5, vLLM's STEP5_DSA backend): query heads per KV group its kernels take, indexer heads per
# group (sparse_indexer_num_heads / index_tp_size, which Step5's config allows as 2 or 4; the model pads them to 8),
# block sizes (multiples of the 8-token region; 16-128 as its prefill pages need).
STEP5_Q_HEADS_PER_KV = (4, 8, 16)
STEP5_INDEX_HEADS = (4, 2)
STEP5_BLOCK_SIZES = (16, 32, 64, 128)
STEP5_MAX_STEPS = 16


@dataclass(frozen=True)
class Step5:
    """A Step5 DSA attention step (vLLM's STEP5_DSA: `vllm/models/step5/nvidia/sparse_attention.py`): GQA attention
    of head size 192 over the tokens of selected 8-token regions. Every request is a decode of one token (the
    backend's uniform-batch route), then `Case.padded_tokens` padding rows of one token each as a full CUDA graph
    pads a decode batch (slot -1, an all-null block-table row, seq_len 0); `Case.heads` is the rank's query heads
    (groups x heads per group),
    `Case.topk_width` unused (128), `Case.topk` empty (the backend's own indexer selects regions)."""

    groups: int = 1  # KV heads per rank: the layer's KV groups, each with its own indexer rows
    index_heads: int = 4  # real indexer query heads per group (the model pads the rest of 8 with zeros)
    region_topk: int = 8  # sparse_config.topk: closed regions each query keeps by indexer score, plus its own open region
    steps: int = 1  # decode steps one engine runs, each request one token on per step; the case is the last
    # The model's decode call form: with a fused summary update and a headwise gate it defers the inactive-row
    # clear to the gated write (Step5SparseAttention.forward); the impl then clears in the attention kernel.
    defer_inactive_clear: bool = False
    # "distinct": every region's indexer keys drawn apart; "ties": some closed regions repeat another's keys and z
    # (equal summaries, so equal scores at the top-k cutoff: the selection breaks ties by region order)
    regions: str = "distinct"


@dataclass(frozen=True)
class Case:
    requests: tuple[Request, ...]
    num_decodes: int  # the leading requests that are decodes (uniform query_len, padding rows allowed)
    block_size: int
    block_table: tuple[tuple[int, ...], ...]  # physical block ids per row; 0 is the null block
    topk_width: int  # index_topk: a multiple of 128
    topk: tuple[TopkSpec, ...]  # one per request
    block_stride_rows: int = 0  # physical rows between blocks; 0 means block_size
    idx_mapping: tuple[int, ...] | None = None  # request -> block_table row (persistent block table)
    dcp: Dcp = field(default_factory=Dcp)
    call: IndexCall = field(default_factory=IndexCall)
    heads: int = 16  # query heads per rank
    kv_cache_dtype: str = "bfloat16"
    fp8_scale: str = "pow2"
    values: str = "normal"
    seed: int = 0
    # Tokens past the last request, as a full CUDA graph pads a uniform decode batch: vLLM's model runner
    # gives each padding row (query_len 0) the decode query length in tokens that belong to no request,
    # counts them in num_actual_tokens, gives them slot -1 and its indexer no valid index.
    padded_tokens: int = 0
    earlier: tuple["Case", ...] = ()  # steps the same engine ran before this one, oldest first (a trace)
    # The engine's CUDA-graph mode (vLLM's CUDAGraphMode): "full" captures the decode forward at start-up and
    # replays it for every uniform decode step (`replays_graph`); other steps run eagerly.
    cudagraph: str = "none"
    # An MTP draft step (vLLM's speculator, fused multi-step decode): the engine ran it on the step before's
    # metadata, its runner inputs advanced in place (each request one position on: seq_lens + 1, its new slot)
    # and the builder's `update_draft_decode_metadata` (or, for a builder without it, a rebuild). The step
    # before is a decode of one token per request; this one holds the same requests one token later.
    mtp_draft: bool = False
    dsv4: Dsv4 | None = None  # a DeepSeek-V4 step (see Dsv4); None: a DeepSeek-V3.2-style sparse-MLA step
    indexer: IndexerStep | None = None  # an indexer step (see IndexerStep); None: the top-k rows are drawn
    step5: Step5 | None = None  # a Step5 DSA step (see Step5); None: a sparse-MLA step
    schema: int = SCHEMA

    # -- derived ---------------------------------------------------------------------------------------
    @property
    def stride_rows(self) -> int:
        return self.block_stride_rows or self.block_size

    @property
    def num_tokens(self) -> int:
        return sum(r.query_len for r in self.requests)

    @property
    def num_actual_tokens(self) -> int:
        """Rows of the step's q, top-k and output as the backend sees them: the requests' tokens + padding."""
        return self.num_tokens + self.padded_tokens

    @property
    def num_decode_tokens(self) -> int:
        return sum(r.query_len for r in self.requests[: self.num_decodes])

    @property
    def num_blocks(self) -> int:
        return 1 + max((b for row in self.block_table for b in row), default=0)

    @property
    def steps(self) -> tuple["Case", ...]:
        """Every step of the trace, oldest first, each holding the steps before it; the last is this case."""
        return (*(dataclasses.replace(e, earlier=self.earlier[:k]) for k, e in enumerate(self.earlier)), self)

    @property
    def pool_blocks(self) -> int:
        """Blocks of the KV cache the whole trace uses (the cache is allocated once for every step)."""
        return max(c.num_blocks for c in (*self.earlier, self))

    @property
    def replays_graph(self) -> bool:
        """Whether a full-graph engine replays this step: a uniform decode batch (every request with tokens a
        decode of one query length, padding rows after them), which vLLM's dispatcher sends to a FULL graph for
        a builder of UNIFORM_BATCH support; the graph's size is num_actual_tokens."""
        return (self.cudagraph == "full" and self.num_decodes == len(self.requests) and self.num_tokens > 0
                and len({r.query_len for r in self.requests if r.query_len}) == 1)

    def token_start(self, req: int) -> int:
        """Index of request `req`'s first query token in the batch."""
        return sum(r.query_len for r in self.requests[:req])

    def table_row(self, req: int) -> int:
        return self.idx_mapping[req] if self.idx_mapping is not None else req

    def summary(self) -> str:
        def req(i, r):
            topk = _nondefault(self.topk[i]) if i < len(self.topk) else ""
            return f"{'D' if i < self.num_decodes else 'P'}(q={r.query_len},ctx={r.context_len}{',' + topk if topk else ''})"

        reqs = " ".join(req(i, r) for i, r in enumerate(self.requests))
        extra = []
        if self.dcp.pcp > 1:
            extra.append(f"pcp={self.dcp.pcp}/dcp={self.dcp.size}/tp={self.dcp.tp}/i{self.dcp.interleave}")
        elif self.dcp.size > 1:
            extra.append(f"dcp={self.dcp.size}/r{self.dcp.rank}/i{self.dcp.interleave}")
        elif self.dcp.tp > 1:
            extra.append(f"tp={self.dcp.tp}")
        if self.call != IndexCall():
            extra.append(f"call={_nondefault(self.call)}")
        if self.padded_tokens:
            extra.append(f"padded_tokens={self.padded_tokens}")
        if self.cudagraph != "none":
            extra.append(f"cudagraph={self.cudagraph}{' (replayed)' if self.replays_graph else ''}")
        if self.mtp_draft:
            extra.append("mtp_draft")
        if self.dsv4 is not None:
            d = self.dsv4
            extra.append(f"dsv{d.version}: compress_ratio={d.compress_ratio} window={d.window_size} heads={self.heads}"
                         + (f" mtp={d.num_speculative_tokens}" if d.num_speculative_tokens else "")
                         + (f" c4_order={d.c4_order}" if d.indexed else "") + f" attn_sink={d.attn_sink}"
                         + (f" max_model_len={d.max_model_len}" if d.max_model_len else "")
                         + (f" block={d.compressed_block_size} kv_source={d.kv_source} record={d.kv_record}"
                            if d.version == "4.1" else "")
                         + (f" kv={d.cache_dtype}" if d.cache_dtype != "fp8_ds_mla" else "")
                         + (f" page_pad={d.page_pad}" if d.page_pad else "")
                         + (" mega_attn" if d.mega_attn else "")
                         + (f" rocm={d.rocm_arch}" if d.rocm_arch else "")
                         + (f" grid={d.latent_grid}" if d.latent_grid else "")
                         + (" q_rope_removed" if d.q_rope_removed else ""))
        if self.indexer is not None:
            x = self.indexer
            extra.append(f"indexer: heads={self.heads} topk_backend={x.topk_backend}"
                         + (f" mtp={x.num_speculative_tokens}" if x.num_speculative_tokens else "")
                         + (f" max_logits_mb={x.max_logits_mb}" if x.max_logits_mb != 512 else "")
                         + (f" attention_heads={x.attention_heads}" if x.attention_heads else "")
                         + (" skip_topk_layer" if x.skip_topk_layer else "")
                         + (f" sms={x.num_sms}" if x.num_sms else "")
                         + (f" shardq_min_tokens={x.shardq_min_tokens}" if x.shardq_min_tokens else ""))
        if self.step5 is not None:
            x = self.step5
            extra.append(f"step5: groups={x.groups} heads/group={self.heads // x.groups} index_heads={x.index_heads} "
                         f"region_topk={x.region_topk} steps={x.steps} kv={self.kv_cache_dtype}"
                         + (f" fp8_scale={self.fp8_scale}" if self.kv_cache_dtype == "fp8" else "")
                         + (" defer_inactive_clear" if x.defer_inactive_clear else "")
                         + (" regions=ties" if x.regions == "ties" else ""))
        if self.earlier:
            extra.append(f"after {len(self.earlier)} earlier step(s) of {'/'.join(str(e.num_tokens) for e in self.earlier)} tokens")
        return f"[{reqs}] topk={self.topk_width} block={self.block_size} {' '.join(extra)}".strip()

    # -- validation ------------------------------------------------------------------------------------
    def validate(self) -> "Case":
        _check(self.schema == SCHEMA, "schema", f"unsupported schema {self.schema}, this attnfuzz reads {SCHEMA}")
        for i, r in enumerate(self.requests):
            _check(r.query_len >= 0, f"requests[{i}].query_len", f"must be >= 0, got {r.query_len}")
            _check(r.context_len >= 0, f"requests[{i}].context_len", f"must be >= 0, got {r.context_len}")
        n = len(self.requests)
        _check(0 <= self.num_decodes <= n, "num_decodes", f"must be in [0, {n}], got {self.num_decodes}")
        dq = {r.query_len for r in self.requests[: self.num_decodes] if r.query_len > 0}
        if self.dsv4 is None:
            _check(len(dq) <= 1, "num_decodes", f"decodes must share one query_len, got {sorted(dq)}")
            _check(
                all(q <= MAX_DECODE_QUERY_LEN for q in dq),
                "num_decodes",
                f"decode query_len must be <= {MAX_DECODE_QUERY_LEN}, got {sorted(dq)}",
            )
        _check(self.block_size > 0, "block_size", f"must be > 0, got {self.block_size}")
        _check(
            self.block_stride_rows == 0 or self.block_stride_rows >= self.block_size,
            "block_stride_rows",
            f"must be 0 or >= block_size ({self.block_size}), got {self.block_stride_rows}",
        )
        _check(len(self.block_table) > 0, "block_table", "needs at least one row")
        width = len(self.block_table[0])
        for i, row in enumerate(self.block_table):
            _check(len(row) == width, f"block_table[{i}]", f"all rows need width {width}, got {len(row)}")
            _check(all(b >= 0 for b in row), f"block_table[{i}]", "block ids must be >= 0")
        if self.idx_mapping is None:
            _check(len(self.block_table) == n, "block_table", f"needs one row per request ({n}), got {len(self.block_table)}")
        else:
            _check(len(self.idx_mapping) == n, "idx_mapping", f"needs one entry per request ({n})")
            for i, m in enumerate(self.idx_mapping):
                _check(0 <= m < len(self.block_table), f"idx_mapping[{i}]", f"row {m} is not in block_table")
        _check(
            self.topk_width > 0 and self.topk_width % 128 == 0,
            "topk_width",
            f"must be a positive multiple of 128, got {self.topk_width}",
        )
        if self.dsv4 is not None or self.indexer is not None or self.step5 is not None:
            _check(not self.topk, "topk", "a DeepSeek-V4, indexer or Step5 step holds none (its indexer makes the rows)")
        else:
            _check(len(self.topk) == n, "topk", f"needs one TopkSpec per request ({n}), got {len(self.topk)}")
        for i, t in enumerate(self.topk):
            for name in ("valid", "past_seq", "past_table"):
                v = getattr(t, name)
                _check(0 <= v <= self.topk_width, f"topk[{i}].{name}", f"must be in [0, topk_width], got {v}")
            _check(t.invalid_at in INVALID_AT, f"topk[{i}].invalid_at", f"one of {INVALID_AT}, got {t.invalid_at!r}")
            _check(t.pick in TOPK_PICKS, f"topk[{i}].pick", f"one of {TOPK_PICKS}, got {t.pick!r}")
        d = self.dcp
        _check(1 <= d.size <= 64, "dcp.size", f"must be in [1, 64], got {d.size}")
        _check(0 <= d.rank < d.size, "dcp.rank", f"must be in [0, {d.size}), got {d.rank}")
        _check(
            d.interleave >= 1 and self.block_size % d.interleave == 0,
            "dcp.interleave",
            f"must divide block_size ({self.block_size}), got {d.interleave}",
        )
        _check(d.pcp >= 1 and d.tp >= 1, "dcp.pcp", f"pcp and tp must be >= 1, got {d.pcp} and {d.tp}")
        if d.pcp == 1:
            _check(d.tp == 1 or d.size == 1, "dcp.tp", f"under PCP (pcp > 1) or TP alone (size 1), got tp {d.tp} "
                                                       f"with DCP size {d.size}")
        else:  # vLLM's ParallelConfig: with PCP, DCP spans the PCP axis or the whole TP x PCP one (or is off)
            _check(d.size in (1, d.pcp, d.pcp * d.tp) and d.rank == 0, "dcp.size",
                   f"under PCP {d.pcp} x TP {d.tp}, DCP is 1, spans the PCP ranks ({d.pcp}) or all ({d.pcp * d.tp}) "
                   f"(rank 0: every rank runs), got size {d.size}, rank {d.rank}")
        c = self.call
        _check(c.token_rows in TOKEN_ROWS, "call.token_rows", f"one of {TOKEN_ROWS}, got {c.token_rows!r}")
        _check(c.req_id_rows in REQ_ID_ROWS, "call.req_id_rows", f"one of {REQ_ID_ROWS}, got {c.req_id_rows!r}")
        _check(self.heads >= 1, "heads", f"must be >= 1, got {self.heads}")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", f"one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _check(self.fp8_scale in FP8_SCALES, "fp8_scale", f"one of {FP8_SCALES}, got {self.fp8_scale!r}")
        if self.kv_cache_dtype == "fp8":
            _check(self.fp8_scale in FP8_PER_TENSOR_SCALES, "fp8_scale",
                   f"a per-tensor fp8 cache's k_scale is one of {FP8_PER_TENSOR_SCALES}, got {self.fp8_scale!r}")
        _check(self.values in VALUE_KINDS, "values", f"one of {VALUE_KINDS}, got {self.values!r}")
        _check(self.cudagraph in CUDAGRAPH_MODES, "cudagraph", f"one of {CUDAGRAPH_MODES}, got {self.cudagraph!r}")
        if self.cudagraph == "full":  # the runner's block table has one width for the engine's life
            width = {len(row) for s in (*self.earlier, self) for row in s.block_table}
            _check(len(width) <= 1, "block_table", f"a full-graph engine's steps share one table width, got {sorted(width)}")
        if self.dsv4 is not None:
            _validate_dsv4(self)
        if self.step5 is not None:
            _validate_step5(self)
        if self.indexer is not None:
            x = self.indexer
            _check(x.topk_backend in INDEXER_TOPK_BACKENDS, "indexer.topk_backend",
                   f"one of {INDEXER_TOPK_BACKENDS}, got {x.topk_backend!r}")
            _check(0 <= x.num_speculative_tokens <= INDEXER_MAX_SPECULATIVE, "indexer.num_speculative_tokens",
                   f"must be in [0, {INDEXER_MAX_SPECULATIVE}], got {x.num_speculative_tokens}")
            _check(x.max_logits_mb >= 0, "indexer.max_logits_mb", f"must be >= 0, got {x.max_logits_mb}")
            _check(0 <= x.num_sms <= INDEXER_MAX_SMS, "indexer.num_sms",
                   f"must be in [0, {INDEXER_MAX_SMS}] (0: the device's), got {x.num_sms}")
            _check(x.num_sms != 1 or x.num_speculative_tokens != 3, "indexer.num_sms",
                   "SM90 runs next_n 4 (3 draft tokens) on clusters of 2 SMs: 1 SM schedules none")
            rows = self.num_decode_tokens + self.padded_tokens
            _check(x.topk_backend != "cooperative" or rows <= COOPERATIVE_MAX_ROWS, "indexer.topk_backend",
                   f"'cooperative' takes at most {COOPERATIVE_MAX_ROWS} decode rows (vLLM refuses more), got {rows}")
            _check(0 <= x.attention_heads <= 128, "indexer.attention_heads",
                   f"must be in [0, 128], got {x.attention_heads}")
            _check(x.shardq_min_tokens >= 0, "indexer.shardq_min_tokens", f"must be >= 0, got {x.shardq_min_tokens}")
            _check(x.attention_heads or not x.skip_topk_layer, "indexer.skip_topk_layer",
                   "a skip_topk layer needs the attention module (attention_heads > 0)")
            _check(all(q <= 1 + x.num_speculative_tokens for q in dq), "num_decodes",
                   f"decode query_len must be <= 1 + num_speculative_tokens, got {sorted(dq)}")
        if self.dsv4 is None and self.step5 is None and self.padded_tokens:
            pads = [i for i, r in enumerate(self.requests) if r.query_len == 0]
            want = len(pads) * max(dq, default=0)
            _check(self.num_decodes == n and pads and pads[0] == n - len(pads) and self.padded_tokens == want,
                   "padded_tokens", f"a full CUDA graph pads only a decode batch whose last requests are padding rows, "
                   f"by decode query_len tokens each ({want} here), got {self.padded_tokens}")
        for k, e in enumerate(self.earlier):
            _check(isinstance(e, Case), f"earlier[{k}]", "expected a case")
            _check(not e.earlier, f"earlier[{k}].earlier", "an earlier step has no steps of its own (list them in order here)")
            for name in ENGINE_FIELDS:
                _check(getattr(e, name) == getattr(self, name), f"earlier[{k}].{name}",
                       f"one engine runs the trace: must equal this step's ({getattr(self, name)!r}), got {getattr(e, name)!r}")
            try:
                dataclasses.replace(e, mtp_draft=False).validate()  # a draft step is checked against its step before below
            except CaseError as err:
                raise CaseError(str(err).replace("case.", f"case.earlier[{k}].", 1)) from None
        steps = (*self.earlier, self)
        for k, step in enumerate(steps):
            if step.mtp_draft:
                where = f"earlier[{k}].mtp_draft" if k < len(self.earlier) else "mtp_draft"
                _check(k > 0 and draft_follows(steps[k - 1], step), where,
                       "an MTP draft step follows a decode of one token per request and holds the same requests, "
                       "each one token on (same block table, no padding, an eager engine)")
        return self

    # -- JSON ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for step in (data, *data["earlier"]):  # a case without a DSv4 step reads as it did before the field
            for name in ("dsv4", "indexer", "step5"):
                if step.get(name, 0) is None:
                    del step[name]
            if step["dcp"]["pcp"] == 1 and step["dcp"]["tp"] == 1:  # nor one without PCP
                del step["dcp"]["pcp"], step["dcp"]["tp"]
            if step.get("indexer") and not step["indexer"]["shardq_min_tokens"]:  # nor an indexer step without ShardQ
                del step["indexer"]["shardq_min_tokens"]
        return data

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Any) -> "Case":
        return _build(cls, data, "case").validate()

    @classmethod
    def from_json(cls, text: str) -> "Case":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise CaseError(f"case: not JSON ({e})") from None
        return cls.from_dict(data)


# What one engine fixes for the life of a trace: every step shares them.
def draft_follows(before: "Case", draft: "Case") -> bool:
    """Whether `draft` can be an MTP draft step of `before`: both decodes of one token per request, the same
    requests and block table, each request one token on, no CUDA-graph padding, eager (the speculator's
    in-place update; a full-graph engine replays its draft steps from a graph instead)."""
    def one_token_decodes(c: "Case") -> bool:
        return (c.num_decodes == len(c.requests) > 0 and all(r.query_len == 1 for r in c.requests)
                and not c.padded_tokens and c.cudagraph == "none")

    return (one_token_decodes(before) and one_token_decodes(draft) and len(before.requests) == len(draft.requests)
            and before.block_table == draft.block_table and before.idx_mapping == draft.idx_mapping
            and all(d.context_len == b.context_len + 1 for b, d in zip(before.requests, draft.requests)))


def _validate_dsv4(case: "Case") -> None:
    """What a DeepSeek-V4 step must be: vLLM's split of its batch, the window's blocks in the SWA table, every
    compressed entry's block in the compressed table, one fresh step of an eager engine."""
    d, n = case.dsv4, len(case.requests)
    _check(d.version in DSV4_VERSIONS, "dsv4.version", f"one of {DSV4_VERSIONS}, got {d.version!r}")
    ratios = V41_COMPRESS_RATIOS if d.version == "4.1" else COMPRESS_RATIOS
    _check(d.compress_ratio in ratios, "dsv4.compress_ratio", f"one of {ratios}, got {d.compress_ratio}")
    block = d.compressed_block_size
    plain = PLAIN_RECORDS.get(d.cache_dtype)
    _check(d.cache_dtype in DSV4_CACHE_DTYPES, "dsv4.cache_dtype", f"one of {DSV4_CACHE_DTYPES}, got {d.cache_dtype!r}")
    _check(d.kv_record == plain if plain else d.kv_record == 584 or (d.version == "4.1" and d.kv_record == 528),
           "dsv4.kv_record", f"{plain} for a {d.cache_dtype} plain-row cache" if plain else
           f"584, or 528 for V4.1, got {d.kv_record}")
    _check(d.cache_dtype != "nvfp4_ds_mla" or (d.version == "4.1" and d.kv_record == 528), "dsv4.cache_dtype",
           "nvfp4_ds_mla is V4.1's, over its 528-byte sliding-window record (SM100)")
    _check(not d.mega_attn or (d.version == "4.1" and d.kv_record == 528 and case.heads == 64), "dsv4.mega_attn",
           "the mega-attention layer is V4.1's on SM100 (528-byte SWA record), at the 64 heads its fused q layout is "
           "modelled for")
    _check(d.page_pad >= 0 and (d.page_pad == 0 or plain), "dsv4.page_pad",
           f"0, or rows past a plain-row cache's block in a packed page, got {d.page_pad}")
    _check(d.kv_source == "own" or (d.version == "4.1" and d.kv_source == "shared"), "dsv4.kv_source",
           f"'own', or 'shared' for V4.1, got {d.kv_source!r}")
    _check(block == DSV4_BLOCK_SIZE if d.version == "4" else block in V41_BLOCK_SIZES, "dsv4.compressed_block_size",
           f"{DSV4_BLOCK_SIZE} for V4, one of {V41_BLOCK_SIZES} for V4.1, got {block}")
    _check(not d.rocm_arch or (d.rocm_arch in ROCM_ARCHS and not plain and d.kv_record == 584), "dsv4.rocm_arch",
           f"'', or one of {ROCM_ARCHS} with the 584-byte fp8_ds_mla record, got {d.rocm_arch!r}")
    _check(d.latent_grid in (0, 584, 528), "dsv4.latent_grid", f"0, 584 or 528, got {d.latent_grid}")
    _check(not d.q_rope_removed or d.mega_attn, "dsv4.q_rope_removed", "the mega layer's q only (its kernel ropes q)")
    w = d.window_size
    _check(w >= 16 and w & (w - 1) == 0, "dsv4.window_size", f"a power of two >= 16 (the combine kernel's arange), got {w}")
    _check(0 <= d.num_speculative_tokens <= DSV4_MAX_SPECULATIVE, "dsv4.num_speculative_tokens",
           f"must be in [0, {DSV4_MAX_SPECULATIVE}], got {d.num_speculative_tokens}")
    _check(d.c4_order in C4_ORDERS, "dsv4.c4_order", f"one of {C4_ORDERS}, got {d.c4_order!r}")
    _check(d.attn_sink in ATTN_SINKS, "dsv4.attn_sink", f"one of {ATTN_SINKS}, got {d.attn_sink!r}")
    longest = max((r.seq_len for r in case.requests), default=0)
    _check(d.max_model_len == 0 or d.max_model_len >= max(longest, 1), "dsv4.max_model_len",
           f"0 or at least the longest sequence ({longest}), got {d.max_model_len}")
    _check(case.block_size % 32 == 0, "block_size", f"the SWA cache's block size is a multiple of 32, got {case.block_size}")
    stored = (d.cache_dtype if d.cache_dtype == "nvfp4_ds_mla" else "fp8_ds_mla" if not plain else
              "bfloat16" if plain == PLAIN_BF16_RECORD else "fp8")
    _check(case.kv_cache_dtype == stored and case.fp8_scale == "pow2", "kv_cache_dtype",
           f"a DeepSeek-V4 cache of dsv4.cache_dtype {d.cache_dtype!r} is {stored} (fp8_ds_mla: the 584-byte record, "
           "UE8M0 power-of-two scales; a per-tensor fp8 row: k_scale 1.0)")
    _check(1 <= case.heads <= 128, "heads", f"FlashMLA's DSv4 kernels pad to 64 or 128 heads, got {case.heads}")
    for name in ("earlier", "idx_mapping", "block_stride_rows", "mtp_draft"):
        _check(not getattr(case, name), name, "not drawn for a DeepSeek-V4 step (single fresh steps)")
    _check(case.cudagraph == "none" and case.dcp == Dcp() and case.call == IndexCall(), "cudagraph",
           "a DeepSeek-V4 step runs eagerly, without DCP, through forward_mqa")
    # vLLM's split (split_decodes_and_prefills, decode_threshold 1 + k, not uniform): the decodes are the requests
    # before the first one longer than the threshold.
    threshold = 1 + d.num_speculative_tokens
    split = next((i for i, r in enumerate(case.requests) if r.query_len > threshold), n)
    _check(case.num_decodes == split, "num_decodes",
           f"vLLM's split at query_len > {threshold} gives {split} decode requests, got {case.num_decodes}")
    pads = [i for i, r in enumerate(case.requests) if r.query_len == 0]
    _check(not pads or (split == n and pads[0] == n - len(pads) and len(pads) < n), "requests",
           "zero-length padding rows only after the decodes of a decode-only batch")
    _check(all(r.context_len == 0 for r in case.requests if r.query_len == 0), "requests", "a padding row holds no context")
    _check(case.padded_tokens >= 0, "padded_tokens", f"must be >= 0, got {case.padded_tokens}")
    bs, table = case.block_size, case.block_table
    for i, r in enumerate(case.requests):
        row = table[case.table_row(i)]
        blocks = -(-r.seq_len // bs)
        _check(blocks <= len(row), f"block_table[{i}]", f"{r.seq_len} tokens need {blocks} blocks of {bs}, the row has {len(row)}")
        first = max(0, r.context_len - w + 1) // bs  # the oldest block any of its queries' windows reads
        _check(all(b > 0 for b in row[first:blocks]), f"block_table[{i}]",
               f"blocks {first}..{blocks - 1} hold the window of its queries: none may be the null block 0")
    used = [b for row in table for b in row if b]
    _check(len(used) == len(set(used)), "block_table", "a block id used twice (requests share no SWA block here)")
    ctable = d.compressed_block_table
    if not d.compressed:
        _check(not ctable, "dsv4.compressed_block_table", "a sliding-window-only layer has no compressed cache")
        return
    _check(len(ctable) == len(table), "dsv4.compressed_block_table", f"one row per block_table row ({len(table)})")
    width = len(ctable[0]) if ctable else 0
    for i, r in enumerate(case.requests):
        row = ctable[case.table_row(i)]
        blocks = -(-r.seq_len // block)
        _check(len(row) == width and blocks <= width and all(b > 0 for b in row[:blocks]),
               f"dsv4.compressed_block_table[{i}]", f"{r.seq_len} tokens need {blocks} blocks of {block} "
               f"(ids > 0) in a row of the table's width {width}")
    used = [b for row in ctable for b in row if b]
    _check(all(b >= 0 for row in ctable for b in row) and len(used) == len(set(used)), "dsv4.compressed_block_table",
           "block ids >= 0, none used twice")


def _validate_step5(case: "Case") -> None:
    """What a Step5 DSA step must be: decodes of one token each (the backend's uniform route), its kernels' head
    counts and block sizes, every position's block in its request's row, no other step kind's fields."""
    x, n = case.step5, len(case.requests)
    _check(x.groups in (1, 2), "step5.groups", f"1 or 2 KV groups a rank, got {x.groups}")
    _check(case.heads % x.groups == 0 and case.heads // x.groups in STEP5_Q_HEADS_PER_KV, "heads",
           f"groups x one of {STEP5_Q_HEADS_PER_KV} query heads per group, got {case.heads} over {x.groups} group(s)")
    _check(x.index_heads in STEP5_INDEX_HEADS, "step5.index_heads", f"one of {STEP5_INDEX_HEADS}, got {x.index_heads}")
    _check(1 <= x.region_topk <= 1024, "step5.region_topk", f"must be in [1, 1024], got {x.region_topk}")
    _check(1 <= x.steps <= STEP5_MAX_STEPS, "step5.steps", f"must be in [1, {STEP5_MAX_STEPS}], got {x.steps}")
    _check(x.regions in ("distinct", "ties"), "step5.regions", f"'distinct' or 'ties', got {x.regions!r}")
    _check(case.kv_cache_dtype in ("bfloat16", "fp8"), "kv_cache_dtype",
           f"a Step5 cache is bfloat16 or per-tensor fp8 (e4m3), got {case.kv_cache_dtype!r}")
    _check(case.block_size in STEP5_BLOCK_SIZES, "block_size", f"one of {STEP5_BLOCK_SIZES}, got {case.block_size}")
    page = case.block_size * x.groups * 2 * 192 * (1 if case.kv_cache_dtype == "fp8" else 2)
    _check(page >= 7 * 1024, "block_size", f"the CSA tail ring shares a KV page and needs 7 rows of 1 KiB in it "
           f"(vLLM refuses a smaller one): {page} bytes at this block size, groups and dtype")
    _check(n >= 1 and case.num_decodes == n and all(r.query_len == 1 for r in case.requests), "requests",
           "every request a decode of one token")
    _check(all(r.context_len >= x.steps - 1 for r in case.requests), "requests",
           f"each request held its earlier {x.steps - 1} step(s)' tokens")
    for name in ("earlier", "idx_mapping", "block_stride_rows", "mtp_draft"):
        _check(not getattr(case, name), name, "not drawn for a Step5 step")
    _check(0 <= case.padded_tokens <= 8, "padded_tokens", "0 to 8 graph-padding rows of one token (slot -1, no blocks, "
           f"seq_len 0) after the requests, got {case.padded_tokens}")
    _check(case.cudagraph == "none" and case.dcp == Dcp() and case.call == IndexCall()
           and case.dsv4 is None and case.indexer is None, "cudagraph", "a Step5 step runs eagerly, without DCP")
    for i, r in enumerate(case.requests):
        row = case.block_table[i]
        blocks = -(-r.seq_len // case.block_size)
        _check(blocks <= len(row) and all(b > 0 for b in row[:blocks]), f"block_table[{i}]",
               f"{r.seq_len} tokens need {blocks} blocks (ids > 0) of {case.block_size}, the row has {len(row)}")
    used = [b for row in case.block_table for b in row if b]
    _check(len(used) == len(set(used)), "block_table", "a block id used twice (requests share no block here)")


INDEXER_MAX_SMS = 132  # an H100/H200 SXM's SMs: DeepGEMM schedules over at most the device's

ENGINE_FIELDS = ("block_size", "block_stride_rows", "topk_width", "heads", "kv_cache_dtype", "fp8_scale", "values",
                 "dcp", "call", "cudagraph", "indexer")


def pcp_splits(query_len: int, pcp: int, dcp: int = 2) -> bool:
    """Whether a prefill of `query_len` tokens is split over `pcp` PCP ranks (two head-tail chunks of
    ceil(q / 2 pcp) tokens each) or runs whole on every rank: under DCP split unless its last chunk would be
    empty, without DCP (dcp 1) always split, as vLLM's PCPManager.replicated_requests decides
    (vllm/v1/worker/gpu/pcp_manager.py). For drawing cases only."""
    chunks = 2 * pcp
    return query_len > 0 and (dcp == 1 or (chunks - 1) * -(-query_len // chunks) < query_len)


def rank_owned_positions(seq_len: int, dcp_size: int, rank: int, interleave: int) -> int:
    """How many of a sequence's tokens `rank` holds when tokens are dealt in groups of `interleave`."""
    full, rem = divmod(seq_len, dcp_size * interleave)
    return full * interleave + min(max(rem - rank * interleave, 0), interleave)


def _nondefault(obj) -> str:
    return ",".join(  # fields without a default (TopkSpec.valid) always show
f"{f.name}={getattr(obj, f.name)}" for f in fields(obj) if getattr(obj, f.name) != f.default)


def _check(ok: bool, path: str, msg: str) -> None:
    if not ok:
        raise CaseError(f"case.{path}: {msg}")


_NESTED = {"requests": Request, "topk": TopkSpec, "dcp": Dcp, "call": IndexCall, "dsv4": Dsv4, "indexer": IndexerStep,
           "step5": Step5}


def _build(cls, data: Any, path: str):
    """Build dataclass `cls` from JSON data, naming the path of any wrong field."""
    if not isinstance(data, dict):
        raise CaseError(f"{path}: expected an object, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise CaseError(f"{path}.{unknown[0]}: unknown field (known: {', '.join(known)})")
    kwargs = {}
    for name, f in known.items():
        if name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise CaseError(f"{path}.{name}: missing")
            continue
        value, where = data[name], f"{path}.{name}"
        if name in ("requests", "topk"):
            if not isinstance(value, (list, tuple)):
                raise CaseError(f"{where}: expected a list")
            value = tuple(_build(_NESTED[name], v, f"{where}[{i}]") for i, v in enumerate(value))
        elif name in ("dcp", "call") or (name in ("dsv4", "indexer", "step5") and value is not None):
            value = _build(_NESTED[name], value, where)
        elif name == "compressed_block_table":
            value = _int_table(value, where)
        elif name == "earlier":
            if not isinstance(value, (list, tuple)):
                raise CaseError(f"{where}: expected a list of cases")
            value = tuple(_build(Case, v, f"{where}[{i}]") for i, v in enumerate(value))
        elif name == "block_table":
            value = _int_table(value, where)
        elif name == "idx_mapping":
            if value is not None:
                if not isinstance(value, (list, tuple)):
                    raise CaseError(f"{where}: expected a list of ints or null")
                value = tuple(_int(v, f"{where}[{i}]") for i, v in enumerate(value))
        else:
            expected = f.type if isinstance(f.type, str) else f.type.__name__
            if expected == "int":
                value = _int(value, where)
            elif expected == "bool":
                if not isinstance(value, bool):
                    raise CaseError(f"{where}: expected true/false, got {value!r}")
            elif expected == "str":
                if not isinstance(value, str):
                    raise CaseError(f"{where}: expected a string, got {value!r}")
        kwargs[name] = value
    return cls(**kwargs)


def _int_table(value: Any, where: str) -> tuple[tuple[int, ...], ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(r, (list, tuple)) for r in value):
        raise CaseError(f"{where}: expected a list of lists of ints")
    return tuple(tuple(_int(v, f"{where}[{i}][{j}]") for j, v in enumerate(r)) for i, r in enumerate(value))


def _int(v: Any, path: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise CaseError(f"{path}: expected an integer, got {v!r}")
    return v
