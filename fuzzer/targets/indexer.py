"""`vllm.indexer`: DeepSeek-V3.2 / GLM-5's lightning indexer on vLLM's CUDA route, whole.

DeepSeek-V3.2's indexer module (`DeepseekV32Indexer`: its k-cache layer and `SparseAttnIndexer` op) and its
metadata builder (`DeepseekV32IndexerMetadataBuilder`), kept for the life of an engine across the steps of a
trace: each step's metadata built from the runner's CommonAttentionMetadata, then `forward_cuda` (the
`sparse_attn_indexer` op): the index K-cache write, the prefill gather and logits per chunk, the decode's paged
logits (native MTP rows, flattened or packed), the top-k kernel `sparse_indexer_topk_backend` resolves, into the
persistent top-k buffer. On a CPU the indexer's modules see an SM90 CUDA platform and DeepGEMM's and vLLM's
compiled kernels are bounds-checked stand-ins (named in every result); on the H200 they are real where the host
has them. Judged by oracles/indexer.py from the index cache's bytes.
"""

from __future__ import annotations

import torch

from fuzzer.env import STATE_DIR
from fuzzer.repro_spec import ReproSpec
from fuzzer.support.attn_metadata import attn_metadata
from fuzzer.support.indexer_runtime import (
    BUILDER_MODULE,
    INDEXER_MODULE,
    TOPK_MODULE,
    index_cache,
    indexer_builder,
    indexer_config,
    indexer_layer,
    indexer_step,
    logits_budget,
    prepare_indexer_host,
    scheduled_sms,
    write_index_keys,
)
from fuzzer.support.vllm_setup import standins_forced
from fuzzer.support.sparse_mla_steps import prepare_cpu
from fuzzer.targets.base import WHOLE, RunPlan, Target
from fuzzer.targets.harness import index_trace_step, max_batched_tokens, topk_buffer_for, trace_observation
from fuzzer.targets.probes import observe_paths
from oracles.indexer import judge_indexer
from oracles.steps import judge_steps
from strategies.indexer_batches import indexer_space
from strategies.indexer_tensors import key_pool, materialize_indexer_inputs


# The compiled kernels the route calls, named as results list them when they ran for real (on a GPU host that has them)
REAL_KERNELS = (
    ("DeepGEMM's fp8_fp4_mqa_logits, fp8_fp4_paged_mqa_logits and get_paged_mqa_logits_metadata (vllm.third_party.deep_gemm)",
     ("deep_gemm.fp8_fp4_mqa_logits", "deep_gemm.fp8_fp4_paged_mqa_logits", "deep_gemm.get_paged_mqa_logits_metadata")),
    ("vLLM's indexer_k_quant_and_cache and cp_gather_indexer_k_quant_cache (_C_stable_libtorch)",
     ("indexer_k_quant_and_cache", "cp_gather_indexer_k_quant_cache")),
    ("vLLM's top-k kernels top_k_per_row_prefill/decode, persistent_topk, cooperative_topk (_C_stable_libtorch)",
     ("top_k_per_row_prefill", "top_k_per_row_decode", "persistent_topk", "cooperative_topk")),
)


def engine_buffers(case, device: str) -> tuple:
    """What an indexer trace's engine holds for its life, made as the model runner makes it: (the index keys by slot
    (`key_pool`), the index K cache, the persistent top-k buffer (poisoned), the VllmConfig sized for them)."""
    return (key_pool(case, device), index_cache(case.pool_blocks, case.block_size, device),
            topk_buffer_for(case, device),
            indexer_config(device, str(STATE_DIR), case, max_num_batched_tokens=max_batched_tokens(case)))


