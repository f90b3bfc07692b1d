"""Prefill context parallelism (PCP) with DCP on FLASHMLA_SPARSE, every rank emulated in one process, each fed
as vLLM's model runner (MRV2) feeds it: shared by the target and its reproducers (whose attnfuzz_support.py
carries this file). torch, numpy and vLLM only (plus attnfuzz's emulated groups).

A rank's step, top to bottom, in vLLM's own code where vLLM has it:
  - the global batch (an `InputBatch` of the scheduled step) goes through `PCPManager.partition_batch`, which
    gives this PCP rank its rows: two head-tail chunk rows of every prefill long enough to split, the decodes
    and too-short prefills whole (without DCP each decode on one rank only) (`global_batch`, `rank_batch`); under
    DCP the runner then sets the local batch's DCP-local sequence lengths (`prepare_dcp_local_seq_lens`);
  - `PCPManager._convert_to_gathered_slot_mappings` turns the global batch's slot mapping (DCP-sharded: -1 for
    another DCP rank's tokens) into the rank-major mapping of every PCP rank's tokens the layer writes;
  - `DefaultModelState.prepare_attn` makes the rank's CommonAttentionMetadata from its local batch (req_idx,
    dcp_local_seq_lens_cpu_upper_bound, is_prefilling, ...) and has the layer's builder build on it;
  - DeepSeek-V3.2's sparse attention layer (`DeepseekV32Attention._sparse_indexer_and_attn`: the layer that
    supports PCP + DCP) writes the PCP-gathered new tokens into the rank's cache, all-gathers q over TP when
    DCP spans more ranks than PCP, runs `forward_mqa` (prefill rows over the DCP-gathered KV:
    `_gather_prefill_chunk`; decode rows over the rank's shard, merged by `MLADCPManager.combine`) and W_UV;
  - `PCPManager.restore_hidden_states` all-gathers the PCP ranks' outputs back into batch order.
The layer is made without DeepSeek-V3.2's own __init__ (its projections, indexer and RoPE need a checkpoint's
config): `MLAAttention.__init__` on an instance of the class, as `flashmla_runtime.mla_layer` builds the plain layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from types import SimpleNamespace

import numpy as np
import torch

from fuzzer.support import dcp_group
from fuzzer.support.dsv32_runtime import V32_ATTENTION, dsv32_layer, forward_context_maps
from fuzzer.support.flashmla_runtime import BACKEND_MODULE
from fuzzer.support.vllm_setup import LAYER, QK_NOPE

PCP_MANAGER = "vllm.v1.worker.gpu.pcp_manager"


def missing() -> str | None:
    """None where the installed vLLM runs FLASHMLA_SPARSE's PCP + DCP prefill gather, else what it lacks."""
    try:
        fm = importlib.import_module(BACKEND_MODULE)
        fm.gathered_prefill_shards  # noqa: B018
        fm.FlashMLASparseImpl._gather_prefill_chunk  # noqa: B018
        if not importlib.import_module(V32_ATTENTION).DeepseekV32Attention.supports_pcp_dcp:
            return "DeepSeek-V3.2's attention layer does not support PCP + DCP"
        importlib.import_module(PCP_MANAGER).PCPManager.partition_batch  # noqa: B018
        importlib.import_module("vllm.v1.worker.gpu.model_states.default").DefaultModelState.prepare_attn  # noqa: B018
    except (ImportError, AttributeError) as e:
        return f"this vLLM has no PCP + DCP prefill gather for FLASHMLA_SPARSE: {type(e).__name__}: {e}"
    return None


