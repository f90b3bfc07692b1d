"""vLLM's FlashMLA sparse backend under decode (DCP) and prefill (PCP) context parallelism, every rank emulated
in one process, driven as its model runner and layer drive each rank.

Each function is one vLLM call sequence, written once: the DCP / PCP targets' ranks call them on the case's
tensors, and a reproducer shows the same functions (their source, copied into repro.py) on the tensors it
saved. `replay_dcp_ranks`, `replay_layer_dcp_ranks` and `replay_pcp_ranks` are the reproducers' loops over the
ranks; the calls inside them are the ones the targets' ranks make.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import torch

from fuzzer.support import pcp_runtime
from fuzzer.support.dcp_group import EmulatedDcpGroup, LockstepRanks, installed_dcp_group, installed_groups
from fuzzer.support.flashmla_runtime import record_routes
from fuzzer.support.vllm_setup import HEAD_SIZE, KV_LORA_RANK, LAYER, QK_NOPE, V_HEAD, guard_index_group, has_cache_op
from fuzzer.support.sparse_mla_steps import (
    TOPK_POISON,
    layer_forward,
    metadata_builder,
    mla_attention_engine,
    sparse_mla_impl,
)
from fuzzer.support.standins.flashmla_ops import concat_and_cache_mla
from fuzzer.support.vllm_calls import returned

# vLLM's direct DCP paths (symmetric memory, multicast) need a real process group: the emulated ranks share none.
DIRECT_DCP_ENV = ("VLLM_USE_DIRECT_DCP_Q_GATHER", "VLLM_USE_DIRECT_DCP_KV_GATHER", "VLLM_USE_DIRECT_DCP_A2A")


def direct_dcp_off(names=DIRECT_DCP_ENV) -> None:
    """Keep vLLM's direct DCP paths off (unless the environment says otherwise), before vLLM reads them."""
    for name in names:
        os.environ.setdefault(name, "0")


def on_dcp_ranks(dcp_size: int, rank_step) -> list:
    """rank_step(r) on every rank of a DCP group of `dcp_size` ranks emulated in this process (threads, one at a
    time), vLLM's DCP group being attnfuzz's in-process one; their results in rank order."""
    ranks = LockstepRanks(dcp_size)
    with installed_dcp_group(EmulatedDcpGroup(ranks)):
        return ranks.run(rank_step)


def rank_heads(t, heads: int, rank: int):
    """Rank `rank`'s heads of q [tokens, ranks * heads, ...] (TP splits the heads)."""
    return t[:, rank * heads:(rank + 1) * heads].contiguous()


def rank_kv_b_weight(kv_b_weight, heads: int, rank: int):
    """Rank `rank`'s rows of kv_b_proj's weight (128 nope + 128 v rows a head), as its ColumnParallelLinear holds them."""
    return kv_b_weight[rank * heads * (QK_NOPE + V_HEAD):(rank + 1) * heads * (QK_NOPE + V_HEAD)]


def rank_metadata(builder, cfg, cam, slot_mapping, **dcp_fields):
    """The rank's attention metadata: the step's CommonAttentionMetadata with the rank's slot mapping (-1 for the
    other ranks' tokens) and any `dcp_fields` this release declares, built by the rank's builder."""
    from vllm.config import set_current_vllm_config

    extra = {k: v for k, v in dcp_fields.items() if hasattr(cam, k)}
    with set_current_vllm_config(cfg), torch.inference_mode():
        return builder.build(0, dataclasses.replace(cam, slot_mapping=slot_mapping, **extra))


# -- forward_mqa under DCP ------------------------------------------------------------------------------------

