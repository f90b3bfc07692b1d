"""`vllm.flashmla_sparse.dcp`: FlashMLA sparse under decode context parallelism, every rank emulated in one
process.

Each rank gets its own fp8_ds_mla cache holding only the tokens it owns (written through vLLM's slot
mapping, -1 for the others' tokens) and runs vLLM's per-rank path as the layer drives it for the MQA tokens:
the query all-gather (`MLADCPManager.query_gather`), the builder and `FlashMLASparseImpl.forward_mqa` on the
fp8 mixed-batch path, which filters the global top-k to the rank's local slots
(`triton_filter_and_convert_dcp_index`) and returns the rank's LSE, then vLLM's LSE combine
(`cp_lse_ag_out_rs`: all-gather of LSEs, `correct_attn_out`, reduce-scatter over heads). The collectives run
over `fuzzer.targets.dcp_group` (threads, one rank at a time). The merged heads are judged against
attention over the whole, undivided context (`oracles.dcp`); each rank's filtered indices exactly; each
rank's LSE over its own share.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import threading
from types import SimpleNamespace

import torch

from fuzzer.coverage import observe_paths
from fuzzer.guards import Guards
from fuzzer.targets.backend_harness import common_attn_metadata, step_tensors
from fuzzer.targets.dcp_group import EmulatedDcpGroup, LockstepRanks, installed_dcp_group
from fuzzer.targets.flashmla_runtime import (BACKEND_MODULE, KV_LORA_RANK, LAYER, configure, guard_index_group,
                                            impl_topk_kwargs)
from fuzzer.targets.flashmla_sparse import FlashMLASparse
from oracles.dcp import judge_dcp, rank_slot_mapping, rank_slots, undivided
from oracles.materialize import HEAD_SIZE, ROPE_DIM, SM_SCALE, materialize_attention_inputs
from strategies.batches import AttentionFeatures, attention_cases

# Per-rank records of vLLM's DCP filter (the rank's local top-k, and the BLOCK_STRIDE_ROWS it was called
# with: the fp8 kernel addresses 64-row pages, so vLLM passes none for 64-token blocks), filled per case.
_FILTERED: dict[int, tuple[torch.Tensor, int | None]] = {}
_FILTER_LOCK = threading.Lock()


def record_dcp_filter() -> None:
    """Wrap `triton_filter_and_convert_dcp_index` where flashmla_sparse looks it up (once per process)."""
    mod = importlib.import_module(BACKEND_MODULE)
    real = mod.triton_filter_and_convert_dcp_index
    if getattr(real, "_attnfuzz_recorded", False):
        return

    def recorded(*args, **kwargs):
        result = real(*args, **kwargs)
        out = result[0] if isinstance(result, tuple) else result
        with _FILTER_LOCK:
            _FILTERED[int(kwargs["dcp_rank"])] = (out.detach().clone(), kwargs.get("BLOCK_STRIDE_ROWS"))
        return result

    recorded._attnfuzz_recorded = True
    mod.triton_filter_and_convert_dcp_index = recorded


class FlashMLASparseDcp(FlashMLASparse):
    name = "vllm.flashmla_sparse.dcp"
    summary = ("FlashMLA sparse under DCP, every rank emulated in one process: query all-gather, per-rank fp8 "
               "mixed-batch forward_mqa with the DCP top-k filter, vLLM's LSE combine")
    bug_classes = "B C G J"
    oracle = staticmethod(judge_dcp)
    real_parts = ("MLADCPManager (query gather, cp_lse_ag_out_rs combine)", "FlashMLASparseMetadataBuilder",
                  "FlashMLASparseImpl.forward_mqa (fp8 mixed batch)", "triton_filter_and_convert_dcp_index",
                  "correct_attn_out (Triton)")
    kv_cache_dtypes = ("fp8_ds_mla",)  # vLLM runs FlashMLA sparse under DCP on an fp8_ds_mla cache only

    def unavailable(self) -> str | None:
        why = super().unavailable()
        if why is None:
            try:
                importlib.import_module("vllm.v1.attention.ops.dcp").MLADCPManager  # noqa: B018
            except (ImportError, AttributeError) as e:
                why = f"this vLLM has no MLADCPManager (vllm.v1.attention.ops.dcp): {e}"
        return why

    def prepare(self) -> None:
        # vLLM's direct (symmetric-memory, multicast) DCP paths need a real process group; keep them off.
        os.environ.setdefault("VLLM_USE_DIRECT_DCP_Q_GATHER", "0")
        super().prepare()
        record_dcp_filter()

    def cases(self, profile):
        # The mixed-batch path (< 32 heads per rank) with gathered heads inside one fp8 envelope (<= 64).
        return attention_cases(profile, AttentionFeatures(kv_cache_dtypes=self.kv_cache_dtypes, heads=(8, 16),
                                                          block_sizes=(64, 128), dcp=True, block_stride_rows=True))

    def run(self, case):
        from vllm.config import set_current_vllm_config
        from vllm.v1.attention.ops.dcp import MLADCPManager
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        dev, n, heads = self.device, case.dcp.size, case.heads
        backend = importlib.import_module(BACKEND_MODULE).FlashMLASparseBackend
        whole = undivided(case)
        inputs = materialize_attention_inputs(whole, dev)
        guards = Guards()
        _, slots, topk_buffer = step_tensors(whole, dev, inputs=inputs, guards=guards)
        caches = [self.cache(case, dev, guards, name=f"kv_cache (rank {r})") for r in range(n)]
        write, write_emulated = self.writer(case)
        cfg = configure(self.cfg, case, max_num_batched_tokens=topk_buffer.shape[0])
        cfg.parallel_config.decode_context_parallel_size = n
        cfg.parallel_config.cp_kv_cache_interleave_size = case.dcp.interleave
        spec = MLAAttentionSpec(block_size=case.block_size, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.bfloat16,
                                cache_dtype_str=case.kv_cache_dtype)
        metadata_in = common_attn_metadata(whole, inputs.index, dev)  # slot_mapping: undivided slots
        ranks = LockstepRanks(n)
        before: list[torch.Tensor | None] = [None] * n
        partial: dict[str, torch.Tensor] = {}
        overruns: list[str] = []

        def rank_step(r: int) -> torch.Tensor:
            """One rank's step, as MLAAttention.forward_impl drives it for MQA tokens under DCP."""
            with set_current_vllm_config(cfg), torch.inference_mode():
                write(inputs.kv_c[slots], inputs.k_pe[slots], caches[r], rank_slot_mapping(case, slots, r))
                before[r] = caches[r].clone()
                impl = backend.get_impl_cls()(
                    heads, HEAD_SIZE, SM_SCALE, 1, None, None, case.kv_cache_dtype, None, "decoder", None,
                    **impl_topk_kwargs(backend.get_impl_cls(), topk_buffer.clone()), q_lora_rank=None,
                    kv_lora_rank=KV_LORA_RANK, qk_nope_head_dim=128, qk_rope_head_dim=ROPE_DIM,
                    qk_head_dim=128 + ROPE_DIM, v_head_dim=128, kv_b_proj=None)
                manager = None
                if n > 1:  # as MLAAttention builds it when DCP is on
                    manager = MLADCPManager(vllm_config=cfg, device=torch.device(dev), num_heads=heads,
                                            query_head_dim=HEAD_SIZE, output_head_dim=KV_LORA_RANK,
                                            query_dtype=torch.bfloat16, output_dtype=torch.bfloat16,
                                            padded_num_heads=getattr(impl, "q_pad_num_heads", None),
                                            is_lse_base_on_e=impl.lse_base_on_e, use_pcp=False)
                # The builder finds the layer's DCP manager in the forward context.
                cfg.compilation_config.static_forward_context[LAYER] = SimpleNamespace(prefill_backend=None,
                                                                                       dcp_manager=manager)
                builder = backend.get_builder_cls()(spec, [LAYER], cfg, torch.device(dev))
                metadata = builder.build(0, dataclasses.replace(
                    metadata_in, slot_mapping=rank_slot_mapping(case, metadata_in.slot_mapping, r)))
                q = inputs.q[:, r * heads:(r + 1) * heads].contiguous()
                if manager is not None:
                    q = manager.query_gather(q)
                check_overrun = guard_index_group(impl)
                out, lse = impl.forward_mqa(q, caches[r], metadata, None)
                overruns.extend(f"rank {r}: {m}" for m in check_overrun(case.num_tokens))
                if manager is None:
                    return out
                partial[f"rank{r}.lse"] = lse.detach().clone()
                merged = manager.combine(out, lse, seq_lens=metadata.seq_lens, query_start_loc=metadata.query_start_loc)
                return merged

        def call():
            _FILTERED.clear()
            with installed_dcp_group(EmulatedDcpGroup(ranks)):
                merged = ranks.run(rank_step)
            strides = {stride for _, stride in _FILTERED.values()}
            if strides:
                filter_call["block_stride_rows"] = strides.pop()
            return {"out": torch.cat(merged, dim=1), **partial,
                    **{f"rank{r}.topk": t for r, (t, _) in _FILTERED.items()}}

        filter_call: dict = {}
        obs = observe_paths(self.observe, call, notes={"dcp": f"{n} ranks emulated in one process, interleave {case.dcp.interleave}",
                                        "dcp_filter_call": filter_call})
        return self.finish_ranks(obs, case, slots, caches, before, write_emulated, overruns, guards)

    def finish_ranks(self, obs, case, slots, caches, before, write_emulated, overruns, guards):
        """The fp8 entries each rank's writer produced, laid out as the undivided case's slots (for the
        oracle's read-back), and everything `finish` reports, over every rank's cache."""
        if all(b is not None for b in before):
            owner, rslot = rank_slots(case, slots)
            entries = torch.empty(len(slots), before[0].shape[-1], dtype=before[0].dtype, device=before[0].device)
            for r, b in enumerate(before):
                mine = owner == r
                entries[mine] = b[rslot[mine] // case.block_size, rslot[mine] % case.block_size]
            obs.outputs["cache_slots"], obs.outputs["cache_entries"] = slots, entries
            changed = [f"rank {r}: {int(c)} rows" for r, (cache, b) in enumerate(zip(caches, before))
                       if (c := (cache.view(torch.uint8) != b.view(torch.uint8)).any(dim=-1).sum())]
            if changed:
                obs.notes["cache_changed"] = ", ".join(changed)
        obs.emulated = tuple(dict.fromkeys(x for x in (*self.emulated, write_emulated,
                                                         "DCP collectives (attnfuzz's in-process group)") if x))
        obs.notes["shims"] = self.shims
        if overruns:
            obs.notes["buffer_overrun"] = overruns
        if guard := guards.check():
            obs.notes["guard"] = guard
        return obs

    def render_repro(self, finding) -> tuple[str, dict]:
        return "", {}  # `attnfuzz replay` reproduces it; a standalone DCP reproducer is not written yet
