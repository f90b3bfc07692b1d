"""Path coverage: which of vLLM's code paths a case went through, as vLLM itself chose them.

Nothing here re-derives vLLM's routing. Each probe wraps one of vLLM's own functions *where vLLM looks it
up* (modules bind functions by name at import, so the function is wrapped in every module that calls it)
and, when the function runs during a recorded case, adds a short stable path name to that case's set
("fp8.mixed_batch", "mha.chunked_context", ...). Some names read the call's own arguments or result
(the prefill-workspace flag of the index remap, the split `split_decodes_and_prefills` returned, zero-length
rows in the `query_start_loc_cpu` the builder was given).

    obs = coverage.observe_paths(self.observe, call)   # in a target's run(): obs.notes["paths"]

`install()` is idempotent and cheap (a few dozen attribute look-ups): it runs at the start of every
recorded case, so a function that a mutant replaced after the last case is wrapped again. It wraps only
modules the process has imported (the target imports its backend before the call). Wrappers keep
`__wrapped__`, so a mutant that rebuilds a function from `inspect.getsource` sees vLLM's source. A probe
whose module, class or function the installed release lacks is skipped (0.23 and 0.26 lack several).
Outside `recording()` a wrapper costs one global read.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

_MARK = "_attnfuzz_coverage_probe"
_current: set[str] | None = None  # the running case's paths; None: not recording

FLASHMLA = "vllm.v1.attention.backends.mla.flashmla_sparse"
XPU = "vllm.v1.attention.backends.mla.xpu_mla_sparse"
FLASHATTN = "vllm.v1.attention.backends.mla.flashattn_mla_sparse"
FLASHINFER_SM90 = "vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90"
FLASHINFER_STANDIN = "fuzzer.support.standins.flashinfer_mla"  # attnfuzz's stand-in: FlashInfer's planner decisions
FLASHINFER_SPARSE = "vllm.v1.attention.backends.mla.flashinfer_mla_sparse"  # FLASHINFER_MLA_SPARSE (SM100), SM120's builder
FLASHINFER_SM120 = "vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm120"
FLASHINFER_TRTLLM_STANDIN = "fuzzer.support.standins.flashinfer_trtllm_mla"  # attnfuzz's stand-in: the kernel each runs
FA4_STANDIN = "fuzzer.support.standins.flash_attn_fa4"  # attnfuzz's stand-in: FA4's kernel for decode batches
SPARSE_UTILS = "vllm.v1.attention.backends.mla.sparse_utils"
INDEX_GROUP = "vllm.v1.attention.backends.mla.index_group"
SPARSE_MLA = "vllm.model_executor.layers.attention.sparse_mla_attention"
MLA = "vllm.model_executor.layers.attention.mla_attention"
REMAP, DCP_FILTER, SPLIT = ("triton_convert_req_index_to_global_index", "triton_filter_and_convert_dcp_index",
                            "split_decodes_and_prefills")
DSV4_LAYER = "vllm.models.deepseek_v4.nvidia.flashmla"
DSV4_SPARSE_MLA = "vllm.models.deepseek_v4.sparse_mla"
DSV4_SWA = "vllm.v1.attention.backends.mla.sparse_swa"
DSV4_COMPRESSOR_UTILS = "vllm.v1.attention.backends.mla.compressor_utils"
DSV41_LAYER = "vllm.models.deepseek_v41.nvidia.flashmla"
V32_ATTENTION = "vllm.models.deepseek_v32.attention"
INDEXER_BUILDER = "vllm.v1.attention.backends.mla.indexer"
INDEXER_OP = "vllm.model_executor.layers.sparse_attn_indexer"
INDEXER_TOPK = "vllm.model_executor.layers.indexer_topk"
DCP_OPS = "vllm.v1.attention.ops.dcp"
STEP5_ADAPTER = "vllm.models.step5.nvidia.flashinfer_sparse"
STEP5_SUMMARY = ("vllm.models.step5.nvidia.sparse_summary_cache",  # where releases keep it (0.34: common/)
                 "vllm.models.step5.common.sparse_summary_cache")

Classify = Callable[[tuple, dict], Iterable[str]]


@dataclass(frozen=True)
class Probe:
    module: str
    name: str  # "function" or "Class.method", as the module holds it
    path: str | None = None  # recorded when the function is entered
    before: Classify | None = None  # more paths from the call's arguments (self included for methods)
    after: Callable[[tuple, dict, object], Iterable[str]] | None = None  # ... from its arguments and result


# -- what the call's own arguments say ------------------------------------------------------------------------

def _arg(args: tuple, kwargs: dict, name: str, position: int, default=None):
    return kwargs[name] if name in kwargs else args[position] if len(args) > position else default


def _remap_modes(args: tuple, kwargs: dict) -> Iterator[str]:
    """The modes of triton_convert_req_index_to_global_index a call site asked for (keyword-only in vLLM)."""
    yield "remap"
    if kwargs.get("HAS_PREFILL_WORKSPACE"):
        yield "remap.workspace"
    if kwargs.get("return_valid_counts"):
        yield "remap.valid_counts"
    if kwargs.get("idx_mapping") is not None:
        yield "remap.idx_mapping"
    if kwargs.get("out") is not None:
        yield "remap.in_place"  # the index group's persistent physical top-k buffer
    if kwargs.get("prefill_workspace_rank_stride"):
        yield "remap.workspace.rank_major"  # PCP + DCP: prefill rows into the DCP-gathered shards, rank-major
    stride = kwargs.get("BLOCK_STRIDE_ROWS")
    if stride is not None and stride != kwargs.get("BLOCK_SIZE", 64):
        yield "remap.block_stride"  # other layers' pages between this layer's blocks


def _dcp_filter_modes(args: tuple, kwargs: dict) -> Iterator[str]:
    yield "dcp.filter"
    yield "dcp.filter.compacted" if kwargs.get("compact_valid_to_front", True) else "dcp.filter.in_place"


def _padding_rows(common_attn_metadata) -> Iterator[str]:
    """Zero-length requests, as the builder is handed them (a padded decode batch)."""
    qsl = getattr(common_attn_metadata, "query_start_loc_cpu", None)
    if qsl is not None and len(qsl) > 1 and bool((qsl[1:] == qsl[:-1]).any()):
        yield "batch.padding_rows"


def _build_args(args: tuple, kwargs: dict) -> Iterator[str]:  # builder.build(self, common_prefix_len, cam)
    yield from _padding_rows(_arg(args, kwargs, "common_attn_metadata", 2))


def _split_result(args: tuple, kwargs: dict, result) -> Iterator[str]:
    """The split vLLM's builder took: (num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)."""
    num_decodes, num_prefills, num_decode_tokens, _ = result
    yield ("batch.mixed" if num_decodes and num_prefills else "batch.decode_only" if num_decodes
           else "batch.prefill_only" if num_prefills else "batch.empty")
    cam = _arg(args, kwargs, "common_attn_metadata", 0)
    qsl = getattr(cam, "query_start_loc_cpu", None)
    if num_decodes and qsl is not None and bool(((qsl[1:num_decodes + 1] - qsl[:num_decodes]) > 1).any()):
        yield "batch.multi_token_decodes"  # speculative decodes / short extends counted as decodes
    yield from _padding_rows(cam)


