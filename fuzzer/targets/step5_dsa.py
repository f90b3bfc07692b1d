"""`vllm.step5_dsa`: Step5's GQA + DSA attention backend (`STEP5_DSA`,
vllm/models/step5/nvidia/sparse_attention.py), on its decode route, over the steps one engine runs.

vLLM's code under test, run for real (its Triton kernels interpreted and bounds-checked on a CPU, native on a GPU):
`Step5DSAMetadataBuilder.build` (FlashAttention's builder, then Step5's fields and its prefill plan, which a uniform
decode batch skips), the CSA tail ring's `Step5CSATailRingMetadataBuilder` (its Triton `_ring_metadata_kernel`: each
token's ring base and row), and `Step5DSAAttentionImpl.forward` on a uniform decode batch: the region-summary update
(`Step5SparseSummaryCache.update_decode`: the Triton `_update_decode`, which stores an open region's row in the ring
or, for the token that closes a region, replays the ring and writes the region's fp8 summary), the indexer's scores
(`decode_summary_scores`, the Triton `_direct_scores`: fp8 queries against the fp8 summaries read through the block
table), the region selection (`select_regions`: vLLM's per_row top-k op, then the Triton `_stable_topk_regions`
or, below topk, `_all_regions`), and the paged sparse attention (`sparse_decode_attention`: `_sparse_decode_split`
and `_sparse_decode_combine`, the headwise sigmoid gate fused, fp8 dequantized with the layer's scales).

Emulated, named in every result: what the model writes before the backend runs (the packed KV cache of every token,
the step's own included, as the layer's fused QKV preparation stores it; the summaries and ring rows of what came
before the case's first step, as the same Triton update would have left them: strategies/step5_tensors.py, tested
byte-equal against vLLM's `_update_decode`), the indexer's outputs (drawn: its fp8 queries, weights, key and z) and
the top-k op where the host lacks vLLM's compiled `_C` (attnfuzz's `top_k_per_row_decode`). FlashInfer, which the
backend's adapter imports and constructs but the decode route never calls, is an import stand-in unless the host has
FlashInfer. Padding rows are drawn as a full CUDA graph pads a decode batch (slot -1, an all-null table row, seq_len
0; the graph itself is not captured). Not driven: the prefill route (FlashInfer's ragged and paged prefill wrappers,
whose plan/run the stand-in refuses; real FlashInfer on the GPU host would run it), MTP verify steps, CUDA graphs.
"""

from __future__ import annotations

import torch

from fuzzer.env import STATE_DIR
from fuzzer.support import step5_runtime as runtime
from fuzzer.support.cpu_host import prepare_cpu_host
from fuzzer.support.vllm_setup import vllm_runtime
from fuzzer.targets.base import WHOLE, RunPlan, Target
from fuzzer.targets.probes import observe_paths
from oracles.step5 import judge_step5
from strategies.step5_batches import step5_space
from strategies.step5_tensors import (
    REGION,
    materialize_step5,
    positions,
    ring_row,
    slot,
    write_kv,
    write_ring,
    write_summaries,
)

WRITERS = ("cache writes before each step: attnfuzz's torch writers of the packed KV cache (the layer's fused QKV "
           "store), and of the region summaries and tail-ring rows earlier steps left (byte-equal to vLLM's "
           "Triton _update_decode); the indexer's outputs drawn")