def emulated_world(pcp: int, tp: int, dcp: int, cfg, device: str):
    """(LockstepRanks of the PCP x TP world, its group coordinators for `dcp_group.installed_groups`). Each rank
    holds its own forward context, workspace manager, static forward context (its layer registers there) and
    current vLLM config, as each real rank's process does."""
    import vllm.config.vllm as config_module
    import vllm.forward_context as forward_context
    import vllm.v1.worker.workspace as workspace

    world = pcp * tp
    ranks = dcp_group.LockstepRanks(world)
    ranks.own(workspace, "_manager", [workspace.WorkspaceManager(torch.device(device)) for _ in range(world)])
    ranks.own(forward_context, "_forward_context")
    ranks.own(cfg.compilation_config, "static_forward_context", [{} for _ in range(world)])
    ranks.own(config_module, "_current_vllm_config")
    layout = dcp_group.context_parallel_groups(pcp, tp, dcp)
    groups = {"_TP": dcp_group.EmulatedGroup(ranks, layout["tp"], "tp"),
              "_PCP": dcp_group.EmulatedGroup(ranks, layout["pcp"], "pcp"),
              "_DCP": dcp_group.EmulatedGroup(ranks, layout["dcp"], "dcp")}
    return ranks, groups


@contextlib.contextmanager
def context_parallel(cfg, pcp: int, tp: int, write=None):
    """The shared config as a PCP x TP engine's (restored after), FlashMLA's torch.distributed calls routed to
    the emulated groups, and `write(kv_c, k_pe, cache, slots)` as vLLM's `concat_and_cache_mla` where the host
    lacks the compiled op (None: vLLM's own)."""
    import vllm._custom_ops as custom_ops

    fm = importlib.import_module(BACKEND_MODULE)
    pc = cfg.parallel_config
    saved = (pc.prefill_context_parallel_size, pc.tensor_parallel_size, pc.dcp_comm_backend, fm.dist,
             custom_ops.concat_and_cache_mla)
    pc.prefill_context_parallel_size, pc.tensor_parallel_size = pcp, tp
    pc.dcp_comm_backend = "ag_rs"  # what vLLM's PCP + DCP requires (PCPManager.validate_config)
    fm.dist = dcp_group.emulated_dist()
    if write is not None:
        custom_ops.concat_and_cache_mla = (lambda kv_c, k_pe, cache, slots, kv_cache_dtype, scale, skip_scale=False:
                                           write(kv_c, k_pe, cache, slots))
    try:
        yield
    finally:
        (pc.prefill_context_parallel_size, pc.tensor_parallel_size, pc.dcp_comm_backend, fm.dist,
         custom_ops.concat_and_cache_mla) = saved


def global_batch(query_lens, context_lens, is_prefilling, device: str):
    """The scheduled step as the runner's `InputBatch` (before PCP partitions it): request i is request-state
    row i, its tokens at positions context_lens[i] .. + query_lens[i]."""
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    q = np.asarray(query_lens, dtype=np.int32)
    ctx = np.asarray(context_lens, dtype=np.int32)
    pre = np.asarray(is_prefilling, dtype=np.bool_)
    n, tokens = len(q), int(q.sum())
    dev = torch.device(device)
    dummy = InputBatch.make_dummy(n, max(tokens, n), InputBuffers(n, max(tokens, n), dev))
    qsl = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(q, out=qsl[1:])
    seq = torch.from_numpy(ctx + q)
    prefill_len = np.where(pre, ctx + q, ctx).astype(np.int32)  # a decode's prompt lies behind it
    positions = torch.cat([torch.arange(c, c + k) for c, k in zip(ctx.tolist(), q.tolist())] or
                          [torch.zeros(0, dtype=torch.int64)])
    return dataclasses.replace(
        dummy, num_scheduled_tokens=q, num_tokens=tokens, num_tokens_after_padding=tokens,
        query_start_loc_np=qsl, query_start_loc=torch.from_numpy(qsl).to(dev), seq_lens=seq.to(dev),
        seq_lens_cpu_upper_bound=seq.clone(), num_computed_tokens_np=ctx, prefill_len_np=prefill_len,
        num_computed_prefill_tokens_np=np.minimum(ctx, prefill_len), is_prefilling_np=pre, has_prefill=bool(pre.any()),
        decode_graph_eligible=not bool(pre.any()), positions=positions.to(dev),
        input_ids=torch.zeros(tokens, dtype=torch.int32, device=dev),
        is_padding=torch.zeros(tokens, dtype=torch.bool, device=dev))


