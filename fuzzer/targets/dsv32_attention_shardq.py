"""`vllm.dsv32.attention.shardq`: DeepSeek-V3.2 / GLM-5's attention module (`DeepseekV32Attention`) under tensor
parallelism with ShardQ (vLLM 0.34+, on by default: `attention_config.sparse_mla_shard_q`), every TP rank emulated in
one process, over the steps of a trace.

TP splits the heads: each rank holds its heads of the module's layers (their rows of kv_b_proj), the whole index and
fp8_ds_mla MLA caches, its own indexer, builders, persistent top-k buffer and index group. On a prefill step of at
least `sparse_mla_shard_q_min_tokens` tokens whose prompts reach past the top-k, both builders split the prefill
tokens over the ranks (`build_shardq_split`: zigzag chunks, rank r the r-th and (2 tp - 1 - r)-th of each prompt):
  * the indexer scores the decodes and the rank's own prefill tokens only (`shardq_gather_indices`, the tokens'
    positions), its top-k rows compact: the decodes', then the rank's tokens';
  * the module's MQA route sends each token's heads to the rank that owns it (`shard_q`, an all-to-all over the TP
    group), attends the rank's tokens with every head (`forward_mqa` on `shardq.attn_metadata`: `topk_start` past the
    decodes, `req_id_per_token` of the rank's tokens), the decodes head-sharded as before, and sends the outputs back
    (`unshard_out`).
The collectives run over attnfuzz's in-process group (`fuzzer.support.dcp_group`), ShardQ's NCCL fallback (no
symmetric memory over emulated ranks) routed to it.

Judged as the undivided module (`oracles/dsv32.py` `judge_dsv32_dcp`): each token's top-k as the rank that scored it
holds it, put back in token order, against the index cache's bytes; the decode rows alike on every rank (and every
row where the step did not split); each layer's output, every rank's heads in rank order, against the fp32 reference
over the whole context with every rank's heads; every rank's MLA cache alike (each writes every token). Not driven:
the symmetric-memory exchange kernels (`_shard_q_kernel`, `_unshard_out_kernel`: GPU only), DBO micro-batches.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch

from fuzzer.env import STATE_DIR
from fuzzer.support import dcp_group, pcp_runtime
from fuzzer.support.dcp_steps import direct_dcp_off, on_pcp_ranks
from fuzzer.support.indexer_runtime import index_cache, indexer_config, logits_budget
from fuzzer.support.sparse_mla_steps import uninitialized_memory_as_nan
from fuzzer.targets.base import WHOLE, RunPlan
from fuzzer.targets.dsv32_attention import EMULATED, Dsv32Attention, engines_ended
from fuzzer.targets.dsv32_attention_dcp import Dsv32AttentionDcp, RankState, StepInputs
from fuzzer.targets.harness import index_trace_step, max_batched_tokens, topk_buffer_for, trace_observation
from oracles.dsv32 import undivided_trace
from strategies.indexer_batches import attention_module_shardq_space
from strategies.indexer_tensors import attention_view, key_pool

SHARDQ_MODULE = "vllm.v1.attention.ops.shardq"
SHARDQ_COLLECTIVES = "ShardQ's all-to-all (its NCCL fallback, torch.distributed.all_to_all_single) over attnfuzz's in-process TP group"


class Dsv32AttentionShardQ(Dsv32AttentionDcp):
    name = "vllm.dsv32.attention.shardq"
    summary = ("DeepSeek-V3.2/GLM-5 attention module under TP with ShardQ (0.34+), every TP rank emulated in one "
               "process: the real indexer on the rank's token shard feeding FLASHMLA_SPARSE over all heads "
               "(shard_q / unshard_out all-to-alls, topk_start), head-sharded decodes, skip_topk layers, traces")
    bug_classes = "A C D G H I O"
    real_parts = (*Dsv32Attention.real_parts,
                  "build_shardq_split / zigzag_split / build_shardq_metadata (both builders' token split)",
                  "the indexer's ShardQ path (shardq_gather_indices, the split tokens' positions)",
                  "shard_q / unshard_out (the NCCL fallback's index_select / index_copy_)",
                  "FlashMLASparseImpl's fp8 mixed-batch path on the split tokens (topk_start)")
    shardq = True

    def unavailable(self) -> str | None:
        if importlib.util.find_spec(SHARDQ_MODULE) is None:
            return "ShardQ is new in vLLM 0.34.0 (vllm/v1/attention/ops/shardq.py): this release has none"
        return super().unavailable()

    def prepare(self) -> None:
        direct_dcp_off()
        Dsv32Attention.prepare(self)  # the module's, not the DCP module's: no DCP merge (nor its stand-ins) under TP alone
        shardq = importlib.import_module(SHARDQ_MODULE)
        if not getattr(shardq.dist, "attnfuzz_emulated", False):
            shardq.dist = dcp_group.emulated_dist()
            shardq.dist.attnfuzz_emulated = True
        shardq.direct_cp_enabled = lambda *args, **kwargs: False  # no symmetric memory over emulated ranks
        self.shims = (*self.shims, f"{SHARDQ_MODULE}.dist: torch.distributed with all_to_all_single routed to "
                      "attnfuzz's emulated groups; direct_cp_enabled False (the NCCL fallback)")
        if self.device == "cpu":  # ShardQ's host buffers ask for pinned memory, which a CPU host has none of
            import vllm.utils.torch_utils as torch_utils
            import vllm.v1.attention.backends.mla.indexer as indexer_builder

            torch_utils.PIN_MEMORY = False  # async_tensor_h2d (the split's token ids)
            importlib.import_module("vllm.v1.utils").PIN_MEMORY = False  # CpuGpuBuffer.copy_to_gpu
            indexer_builder.CpuGpuBuffer = functools.partial(importlib.import_module("vllm.v1.utils").CpuGpuBuffer,
                                                             pin_memory=False)  # shardq_gather_indices
            self.shims = (*self.shims, "PIN_MEMORY=False in vllm.utils.torch_utils and vllm.v1.utils; the indexer "
                          "builder's CpuGpuBuffer unpinned (ShardQ's host buffers)")

    def cases(self, profile, plan: RunPlan = WHOLE):
        return attention_module_shardq_space(profile, profile.attn_heads)

    def run_trace(self, case):  # run by Dsv32Attention.run, under the case's scheduled SMs
        dev, x, tp = self.device, case.indexer, case.dcp.tp
        heads = x.attention_heads
        whole = undivided_trace(case, heads=False)
        layers = 2 if x.skip_topk_layer else 1
        views = [undivided_trace(attention_view(case, i), heads=True) for i in range(layers)]  # every rank's heads
        pool = key_pool(whole, dev)
        cfg = indexer_config(dev, str(STATE_DIR), case, max_num_batched_tokens=max_batched_tokens(case))
        cfg.model_config.get_num_attention_heads = lambda parallel_config=None: heads  # the MLA heads per rank
        cfg.attention_config.sparse_mla_shard_q = True
        cfg.attention_config.sparse_mla_shard_q_min_tokens = x.shardq_min_tokens or 1024
        write, write_emulated = self.writer(attention_view(case))
        ranks, groups = pcp_runtime.emulated_world(1, tp, 1, cfg, dev)
        importlib.import_module(SHARDQ_MODULE)._workspace = None  # the NCCL fallback: no exchange buffers
        state = [RankState(topk=topk_buffer_for(case, dev),
                           index_kv=index_cache(case.pool_blocks, case.block_size, dev),
                           caches=[self.cache(attention_view(case, i), dev) for i in range(layers)])
                 for _ in range(tp)]
        emulated = tuple(dict.fromkeys(e for e in (*self.emulated, write_emulated, *EMULATED, SHARDQ_COLLECTIVES) if e))
        index_written = torch.zeros(pool.shape[0], dtype=torch.bool, device=dev)
        observed = []
        with engines_ended([st.engine for st in state]):
            for k, step in enumerate(case.steps):
                shared = StepInputs.of(k, step, whole, views, pool, index_written, dev)

                def call(shared=shared):
                    with logits_budget(shared.case.indexer.max_logits_mb), uninitialized_memory_as_nan():
                        results = on_pcp_ranks(cfg, ranks, groups, 1, tp, None,
                                               lambda r: self.rank_step(r, state[r], cfg, shared, write))
                    return self.merged(shared, results)

                obs = self.observe_step(call, lambda: state[0].routes,
                                        notes={"shardq": f"{tp} TP ranks emulated in one process, {heads} heads a "
                                                         f"rank, ShardQ from {cfg.attention_config.sparse_mla_shard_q_min_tokens} "
                                                         "prefill tokens"})
                if index_trace_step(observed, obs, step, shared.inp, index_written, emulated, self.shims):
                    break
        return trace_observation(observed)

    def topk_rows(self, s: StepInputs, results: list[dict]) -> dict:
        """Each token's top-k row put back from the rank that scored it: under a ShardQ split a rank's rows hold the
        decodes', then its own tokens' (`ShardQMetadata.token_ids` grouped by rank). The rows every rank scores itself
        (the decodes', or every row of a step that did not split) are each rank's own choice among tied scores, and its
        heads attend with them: `topk_by_tp`, each rank's rows judged as a top-k and its heads judged on them (no DCP
        merge makes the ranks' ties agree)."""
        split = results[0]["shardq"]
        shared_rows = split.num_decode_tokens if split is not None else s.case.num_actual_tokens
        buffer = results[0]["topk"].clone()
        if split is not None:
            ids, nd, start = split.token_ids.long().cpu().tolist(), split.num_decode_tokens, 0
            for r, n in enumerate(split.num_tokens_per_rank):
                local = torch.tensor(ids[start:start + n], dtype=torch.long, device=buffer.device)
                buffer[nd + local] = results[r]["topk"][nd:nd + n]
                start += n
        by_tp = buffer[None].repeat(len(results), 1, 1)
        for t, res in enumerate(results):
            by_tp[t, :shared_rows] = res["topk"][:shared_rows]
        return {"topk_indices_buffer": buffer, "topk_by_tp": by_tp}

    def merged(self, s: StepInputs, results: list[dict]):
        """As the DCP module's, with the top-k rows of `topk_rows`, and every rank's MLA cache entries of the step's
        slots alike (under TP each rank writes every token)."""
        out, overruns, changed = super().merged(s, results)
        for i, name in enumerate(("out", "out_skip_topk")[:len(s.layer_steps)]):
            slots = out[f"{name}.cache_slots"]
            block, offset = slots // s.case.block_size, slots % s.case.block_size
            entries = [res["caches"][i][block, offset] for res in results]
            bad = torch.stack([(e != entries[0]).any(dim=-1) for e in entries[1:]]).any(dim=0)
            out[f"{name}.replica_slots_differ"] = slots[bad]
        return out, overruns, changed