class Step5DSA(Target):
    name = "vllm.step5_dsa"
    summary = ("Step5 GQA + DSA backend (STEP5_DSA): builder + CSA tail-ring builder + impl.forward on decode "
               "steps: summary update, indexer scores, region top-k, sparse attention (Triton), bf16 and fp8")
    bug_classes = "C D H I O"
    oracle = staticmethod(judge_step5)
    real_parts = ("Step5DSAMetadataBuilder", "Step5CSATailRingMetadataBuilder (_ring_metadata_kernel)",
                  "Step5DSAAttentionImpl.forward (decode route)",
                  ("Triton: _update_decode, _direct_scores, _stable_topk_regions / _all_regions, "
                   "_sparse_decode_split, _sparse_decode_combine"))
    kv_cache_dtypes = ("bfloat16", "fp8")

    def unavailable(self) -> str | None:
        try:
            runtime.import_package()
            __import__(runtime.SPARSE_MODULE)
        except Exception as e:  # noqa: BLE001
            return f"cannot import {runtime.SPARSE_MODULE}: {type(e).__name__}: {e}"
        return None

    def prepare(self) -> None:
        shims = []
        if self.device == "cpu":
            shims = prepare_cpu_host()
        emulated, step5_shims = runtime.prepare_host(self.device)
        self.shims = [*shims, *step5_shims]
        self.emulated = (*emulated, WRITERS)
        self.cfg = vllm_runtime(self.device, str(STATE_DIR))
        if runtime.real_flashinfer(self.device):
            flashinfer = (f"FlashInfer {runtime.real_flashinfer(self.device)} (imported and constructed; the decode "
                          "route calls none of it)")
            self.real_parts = (*type(self).real_parts, flashinfer)

    def cases(self, profile, plan: RunPlan = WHOLE):
        return step5_space(profile, plan.kv_dtypes(self))

    def run(self, case):
        x, dev, bs = case.step5, self.device, case.block_size
        inp = materialize_step5(case, dev)
        n, groups = len(case.requests), x.groups
        num_blocks = case.num_blocks
        cache_dtype = torch.uint8 if case.kv_cache_dtype == "fp8" else torch.bfloat16
        poison = 0xFF if cache_dtype == torch.uint8 else float("nan")
        kv_cache = torch.full((num_blocks, groups, bs, 2 * runtime.HEAD_SIZE), poison, dtype=cache_dtype, device=dev)
        mean = torch.full((num_blocks, 1, bs // REGION, runtime.PROXY_DIM), 0xFF, dtype=torch.uint8, device=dev)
        ring_cache = torch.full((num_blocks, runtime.ring_page_elements(groups, bs)), float("nan"),
                                dtype=torch.bfloat16, device=dev)
        pads = case.padded_tokens  # graph padding: one token a row, slot -1, an all-null table row, seq_len 0
        cfg = runtime.vllm_config(self.cfg, max_num_batched_tokens=max(64, n + pads), block_size=bs,
                                  heads=case.heads)
        spec = runtime.kv_cache_spec(groups, bs, case.kv_cache_dtype)
        width = len(case.block_table[0])
        table = torch.tensor(case.block_table + ((0,) * width,) * pads, dtype=torch.int32, device=dev)
        first = positions(case, 0)
        notes: dict = {}

        def call():
            impl, layer, ring, builder, ring_builder = runtime.engine(
                cfg, spec, case.heads, groups, case.kv_cache_dtype, x.region_topk, x.index_heads, kv_cache, ring_cache,
                mean, inp.k_scale, inp.v_scale, dev)
            for i, p in enumerate(first):  # what came before the first step: KV, closed regions, the open region's rows
                write_kv(kv_cache, case, inp, i, range(p))
                write_summaries(mean, case, inp, i, range(p // REGION))
                write_ring(ring.rows, case, inp, i, range(p // REGION * REGION, p), ring.rows_per_block, ring.capacity)
            outputs = {}
            for j in range(x.steps):
                pos = positions(case, j)
                for i, p in enumerate(pos):  # the layer stores the step's own K and V before attention
                    write_kv(kv_cache, case, inp, i, range(p, p + 1))
                seq_lens = torch.tensor([p + 1 for p in pos] + [0] * pads, dtype=torch.int32, device=dev)
                slots = torch.tensor([slot(case, i, p) for i, p in enumerate(pos)] + [-1] * pads, dtype=torch.int64,
                                     device=dev)
                common = runtime.common_metadata(torch.arange(n + pads + 1, dtype=torch.int32, device=dev), seq_lens,
                                                 table, slots, (seq_lens - 1).clamp(min=0).long(), max(pos) + 1)
                before = kv_cache.clone()
                out, selected = runtime.decode_step(
                    cfg, impl, layer, builder, ring_builder, common, inp.q[j], inp.proxy_q[j],
                    _rows(inp.index_key, pos, pads), inp.proxy_w[j], _rows(inp.index_z, pos, pads), inp.gate[j],
                    x.defer_inactive_clear)
                if not torch.equal(before.view(torch.uint8), kv_cache.view(torch.uint8)):
                    notes["cache_changed"] = f"step {j + 1}: the forward changed the paged KV cache"
                outputs[f"out.{j}"] = out
                outputs[f"selected.{j}"] = selected
                outputs[f"summary.{j}"] = torch.stack([
                    mean[slot(case, i, p) // bs, 0, slot(case, i, p) % bs // REGION] for i, p in enumerate(pos)])
                outputs[f"ring.{j}"] = torch.stack([
                    ring.rows[ring_row(case, i, p, ring.rows_per_block, ring.capacity)] for i, p in enumerate(pos)])
            outputs["mean"] = mean
            return outputs

        obs = observe_paths(self.observe, call)
        obs.emulated = self.emulated
        obs.notes["shims"] = tuple(self.shims)
        obs.notes.update(notes)
        return obs

    def repro_spec(self, finding):
        return None  # no standalone reproducer yet: `attnfuzz replay` re-runs a finding through this target


def _rows(per_request: list[torch.Tensor], pos: list[int], pads: int) -> torch.Tensor:
    """The step's indexer key (or z) rows, [tokens, 1, 256] bf16, as the model hands them (`index_k`, `index_z`):
    the requests' tokens, then the padding rows' (zeros)."""
    rows = [per_request[i][p] for i, p in enumerate(pos)]
    rows += [torch.zeros_like(rows[0])] * pads
    return torch.stack(rows).view(len(rows), 1, -1)