def rank_batch(batch, pcp: int, pcp_rank: int, dcp: int, dcp_rank: int, interleave: int, device: str):
    """(this rank's PCPManager, its local InputBatch): vLLM's PCP partition of `batch` for an eager step (decodes
    sharded over the PCP ranks where there is no DCP, as the runner's manager is made), then, under DCP, the local
    batch's DCP-local sequence lengths as the model runner sets them after the partition (`execute_model`:
    `prepare_dcp_local_seq_lens` into the PCP manager's input buffers; the indexer's decode metadata reads them)."""
    from vllm.config import CUDAGraphMode, ParallelConfig
    from vllm.v1.worker.gpu.cp_utils import prepare_dcp_local_seq_lens

    pcp_manager = importlib.import_module(PCP_MANAGER)
    # maybe_build_pcp_manager's flag, by ParallelConfig's own rule (PCP without DCP shards decodes over the ranks)
    shard = ParallelConfig.pcp_shard_decode_requests.fget(
        SimpleNamespace(prefill_context_parallel_size=pcp, decode_context_parallel_size=dcp))
    manager = pcp_manager.PCPManager(pcp, pcp_rank, torch.device(device), shard_decode_requests=shard,
                                     max_num_reqs=batch.num_reqs, max_num_tokens=max(batch.num_tokens, 1),
                                     dcp_world_size=dcp, dcp_rank=dcp_rank, cp_interleave=interleave)
    local = manager.partition_batch(batch, SimpleNamespace(cg_mode=CUDAGraphMode.NONE, num_tokens=None, num_reqs=None))
    if dcp > 1:
        local.dcp_local_seq_lens = prepare_dcp_local_seq_lens(
            manager.input_buffers.dcp_local_seq_lens, local.seq_lens, local.num_reqs, dcp, dcp_rank, interleave,
            num_reqs_padded=local.num_reqs_after_padding)
    return manager, local


def rank_slot_mapping(manager, global_slot_mapping: torch.Tensor) -> torch.Tensor:
    """The slot mapping the rank's layer writes with: every PCP rank's tokens, rank-major and padded, from the
    global batch's (this DCP rank's slots, -1 for others'), through vLLM's PCP conversion."""
    return manager._convert_to_gathered_slot_mappings(global_slot_mapping.view(1, -1))[0]


def rank_metadata(cfg, builder, backend, spec, local, block_table: torch.Tensor, slot_mapping: torch.Tensor):
    """The rank's attention metadata: vLLM's DefaultModelState.prepare_attn on the local batch (eager), with its
    block table (the requests' rows the local batch names) and slot mapping, built by `builder`."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState
    from vllm.v1.worker.utils import AttentionGroup

    group = AttentionGroup(backend, [LAYER], spec, 0)
    group.metadata_builders = [builder]
    state = SimpleNamespace(max_model_len=cfg.model_config.max_model_len, supports_mm_inputs=False,
                            encoder_cache=None, model_config=cfg.model_config)
    kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=[LAYER])])
    rows = block_table[local.idx_mapping.long()]  # BlockTables.gather_block_tables: the local rows' requests
    metadata = DefaultModelState.prepare_attn(state, local, CUDAGraphMode.NONE, (rows,), slot_mapping.view(1, -1),
                                              [[group]], kv_cache_config)
    return metadata[LAYER]


def pcp_layer(cfg, heads: int, kv_b_weight: torch.Tensor, topk_indices_buffer: torch.Tensor, device: str):
    """DeepSeek-V3.2's sparse attention layer (the class vLLM lets run PCP + DCP) on FLASHMLA_SPARSE, with this
    rank's heads (`dsv32_runtime.dsv32_layer`: the impl, the MLADCPManager, W_UK/W_UV from kv_b_proj holding
    `kv_b_weight`, this rank's rows of the TP-split projection), no indexer (the top-k buffer holds the indexer's
    rows), registered as LAYER. Call inside `set_current_vllm_config(cfg)`, on the rank's thread."""
    layer = dsv32_layer(cfg, heads, kv_b_weight, topk_indices_buffer, None, None, device, disable_tp=True)
    layer._fp8_query = False  # fp8_ds_mla: FlashMLA takes a bf16 query
    return layer