def _pcp_shards(args: tuple, kwargs: dict, result) -> Iterator[str]:
    """gathered_prefill_shards(row_req_idx, row_shard_rows) -> (row bounds, shard rows): the builder grouped a
    PCP rank's prefill rows into one workspace entry per request: two head-tail chunk rows (split over the PCP
    ranks) or one (a prefill every rank runs whole)."""
    rows_per_entry = {int(b) - int(a) for a, b in zip(result[0][:-1], result[0][1:])}
    yield "pcp_dcp.prefill_shards"
    if 2 in rows_per_entry:
        yield "pcp_dcp.prefill_shards.split"
    if 1 in rows_per_entry:
        yield "pcp_dcp.prefill_shards.whole"


def _fp8_kernel_heads(args: tuple, kwargs: dict) -> Iterator[str]:
    # _fp8_flash_mla_kernel(self, q [B, S, H, D], ...): vLLM pads H up to its fp8_decode_padded_heads (0.34: the
    # impl computes it per call, the attribute moved to the builder)
    self, q = args[0], _arg(args, kwargs, "q", 1)
    padded = getattr(self, "fp8_decode_padded_heads", None)
    compute = getattr(self, "_compute_fp8_decode_padded_heads", None)
    if padded is None and compute is not None and q is not None:
        padded = compute(q.size(2))
    if q is not None and padded is not None and q.size(2) < padded:
        yield "kernel.fp8_decode.padded_heads"