class Indexer(Target):
    name = "vllm.indexer"
    summary = ("DeepSeek-V3.2/GLM-5 lightning indexer (SparseAttnIndexer.forward_cuda): builder + index K-cache "
               "write + DeepGEMM logits + top-k")
    bug_classes = "A C D H O"
    oracle = staticmethod(judge_steps(judge_indexer))
    real_parts = ("DeepseekV32IndexerMetadataBuilder", "DeepseekV32Indexer", "SparseAttnIndexer.forward_cuda",
                  "sparse_attn_indexer (the op)", "SparseIndexerTopk", "vLLM's wrappers of DeepGEMM",
                  "pack_seq_triton / unpack_seq_triton, as_fp32_logits and the builder's Triton kernels")
    kv_cache_dtypes = ("bfloat16",)  # the MLA cache's; the index cache is always fp8 with ue8m0 scales
    cudagraph_modes = ("none", "full")
    outputs_stay_on_device = True  # oracles/indexer.py scores the windows on the device the step ran on

    def unavailable(self) -> str | None:
        import importlib

        try:
            for module in (INDEXER_MODULE, BUILDER_MODULE, TOPK_MODULE, "vllm.models.deepseek_v32.attention"):
                importlib.import_module(module)
        except Exception as e:
            return f"cannot import vLLM's indexer: {type(e).__name__}: {e}"
        return None

    def prepare(self) -> None:
        self.shims = prepare_cpu(self.device)
        self.emulated, self.overrides = prepare_indexer_host(self.device, standins_forced())
        real = [p for p, names in REAL_KERNELS if not set(names) & set(self.emulated)]
        self.real_parts = (*type(self).real_parts, *real)

    def cases(self, profile, plan: RunPlan = WHOLE):
        return indexer_space(profile, graph_modes=plan.graph_modes(self))

    def run(self, case):
        with scheduled_sms(case.indexer.num_sms):  # the SMs DeepGEMM's paged logits are scheduled over
            return self.run_trace(case)

    def run_trace(self, case):
        dev = self.device
        steps = case.steps
        pool, cache, topk_buffer, cfg = engine_buffers(case, dev)
        written = torch.zeros(pool.shape[0], dtype=torch.bool, device=dev)
        engine: dict = {}
        observed = []
        for step in steps:
            inp = materialize_indexer_inputs(step, pool)
            fresh = inp.context_slots[~written[inp.context_slots]]  # context no earlier step of the engine wrote

            def call(step=step, inp=inp, fresh=fresh):
                if not engine:
                    engine["layer"] = indexer_layer(cfg, topk_buffer, cache)
                    engine["builder"] = indexer_builder(cfg, engine["layer"], dev, len(step.block_table[0]))
                write_index_keys(pool[fresh], cache, fresh)
                before = topk_buffer.clone()
                common = self.common_metadata(step, inp, dev)
                with logits_budget(step.indexer.max_logits_mb):
                    indexer_step(cfg, engine["builder"], engine["layer"], common, inp.q_fp8, inp.k, inp.weights,
                                 step.num_actual_tokens, step.cudagraph)
                return {"topk_indices_buffer": topk_buffer.clone(), "topk_before": before,
                        "index_cache": cache.clone()}

            obs = observe_paths(self.observe, call)
            if index_trace_step(observed, obs, step, inp, written, self.emulated, (*self.shims, *self.overrides)):
                break
        return trace_observation(observed)

    @staticmethod
    def common_metadata(step, inp, device):
        """vLLM's CommonAttentionMetadata for the step, as the runner makes it (padding tokens included)."""
        reqs = step.requests
        qsl = torch.tensor([0] + [sum(r.query_len for r in reqs[: i + 1]) for i in range(len(reqs))], dtype=torch.int32)
        seq_lens = torch.tensor([r.seq_len for r in reqs], dtype=torch.int32)
        table = torch.tensor(step.block_table, dtype=torch.int32)
        return attn_metadata(qsl.to(device), seq_lens.to(device), torch.tensor([r.context_len for r in reqs]),
                             table.to(device), inp.slots.to(device), step.num_actual_tokens,
                             max((r.query_len for r in reqs), default=0), max((r.seq_len for r in reqs), default=0))

    def repro_spec(self, finding) -> ReproSpec | None:
        return None  # a standalone reproducer of an indexer finding: not yet