def forward(layer, cfg, local, metadata, slot_mapping: torch.Tensor, kv_cache: torch.Tensor, q: torch.Tensor,
            kv_c: torch.Tensor, k_pe: torch.Tensor, output: torch.Tensor) -> None:
    """The layer's attention for the rank's tokens (rows as the model hands them, padded to the PCP ranks' largest
    batch): q [T, H, 192] after RoPE, kv_c [T, 512], k_pe [T, 64]; into output [T, H * 128]. W_UK absorbs q_nope
    as DeepseekV32Attention.forward does; the rest is `_sparse_indexer_and_attn` under the step's forward
    context (its metadata and slot mapping, the rank's cache bound to the layer)."""
    from vllm.forward_context import set_forward_context

    layer.kv_cache = kv_cache
    q_nope, q_pe = q[..., :QK_NOPE], q[..., QK_NOPE:]
    ql_nope = torch.bmm(q_nope.transpose(0, 1), layer.W_UK_T).transpose(0, 1)  # DeepseekV32Attention.forward
    with set_forward_context({LAYER: metadata}, cfg, slot_mapping={LAYER: slot_mapping}):
        layer._sparse_indexer_and_attn(local.positions, None, q_nope, q_pe, None, None, None, kv_c, k_pe, ql_nope,
                                       q_pe, output)


def module_forward(layers: list, cfg, local, mla_metadata, index_metadata, slot_mapping: torch.Tensor,
                   q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, index_q_fp8: torch.Tensor,
                   index_k: torch.Tensor, index_weights: torch.Tensor) -> list[torch.Tensor]:
    """The module's layers for the rank's tokens under PCP, in order, under one forward context (the MLA layers'
    metadata and the indexer's by their names, one slot mapping for both caches: every PCP rank's tokens,
    rank-major): q [T, H, 192] after RoPE, kv_c [T, 512], k_pe [T, 64], the indexer's fp8 queries [T, heads, 128],
    bf16 keys [T, 128] (under PCP the indexer gathers them over PCP and writes its cache itself) and head weights
    [T, heads]. Each layer absorbs q_nope through W_UK and runs `_sparse_indexer_and_attn` (the MLA cache write
    is the layer's own under PCP). Returns each layer's output [T, H * 128]."""
    from vllm.forward_context import set_forward_context

    metadata, slots = forward_context_maps(layers, mla_metadata, index_metadata, slot_mapping)
    rows = q.shape[0]
    hidden = torch.empty((rows, 1), dtype=torch.bfloat16, device=q.device)  # the seam reads only its row count
    outputs = []
    with set_forward_context(metadata, cfg, slot_mapping=slots):
        for layer in layers:
            q_nope, q_pe = q[..., :QK_NOPE], q[..., QK_NOPE:]
            ql_nope = torch.bmm(q_nope.transpose(0, 1), layer.W_UK_T).transpose(0, 1)  # DeepseekV32Attention.forward
            output = torch.full((rows, layer.num_local_heads * layer.v_head_dim), float("nan"), dtype=torch.bfloat16,
                                device=q.device)
            indexed = layer.indexer is not None
            layer._sparse_indexer_and_attn(local.positions, hidden, q_nope, q_pe, index_q_fp8 if indexed else None,
                                           index_k if indexed else None, index_weights if indexed else None, kv_c,
                                           k_pe, ql_nope, q_pe, output)
            outputs.append(output)
    return outputs