def _bf16_kernel_heads(args: tuple, kwargs: dict) -> Iterator[str]:
    # _bf16_flash_mla_kernel(self, q [T, H, D], kv, topk, topk_length, actual_num_heads, out): vLLM pads the
    # heads it is given up to a multiple of prefill_padding unless q already holds them (forward_mqa's buffer)
    self, q = args[0], _arg(args, kwargs, "q", 1)
    step = getattr(self, "prefill_padding", None)
    if q is not None and step:
        actual = _arg(args, kwargs, "actual_num_heads", 5) or q.shape[1]
        if q.shape[1] < -(-actual // step) * step:
            yield "kernel.bf16_sparse.padded_heads"


_SM90_PLANS: dict[int, object] = {}  # _SM90State -> the FlashInfer plan it held when plan() was entered


def _sm90_plan_kind(args: tuple, kwargs: dict) -> Iterator[str]:
    # _SM90State.plan(self, num_tokens, kv_lens, cam, req_id_per_token): exact host lengths (cam None), or upper
    # bounds the plan clamps on the device
    _SM90_PLANS[id(args[0])] = getattr(args[0].wrapper, "_planned_backend", None)
    yield "sm90.plan.exact" if _arg(args, kwargs, "cam", 3) is None else "sm90.plan.upper_bound"


def _sm90_plan_reused(args: tuple, kwargs: dict, result) -> Iterator[str]:
    # the wrapper holds the plan it held before the call: vLLM kept the last plan (its bounds still fit)
    before = _SM90_PLANS.pop(id(args[0]), None)
    if before is not None and getattr(args[0].wrapper, "_planned_backend", None) is before:
        yield "sm90.plan.reused"


def _sm100_kv_dtype(args: tuple, kwargs: dict) -> Iterator[str]:  # FlashInferMLASparseImpl._forward_mqa_kernel(self, q, ...)
    q = _arg(args, kwargs, "q", 1)
    q = q[0] if isinstance(q, tuple) else q  # the bf16 query comes split (ql_nope, q_pe), the fp8 one whole
    yield "sm100.fp8" if q.element_size() == 1 else "sm100.bf16"


def _fa4_kernel(args: tuple, kwargs: dict) -> Iterator[str]:  # FA4's _flash_attn_fwd(q, k, v, qv=..., ...)
    q, v = _arg(args, kwargs, "q", 0), _arg(args, kwargs, "v", 2)
    heads = q.shape[-2] // v.shape[-2] if q is not None and v is not None else 0
    yield "kernel.fa4_sparse_decode" if heads in (8, 16, 32, 64) else "kernel.fa4_mla_forward"


def _sm120_scale_format(args: tuple, kwargs: dict) -> Iterator[str]:  # FlashInferMLASparseSM120Impl._run_mqa_kernel(self, ...)
    yield f"sm120.{getattr(args[0], 'kv_scale_format', '?')}"


def _sm90_kv_dtype(args: tuple, kwargs: dict) -> Iterator[str]:
    yield "sm90.fp8" if getattr(args[0], "use_fp8_kv_cache", False) else "sm90.bf16"


def _flashinfer_plan(args: tuple, kwargs: dict, result) -> Iterator[str]:
    # mla_plan(...) -> Plan: FlashInfer's cluster size, and whether it split a tile's KV (the merge stage runs)
    yield "flashinfer.plan.cluster2" if result.info[0] == 2 else "flashinfer.plan.cluster1"
    if result.merge_ctas:
        yield "flashinfer.plan.split_kv"


def _dsv4_layer_type(args: tuple, kwargs: dict) -> Iterator[str]:
    # DeepseekV4FlashMLAAttention._forward_decode / _forward_prefill(self, ...): the layer's compress ratio
    ratio = getattr(args[0], "compress_ratio", None)
    yield {1: "swa_only", 4: "c4a", 128: "c128a"}.get(ratio, f"ratio{ratio}")


def _dsv4_decode(args: tuple, kwargs: dict) -> Iterator[str]:
    yield from (f"dsv4.decode.{t}" for t in _dsv4_layer_type(args, kwargs))


def _dsv4_prefill(args: tuple, kwargs: dict) -> Iterator[str]:
    yield from (f"dsv4.prefill.{t}" for t in _dsv4_layer_type(args, kwargs))


def _dsv4_gather(args: tuple, kwargs: dict) -> Iterator[str]:
    # dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, ...): gather_lens None = every compressed entry
    yield "dsv4.dequant_gather.compressed" if _arg(args, kwargs, "gather_lens", 3) is None else "dsv4.dequant_gather.swa"


def _dsv41_layer_type(args: tuple, kwargs: dict) -> str:
    # V4.1's layer: ratio 0 is the sliding-window layer, 1 and 2 read the indexer's top-k; "shared" when it reads a
    # kv-source layer's compressed cache (compressed_cache_prefix not its own)
    layer = args[0]
    ratio = getattr(layer, "compress_ratio", None)
    kind = {0: "swa_only", 1: "c1a", 2: "c2a"}.get(ratio, f"ratio{ratio}")
    return kind + (".shared" if ratio and not getattr(layer, "is_kv_source", True) else "")


def _dsv41_decode(args: tuple, kwargs: dict) -> Iterator[str]:
    yield f"dsv41.decode.{_dsv41_layer_type(args, kwargs)}"


def _dsv41_prefill(args: tuple, kwargs: dict) -> Iterator[str]:
    yield f"dsv41.prefill.{_dsv41_layer_type(args, kwargs)}"


def _dsv41_gather(args: tuple, kwargs: dict) -> Iterator[str]:
    yield "dsv41.dequant_gather.compressed" if _arg(args, kwargs, "gather_lens", 3) is None else "dsv41.dequant_gather.swa"
    cache = _arg(args, kwargs, "k_cache", 1)
    if getattr(cache, "shape", (0,))[-1] == 528:  # V4.1's interleaved MXFP8 record: its own gather kernel
        yield "dsv41.dequant_gather.mxfp8"


def _dsv41_decode_kernel(args: tuple, kwargs: dict) -> Iterator[str]:
    yield "dsv41.kernel.decode.extra" if kwargs.get("extra_k_cache") is not None else "dsv41.kernel.decode.swa"


def _dsv4_decode_kernel(args: tuple, kwargs: dict) -> Iterator[str]:
    yield "dsv4.kernel.decode.extra" if kwargs.get("extra_k_cache") is not None else "dsv4.kernel.decode.swa"


def _dsv4_chunks(args: tuple, kwargs: dict, result) -> Iterator[str]:
    if len(result) > 1:
        yield "dsv4.prefill.chunks"  # the prefill requests did not fit one workspace chunk


def _indexer_metadata(args: tuple, kwargs: dict, result) -> Iterator[str]:
    """The indexer's metadata as its builder made it: the decode route (native next_n rows, flattened to one row per
    token, packed for ragged lengths) and the prefill chunks (split by the logits budget, sub-chunked by query)."""
    if result.decode is not None:
        d = result.decode
        yield "indexer.decode"
        if d.seq_lens.dim() == 2 and d.seq_lens.shape[1] > 1:
            yield "indexer.decode.native_mtp"
        elif result.num_decode_tokens > result.num_decodes:
            yield "indexer.decode.flattened"
        if d.requires_padding:
            yield "indexer.decode.requires_padding"
    if result.prefill is not None:
        chunks = result.prefill.chunks
        yield "indexer.prefill"
        if len(chunks) > 1:
            yield "indexer.prefill.chunks"
        if any(c.skip_kv_gather for c in chunks):
            yield "indexer.prefill.query_subchunks"


def _dsv32_layer(args: tuple, kwargs: dict) -> Iterator[str]:
    # DeepseekV32Attention._sparse_indexer_and_attn(self, ...): a layer with its own indexer, or a skip_topk layer
    # (none: it attends with the top-k the layer before it left in the buffer)
    yield "dsv32.layer.indexer" if getattr(args[0], "indexer", None) is not None else "dsv32.layer.skip_topk"


def _dcp_merge(args: tuple, kwargs: dict) -> Iterator[str]:
    # _merge_dcp_topk_global(logits, topk_indices, topk_tokens, dcp_rank, dcp_world_size, ...): a no-op without DCP
    if (_arg(args, kwargs, "dcp_world_size", 4, 1) or 1) > 1:
        yield "indexer.dcp_merge"


def _shardq_split(args: tuple, kwargs: dict, result) -> Iterator[str]:
    # build_shardq_metadata(cam, vllm_config, metadata, device): the step's ShardQ split over the TP ranks, or None
    if result is None:
        yield "shardq.none"
        return
    yield "shardq.split"
    if result.num_decode_tokens:
        yield "shardq.split.after_decodes"  # head-sharded decodes first: the split's top-k starts past them


def _indexer_topk(args: tuple, kwargs: dict, result) -> Iterator[str]:
    yield f"indexer.topk.{result}"  # SparseIndexerTopk.resolve_backend: the decode top-k kernel it chose


def _step5_select(args: tuple, kwargs: dict) -> Iterator[str]:  # select_regions(scores, current, topk, ...)
    scores, topk = _arg(args, kwargs, "scores", 0), _arg(args, kwargs, "topk", 2)
    yield "step5.select.all" if scores.shape[1] <= topk else "step5.select.topk"


def _step5_attention(args: tuple, kwargs: dict) -> Iterator[str]:  # sparse_decode_attention(query, cache, ...)
    yield "step5.attention.splits" if kwargs.get("splits", 1) > 1 else "step5.attention.one_split"
    cache = _arg(args, kwargs, "cache", 1)
    if str(cache.dtype) in ("torch.uint8", "torch.float8_e4m3fn"):
        yield "step5.attention.fp8"
    if kwargs.get("gate") is not None:
        yield "step5.attention.gated"
    if cache.shape[1] > 1:
        yield "step5.attention.groups"


PROBES: tuple[Probe, ...] = (
    # DeepSeek-V3.2's indexer: its builder's split and metadata, the op's kernels, the decode top-k's choice
    Probe(INDEXER_BUILDER, SPLIT, after=_split_result),
    Probe(INDEXER_BUILDER, "DeepseekV32IndexerMetadataBuilder.build", after=_indexer_metadata),
    Probe(INDEXER_BUILDER, "DeepseekV32IndexerMetadataBuilder.update_draft_decode_metadata", "mtp_draft.update"),
    Probe(INDEXER_OP, "pack_seq_triton", "indexer.decode.pack"),
    Probe(INDEXER_TOPK, "SparseIndexerTopk.resolve_backend", after=_indexer_topk),
    Probe(INDEXER_OP, "_merge_dcp_topk_global", before=_dcp_merge),
    Probe(SPARSE_MLA, "build_shardq_metadata", after=_shardq_split),  # 0.34+: ShardQ's token split over TP
    # MLA's DCP collectives as MLADCPManager makes them (the query all-gather, the LSE combine's all-gather +
    # reduce-scatter), bound when a layer makes its manager
    Probe(DCP_OPS, "MLADCPManager._gather_query", "dcp.query_gather"),
    Probe(DCP_OPS, "cp_lse_ag_out_rs", "dcp.combine"),
    # DeepSeek-V3.2's attention module: its seam between the indexer and sparse MLA, and the indexer op it calls
    Probe(V32_ATTENTION, "DeepseekV32Attention._sparse_indexer_and_attn", before=_dsv32_layer),
    Probe(V32_ATTENTION, "sparse_attn_indexer", "dsv32.indexer_op"),
    # the batch as vLLM's builders split it
    Probe(SPARSE_MLA, SPLIT, after=_split_result),
    Probe(MLA, SPLIT, after=_split_result),
    Probe(FLASHMLA, "FlashMLASparseMetadataBuilder.build", before=_build_args),
    Probe(XPU, "XPUMLASparseMetadataBuilder.build", before=_build_args),
    # the layer's routes (MLAAttention.forward_impl's split) and the dense-MHA prefill
    Probe(FLASHMLA, "FlashMLASparseImpl.forward_mqa", "mqa"),
    Probe(XPU, "XPUMLASparseImpl.forward_mqa", "mqa"),
    Probe(SPARSE_MLA, "SparseMLACommonImpl.forward_mqa", "mqa"),  # FLASH_ATTN_MLA_SPARSE's (FlashMLA's overrides it)
    Probe(MLA, "MLACommonBaseImpl.forward_mha", "mha.dense"),
    Probe(MLA, "MLACommonBaseImpl._compute_prefill_context", "mha.chunked_context"),
    Probe(MLA, "MLACommonBaseImpl._context_parallel_compute_prefill_context", "mha.chunked_context.dcp"),
    Probe(SPARSE_MLA, "SparseMLACommonImpl._run_masked_mha", "mha.masked"),
    Probe(SPARSE_MLA, "SparseMLACommonImpl._compute_context_mha", "mha.masked.chunked_context"),
    # FlashMLA's cache-dtype paths and kernels
    Probe(FLASHMLA, "FlashMLASparseImpl._forward_bf16_kv", "bf16"),
    Probe(FLASHMLA, "FlashMLASparseImpl._forward_fp8_kv_mixed_batch", "fp8.mixed_batch"),
    Probe(FLASHMLA, "FlashMLASparseImpl._forward_fp8_kv_separate_prefill_decode", "fp8.separate_prefill_decode"),
    Probe(FLASHATTN, "FlashAttnMLASparseImpl._forward_mqa_kernel", "kernel.fa3_sparse"),
    # prefill context parallelism with DCP: the layer's PCP gathers, FlashMLA's shard grouping and KV all-gather
    Probe(FLASHMLA, "gathered_prefill_shards", after=_pcp_shards),
    Probe(FLASHMLA, "FlashMLASparseImpl._gather_prefill_chunk", "pcp_dcp.kv_gather"),
    Probe(V32_ATTENTION, "maybe_gather_mla_latent_cache_inputs", "pcp.cache_inputs_gather"),
    Probe(V32_ATTENTION, "finalize_mla_pcp_decode", "pcp.finalize_decode"),
    Probe(FLASHATTN, "FlashAttnMLASparseMetadataBuilder.update_draft_decode_metadata", "mtp_draft.update"),
    # FLASHINFER_MLA_SPARSE_SM90: its builder's FlashInfer plan (host lengths, replans, the device clamp of each
    # work item's kv_end), forward_mqa's cache dtype and page packing, and FlashInfer's planner (stand-in) decisions
    Probe(FLASHINFER_SM90, "FlashInferMLASparseSM90Builder.build", before=_build_args),
    Probe(FLASHINFER_SM90, "FlashInferMLASparseSM90Impl.forward_mqa", "mqa", before=_sm90_kv_dtype),
    Probe(FLASHINFER_SM90, "_SM90State.plan", before=_sm90_plan_kind, after=_sm90_plan_reused),
    Probe(FLASHINFER_SM90, "_SM90State._plan", "sm90.plan.replanned"),
    Probe(FLASHINFER_SM90, "_SM90State._clamp_kv_end", "sm90.plan.clamp_kv_end"),
    Probe(FLASHINFER_SM90, "_SM90State.pack_indices", "sm90.pack_indices"),
    Probe(FLASHINFER_STANDIN, "mla_plan", after=_flashinfer_plan),
    Probe(FLASHINFER_STANDIN, "BatchMLAPagedAttentionWrapper.run", "kernel.flashinfer_mla"),
    Probe("flashinfer.mla", "BatchMLAPagedAttentionWrapper.run", "kernel.flashinfer_mla"),  # FlashInfer's own
    # FLASHINFER_MLA_SPARSE (SM100, trtllm-gen) and FLASHINFER_MLA_SPARSE_SM120: their kernel calls (the stand-in's
    # entry for each device), SM100's query dtype and draft update, SM120's scale format and its own forward_mqa
    Probe(FLASHINFER_SPARSE, "FlashInferMLASparseImpl._forward_mqa_kernel", before=_sm100_kv_dtype),
    Probe(FLASHINFER_SPARSE, "FlashInferMLASparseTRTLLMMetadataBuilder.update_draft_decode_metadata", "mtp_draft.update"),
    Probe(FLASHINFER_SM120, "FlashInferMLASparseSM120Impl.forward_mqa", "mqa"),
    Probe(FLASHINFER_SM120, "FlashInferMLASparseSM120Impl._run_mqa_kernel", before=_sm120_scale_format),
    Probe(FLASHINFER_TRTLLM_STANDIN, "_sm100", "kernel.trtllm_gen_sparse"),
    Probe(FLASHINFER_TRTLLM_STANDIN, "_sm120", "kernel.sm120_sparse"),
    # FLASH_ATTN_MLA_SPARSE_FA4: FA4's kernel for decode batches (the stand-in's entry), sparse decode or MLA forward
    Probe(FA4_STANDIN, "_flash_attn_fwd", before=_fa4_kernel),
    Probe(FLASHMLA, "FlashMLASparseImpl._bf16_flash_mla_kernel", "kernel.bf16_sparse", before=_bf16_kernel_heads),
    Probe(FLASHMLA, "FlashMLASparseImpl._fp8_flash_mla_kernel", "kernel.fp8_decode", before=_fp8_kernel_heads),
    # the top-k index conversion, wherever it is looked up
    Probe(INDEX_GROUP, "SparseMLAIndexGroup.convert_logical_to_physical_topk", "index_group.convert"),
    *(Probe(m, REMAP, before=_remap_modes) for m in (SPARSE_UTILS, FLASHMLA, INDEX_GROUP, SPARSE_MLA, XPU,
                                                     FLASHINFER_SM90, FLASHINFER_SM120)),
    *(Probe(m, DCP_FILTER, before=_dcp_filter_modes) for m in (SPARSE_UTILS, FLASHMLA)),
    # DeepSeek-V4 (FLASHMLA_SPARSE_DSV4): the builders' split and Triton metadata kernels, the layer's routes,
    # the prefill's gather and combine, FlashMLA's decode (SWA only, or with the compressed cache) and prefill
    Probe(DSV4_SWA, SPLIT, after=_split_result),
    Probe(DSV4_SPARSE_MLA, SPLIT, after=_split_result),
    Probe(DSV4_SWA, "DeepseekSparseSWAMetadataBuilder.build", before=_build_args),
    Probe(DSV4_SWA, "ComputeSWAIndicesAndLensKernel.__call__", "dsv4.swa_indices"),
    Probe(DSV4_SWA, "ComputePrefillMetadataKernel.__call__", "dsv4.prefill_gather_lens"),
    Probe(DSV4_SWA, "DeepseekSparseSWAMetadata.get_prefill_chunk_plan", after=_dsv4_chunks),
    Probe(DSV4_COMPRESSOR_UTILS, "CompressedSlotMappingKernel.__call__", "dsv4.compressed_slot_mapping"),
    Probe(DSV4_SPARSE_MLA, "BuildC128ATopkMetadataKernel.__call__", "dsv4.c128a_topk_metadata"),
    Probe(DSV4_LAYER, "DeepseekV4FlashMLAAttention._forward_decode", before=_dsv4_decode),
    Probe(DSV4_LAYER, "DeepseekV4FlashMLAAttention._forward_prefill", before=_dsv4_prefill),
    Probe(DSV4_LAYER, "compute_global_topk_indices_and_lens", "dsv4.global_topk"),
    Probe(DSV4_LAYER, "dequantize_and_gather_k_cache", before=_dsv4_gather),
    Probe(DSV4_LAYER, "combine_topk_swa_indices", "dsv4.combine"),
    Probe(DSV4_LAYER, "flash_mla_with_kvcache", before=_dsv4_decode_kernel),
    Probe(DSV4_LAYER, "flash_mla_sparse_fwd", "dsv4.kernel.prefill"),
    # DeepSeek-V4.1 (FLASHMLA_SPARSE_DSV41): its layer's routes, gathers, combine and FlashMLA calls (the SWA
    # builder's kernels and the compressed slot mapping are V4's, recorded above)
    Probe(DSV41_LAYER, "DeepseekV4FlashMLAAttention._forward_decode", before=_dsv41_decode),
    Probe(DSV41_LAYER, "DeepseekV4FlashMLAAttention._forward_prefill", before=_dsv41_prefill),
    Probe(DSV41_LAYER, "compute_global_topk_indices_and_lens", "dsv41.global_topk"),
    Probe(DSV41_LAYER, "dequantize_and_gather_k_cache", before=_dsv41_gather),
    Probe(DSV41_LAYER, "combine_topk_swa_indices", "dsv41.combine"),
    Probe(DSV41_LAYER, "flash_mla_with_kvcache", before=_dsv41_decode_kernel),
    Probe(DSV41_LAYER, "flash_mla_sparse_fwd", "dsv41.kernel.prefill"),
    # Step5's DSA decode route (STEP5_DSA): the summary update, the indexer's scores, the region selection, the
    # paged sparse attention
    *(Probe(m, "Step5SparseSummaryCache.update_decode", "step5.summary.decode") for m in STEP5_SUMMARY),
    Probe(STEP5_ADAPTER, "decode_summary_scores", "step5.scores.direct"),
    Probe(STEP5_ADAPTER, "Step5FlashInferSparse.pack_decode_summaries", "step5.scores.packed"),
    Probe(STEP5_ADAPTER, "select_regions", before=_step5_select),
    Probe(STEP5_ADAPTER, "sparse_decode_attention", before=_step5_attention),
)

# Every name a probe can record, for reports (paths never seen are worth showing too).
KNOWN_PATHS: tuple[str, ...] = (
    "batch.decode_only", "batch.mixed", "batch.prefill_only", "batch.empty", "batch.multi_token_decodes",
    "batch.padding_rows", "mqa", "mha.dense", "mha.chunked_context", "mha.chunked_context.dcp", "mha.masked",
    "mha.masked.chunked_context", "bf16", "fp8.mixed_batch", "fp8.separate_prefill_decode", "kernel.bf16_sparse",
    "kernel.bf16_sparse.padded_heads", "kernel.fp8_decode", "kernel.fp8_decode.padded_heads", "index_group.convert",
    "remap", "remap.workspace", "remap.workspace.rank_major", "remap.valid_counts", "remap.idx_mapping", "remap.in_place", "remap.block_stride",
    "dcp.filter", "dcp.filter.compacted", "dcp.filter.in_place", "kernel.fa3_sparse", "mtp_draft.update",
    "sm90.bf16", "sm90.fp8", "sm90.plan.exact", "sm90.plan.upper_bound", "sm90.plan.replanned", "sm90.plan.reused", "sm90.plan.clamp_kv_end",
    "sm90.pack_indices", "flashinfer.plan.cluster1", "flashinfer.plan.cluster2", "flashinfer.plan.split_kv",
    "kernel.flashinfer_mla", "sm100.bf16", "sm100.fp8", "sm120.pow2_fp32", "sm120.arbitrary_fp32",
    "kernel.trtllm_gen_sparse", "kernel.sm120_sparse", "kernel.fa4_sparse_decode", "kernel.fa4_mla_forward",
    "dsv4.swa_indices", "dsv4.prefill_gather_lens", "dsv4.prefill.chunks", "dsv4.compressed_slot_mapping",
    "dsv4.c128a_topk_metadata", "dsv4.decode.swa_only", "dsv4.decode.c4a", "dsv4.decode.c128a",
    "dsv4.prefill.swa_only", "dsv4.prefill.c4a", "dsv4.prefill.c128a", "dsv4.global_topk",
    "dsv4.dequant_gather.compressed", "dsv4.dequant_gather.swa", "dsv4.combine", "dsv4.kernel.decode.swa",
    "dsv4.kernel.decode.extra", "dsv4.kernel.prefill",
    *(f"dsv41.{route}.{kind}" for route in ("decode", "prefill")
      for kind in ("swa_only", "c1a", "c2a", "c1a.shared", "c2a.shared")),
    "dsv41.global_topk", "dsv41.dequant_gather.compressed", "dsv41.dequant_gather.swa", "dsv41.dequant_gather.mxfp8",
    "dsv41.combine",
    "dsv41.kernel.decode.swa", "dsv41.kernel.decode.extra", "dsv41.kernel.prefill", "pcp_dcp.prefill_shards", "pcp_dcp.prefill_shards.split",
    "pcp_dcp.prefill_shards.whole", "pcp_dcp.kv_gather", "pcp.cache_inputs_gather", "pcp.finalize_decode",
    "indexer.decode", "indexer.decode.native_mtp", "indexer.decode.flattened", "indexer.decode.requires_padding",
    "indexer.decode.pack", "indexer.prefill", "indexer.prefill.chunks", "indexer.prefill.query_subchunks",
    "dsv32.layer.indexer", "dsv32.layer.skip_topk", "dsv32.indexer_op", "indexer.dcp_merge", "dcp.query_gather",
    "dcp.combine", "shardq.none", "shardq.split", "shardq.split.after_decodes",
    "step5.summary.decode", "step5.scores.direct", "step5.scores.packed", "step5.select.all", "step5.select.topk",
    "step5.attention.splits", "step5.attention.one_split", "step5.attention.fp8", "step5.attention.gated",
    "step5.attention.groups",
    *(f"indexer.topk.{b}" for b in ("cooperative", "persistent", "per_row", "torch", "deep_select", "flashinfer",
                                    "aiter")),
)


# -- installing -----------------------------------------------------------------------------------------------

def _wrap(fn: Callable, probe: Probe) -> Callable:
    @functools.wraps(fn)  # keeps __wrapped__: mutants that read inspect.getsource still see vLLM's source
    def probe_wrapper(*args, **kwargs):
        paths = _current
        if paths is None:
            return fn(*args, **kwargs)
        if probe.path:
            paths.add(probe.path)  # before the call: a path that raises was still taken
        if probe.before is not None:
            paths.update(probe.before(args, kwargs))
        result = fn(*args, **kwargs)
        if probe.after is not None:
            paths.update(probe.after(args, kwargs, result))
        return result

    setattr(probe_wrapper, _MARK, probe)
    return probe_wrapper


def _owner(probe: Probe):
    """(the object holding the function, its attribute name), or None where this release lacks it or the
    process has not imported its module (importing it here could come before a target's CPU shims; the
    next case's install() wraps it once the target has imported it)."""
    owner = sys.modules.get(probe.module)
    if owner is None:
        return None
    *classes, attr = probe.name.split(".")
    for c in classes:
        owner = getattr(owner, c, None)
        if owner is None:
            return None
    return owner, attr


def install(probes: Iterable[Probe] = PROBES) -> tuple[str, ...]:
    """Wrap every probe's function that is not wrapped yet; returns the probes in place."""
    offered = []
    for probe in probes:
        where = _owner(probe)
        if where is None:
            continue
        owner, attr = where
        fn = inspect.getattr_static(owner, attr, None)
        if not inspect.isfunction(fn):  # absent here, or a staticmethod/property: nothing to wrap
            continue
        offered.append(f"{probe.module.rsplit('.', 1)[-1]}.{probe.name}")
        if not getattr(fn, _MARK, None):
            setattr(owner, attr, _wrap(fn, probe))
    return tuple(offered)


@contextlib.contextmanager
def recording() -> Iterator[set[str]]:
    """The set of paths vLLM takes inside this block (for one case)."""
    global _current
    install()
    paths: set[str] = set()
    outer, _current = _current, paths
    try:
        yield paths
    finally:
        _current = outer


def observe_paths(observe: Callable[..., object], *args, **kwargs):
    """`observe(*args, **kwargs)` (a target's `Target.observe`, which runs the call into vLLM) while recording;
    the paths go into the Observation's notes["paths"]. The one call a target's run() makes into this module."""
    with recording() as paths:
        obs = observe(*args, **kwargs)
    obs.notes["paths"] = sorted(paths)
    return obs


# -- what a campaign makes of them ----------------------------------------------------------------------------

def rarity(paths: Iterable[str], counts: dict[str, int]) -> float:
    """Hypothesis's target score for a case: sum of 1/count over its paths (counts include this case), so a
    case that reaches a path seldom seen scores high and the search climbs toward it."""
    return sum(1.0 / max(counts.get(p, 0), 1) for p in paths)