def dcp_rank_engine(backend, spec, cfg, heads: int, kv_cache_dtype: str, topk_indices_buffer, device: str):
    """(builder, impl, MLADCPManager or None) of one rank, as MLAAttention makes them when DCP is on: the impl, the
    manager on this rank's DCP group, registered with the layer in the forward context, where the builder finds it.
    Call on the rank's thread."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.ops.dcp import MLADCPManager

    with set_current_vllm_config(cfg), torch.inference_mode():
        impl = sparse_mla_impl(backend, heads, kv_cache_dtype, topk_indices_buffer)
        manager = None
        if cfg.parallel_config.decode_context_parallel_size > 1:
            manager = MLADCPManager(vllm_config=cfg, device=torch.device(device), num_heads=heads,
                                    query_head_dim=HEAD_SIZE, output_head_dim=KV_LORA_RANK,
                                    query_dtype=torch.bfloat16, output_dtype=torch.bfloat16,
                                    padded_num_heads=getattr(impl, "q_pad_num_heads", None),
                                    is_lse_base_on_e=impl.lse_base_on_e, use_pcp=False)
        cfg.compilation_config.static_forward_context[LAYER] = SimpleNamespace(prefill_backend=None,
                                                                               dcp_manager=manager)
        builder = metadata_builder(backend, spec, cfg, device)
    return builder, impl, manager


def dcp_forward_mqa(impl, manager, q, kv_cache, metadata):
    """The rank's MQA tokens as MLAAttention.forward_impl drives them under DCP: the query all-gather over the DCP
    group, forward_mqa (the fp8 mixed-batch path filters the global top-k to the rank's slots), the LSE combine.
    Returns (the rank's heads after the combine, its partial LSE, its partial output), the partial ones copied
    before the combine, which corrects both in place; without DCP (manager None) (forward_mqa's out, None, None)."""
    call = f"{type(impl).__name__}.forward_mqa"
    if manager is None:
        return returned(impl.forward_mqa(q, kv_cache, metadata, None), 2, call)[0], None, None
    out, lse = returned(impl.forward_mqa(manager.query_gather(q), kv_cache, metadata, None), 2, call)
    partial_lse, partial = lse.clone(), out.clone()
    out = manager.combine(out, lse, seq_lens=metadata.seq_lens, query_start_loc=metadata.query_start_loc)
    return out, partial_lse, partial


# -- MLAAttention under DCP -----------------------------------------------------------------------------------

def dcp_layer_engine(backend, spec, cfg, heads: int, kv_b_weight, topk_indices_buffer, device: str):
    """(builder, MLAAttention, its route counts) of one rank: the layer makes its MLADCPManager on this rank's DCP
    group and the builder hands it the context-gather collective, which vLLM runs as torch.distributed's
    all_gather_into_tensor on the group's device_group: the same collective over the emulated ranks here, which
    have no process group. Call on the rank's thread."""
    builder, layer, route = mla_attention_engine(backend, spec, cfg, heads, kv_b_weight, topk_indices_buffer, device)
    manager = layer.dcp_manager
    if getattr(manager, "_kv_gather", None) is not None:
        manager._kv_gather = manager.group.all_gather_into_tensor
    route.update(mqa_tokens=0, mha_tokens=0)
    return builder, layer, route


def layer_rank_metadata(builder, cfg, cam, slot_mapping, dcp_size: int, dcp_rank: int, interleave: int):
    """The rank's metadata for the layer: its slot mapping and its DCP-local sequence lengths."""
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    local = get_dcp_local_seq_lens(cam.seq_lens, dcp_size, dcp_rank, interleave)
    return rank_metadata(builder, cfg, cam, slot_mapping, dcp_local_seq_lens=local,
                         dcp_local_seq_lens_cpu_upper_bound=local.cpu())


# -- PCP x DCP ------------------------------------------------------------------------------------------------

def layer_cache_writer(device: str, fp8_scales: str):
    """What vLLM's concat_and_cache_mla is for the layer: None (vLLM's own) where this host has it, else attnfuzz's
    stand-in writing fp8_ds_mla entries with `fp8_scales`."""
    if device != "cpu" and has_cache_op("concat_and_cache_mla"):
        return None
    return lambda kv_c, k_pe, cache, slots: concat_and_cache_mla(kv_c, k_pe, cache, slots, "fp8_ds_mla", None, fp8_scales)


def on_pcp_ranks(cfg, ranks, groups, pcp: int, tp: int, write, rank_step) -> list:
    """rank_step(w) on every rank of the emulated PCP x TP world (`pcp_runtime.emulated_world`), with the config as
    a PCP x TP engine's and vLLM's TP / PCP / DCP groups the emulated ones; their results in rank order."""
    with pcp_runtime.context_parallel(cfg, pcp, tp, write), installed_groups(**groups):
        return ranks.run(rank_step)


def pcp_rank_topk(topk_indices_buffer, topk_all, manager, local):
    """The indexer's buffer of the rank: its tokens' rows (the batch tokens the rank's PCP partition gave it),
    the rest poisoned. Returns the batch token of each of the rank's rows."""
    rows = manager._local_gather_idx  # padding rows: token 0
    topk_indices_buffer.fill_(TOPK_POISON)
    topk_indices_buffer[:local.num_tokens] = topk_all[rows[:local.num_tokens]]
    return rows


def pcp_rank_engine(backend, spec, cfg, heads: int, kv_b_weight, topk_indices_buffer, device: str):
    """(builder, DeepSeek-V3.2's attention layer on the rank's heads, its route counts). Call on the rank's thread."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(cfg), torch.inference_mode():
        layer = pcp_runtime.pcp_layer(cfg, heads, kv_b_weight, topk_indices_buffer, device)
        route: dict = {}
        record_routes(layer.impl, route)
        builder = metadata_builder(backend, spec, cfg, device)
    return builder, layer, route


def pcp_rank_metadata(cfg, builder, backend, spec, manager, local, block_table, global_slot_mapping):
    """(the slot mapping the rank's layer writes with, its metadata): vLLM's PCP conversion of the global batch's
    slot mapping (this DCP rank's slots, -1 for others'), DefaultModelState.prepare_attn on the local batch."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(cfg), torch.inference_mode():
        slot_mapping = pcp_runtime.rank_slot_mapping(manager, global_slot_mapping)
        return slot_mapping, pcp_runtime.rank_metadata(cfg, builder, backend, spec, local, block_table, slot_mapping)


# -- reproducers: every rank of the saved step --------------------------------------------------------------

def saved_cache(rows, num_blocks: int, block_size: int, block_stride_rows: int):
    """A rank's paged cache from its saved rows, blocks `block_stride_rows` rows apart."""
    width = rows.shape[-1]
    return rows.as_strided((num_blocks, block_size, width), (block_stride_rows * width, width, 1))


def replay_dcp_ranks(backend, spec, cfg, cam, T, dcp_size: int, heads: int, kv_cache_dtype: str, num_blocks: int,
                     block_size: int, block_stride_rows: int, device: str, found: list):
    """Every rank as the target runs it: its cache as its writer left it (its own tokens), its copy of the indexer's
    buffer, its heads of q; forward_mqa under DCP. Returns (every rank's heads after vLLM's combine, in rank order;
    each rank's partial LSE)."""
    from vllm.config import set_current_vllm_config

    lses = {}

    def rank_step(r):
        cache = saved_cache(T[f"kv_cache_rows.rank{r}"], num_blocks, block_size, block_stride_rows)
        with set_current_vllm_config(cfg), torch.inference_mode():
            builder, impl, manager = dcp_rank_engine(backend, spec, cfg, heads, kv_cache_dtype,
                                                     T["topk_indices_buffer"].clone(), device)
            metadata = rank_metadata(builder, cfg, cam, T[f"slot_mapping.rank{r}"])
            check_overrun = guard_index_group(impl)
            out, lse, _ = dcp_forward_mqa(impl, manager, rank_heads(T["q"], heads, r), cache, metadata)
            found.extend(f"rank {r}: {m}" for m in check_overrun(T["q"].shape[0]))
        if lse is not None:
            lses[r] = lse
        return out

    return torch.cat(on_dcp_ranks(dcp_size, rank_step), dim=1), lses


def replay_layer_dcp_ranks(backend, spec, cfg, cam, T, dcp_size: int, interleave: int, heads: int, num_blocks: int,
                           block_size: int, block_stride_rows: int, device: str, found: list):
    """Every rank as the target runs it: its cache as its writer left it (its own tokens), its MLAAttention (its
    heads of q, its rows of kv_b_proj), forward_impl on every new token. Returns (every rank's heads, in rank
    order, [tokens, heads, 128]; rank 0's route counts)."""
    from vllm.config import set_current_vllm_config

    route = {}

    def rank_step(r):
        cache = saved_cache(T[f"kv_cache_rows.rank{r}"], num_blocks, block_size, block_stride_rows)
        with set_current_vllm_config(cfg), torch.inference_mode():
            builder, layer, rank_route = dcp_layer_engine(backend, spec, cfg, heads,
                                                          rank_kv_b_weight(T["kv_b_weight"], heads, r),
                                                          T["topk_indices_buffer"].clone(), device)
            metadata = layer_rank_metadata(builder, cfg, cam, T[f"slot_mapping.rank{r}"], dcp_size, r, interleave)
            check_overrun = guard_index_group(layer.impl)
            output = torch.full((T["q"].shape[0], heads * V_HEAD), float("nan"), dtype=torch.bfloat16, device=device)
            # Decode tokens go to forward_mqa, short prefills to dense MHA with the DCP context gather.
            layer_forward(layer, rank_heads(T["q"], heads, r), T["kv_c_normed"], T["k_pe"], cache, metadata, output)
            found.extend(f"rank {r}: {m}" for m in check_overrun(rank_route["mqa_tokens"]))
        if r == 0:
            route.update(rank_route)
        return output

    return torch.cat(on_dcp_ranks(dcp_size, rank_step), dim=1).unflatten(1, (-1, V_HEAD)), route


def replay_pcp_ranks(backend, spec, cfg, T, batch, pcp: int, tp: int, dcp_size: int, interleave: int, heads: int,
                     num_blocks: int, block_size: int, block_stride_rows: int, write, device: str, found: list):
    """Every rank of the PCP x TP world as the target runs it: its cache holding its DCP shard of the context,
    vLLM's PCP partition of the global `batch`, the indexer's rows of its tokens, DeepSeek-V3.2's layer on its
    heads (it writes the step's tokens itself), PCPManager's restore. Returns (the restored output, the TP ranks'
    heads side by side [tokens, heads, 128]; rank 0's route counts)."""
    from vllm.config import set_current_vllm_config

    ranks, groups = pcp_runtime.emulated_world(pcp, tp, dcp_size, cfg, device)
    route = {}

    def rank_step(w):
        p, t = divmod(w, tp)  # PCP rank, TP rank
        d = groups["_DCP"].rank_in_group
        cache = saved_cache(T[f"kv_cache_rows.dcp{d}"].clone(), num_blocks, block_size, block_stride_rows)
        with set_current_vllm_config(cfg), torch.inference_mode():
            manager, local = pcp_runtime.rank_batch(batch, pcp, p, dcp_size, d, interleave, device)
            topk_indices_buffer = torch.empty_like(T["topk_indices_buffer"])
            rows = pcp_rank_topk(topk_indices_buffer, T["topk_indices_buffer"], manager, local)
            builder, layer, rank_route = pcp_rank_engine(backend, spec, cfg, heads, rank_kv_b_weight(T["kv_b_weight"], heads, t),
                                                         topk_indices_buffer, device)
            slot_mapping, metadata = pcp_rank_metadata(cfg, builder, backend, spec, manager, local, T["block_table"],
                                                       T[f"slot_mapping.dcp{d}"])
            check_overrun = guard_index_group(layer.impl)
            output = torch.full((len(rows), heads * V_HEAD), float("nan"), dtype=torch.bfloat16, device=device)
            pcp_runtime.forward(layer, cfg, local, metadata, slot_mapping, cache, rank_heads(T["q"][rows], heads, t),
                                T["kv_c_new"][rows], T["k_pe_new"][rows], output)
            restored = manager.restore_hidden_states(output)  # every PCP rank's rows back in batch order
            found.extend(f"rank {w}: {m}" for m in check_overrun(rank_route.get("mqa_tokens", 0)))
        if w == 0:
            route.update(rank_route)
        return restored

    restored = on_pcp_ranks(cfg, ranks, groups, pcp, tp, write, rank_step)
    return torch.cat(restored[:tp], dim=1).unflatten(1, (-1, V_HEAD)), route
