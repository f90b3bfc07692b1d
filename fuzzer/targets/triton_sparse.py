"""`vllm.triton_sparse`: vLLM's pure-Triton sparse-MLA backend (`XPU_MLA_SPARSE`), whole.

Its own metadata builder and impl: the builder's `req_id_per_token`, the impl's `forward_mqa` over every
token (this backend routes prefills through MQA too), the index remap over the paged bf16 cache, and the
Triton attention kernel. Interpreted on a CPU (with attnfuzz's corrections for the interpreter's bf16 dot
and bounds checks), native on a GPU.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import torch

from fuzzer.targets.probes import observe_paths
from fuzzer.targets.guards import Guards
from fuzzer.targets.harness import (
    cache_writer,
    common_attn_metadata,
    model_namespace,
    paged_cache,
    step_tensors,
    with_padded_tokens,
)
from fuzzer.targets.base import Target
from oracles.attention_judge import judge_attention
from strategies.tensors import HEAD_SIZE, KV_LORA_RANK, SM_SCALE
from strategies.batches import AttentionFeatures, attention_cases

BACKEND_MODULE = "vllm.v1.attention.backends.mla.xpu_mla_sparse"


class TritonSparse(Target):
    name = "vllm.triton_sparse"
    summary = "pure-Triton sparse-MLA backend (XPU_MLA_SPARSE): builder + impl.forward_mqa + kernels"
    bug_classes = "B C I"
    oracle = staticmethod(judge_attention)
    real_parts = ("XPUMLASparseMetadataBuilder", "XPUMLASparseImpl.forward_mqa", "the index-remap Triton kernel",
                  "_bf16_mla_sparse_kernel (Triton)")
    kv_cache_dtypes = ("bfloat16",)  # the backend refuses fp8

    def unavailable(self) -> str | None:
        try:
            self.backend_module()
        except Exception as e:
            return f"cannot import {BACKEND_MODULE}: {type(e).__name__}: {e}"
        return None

    def backend_module(self):
        return importlib.import_module(BACKEND_MODULE)

    def prepare(self) -> None:
        self.shims: list[str] = []
        if self.device == "cpu":
            from fuzzer.support.interp.corrections import CORRECTIONS, install_corrections
            from fuzzer.support.standins.cpu_shims import install_cpu_shims

            install_corrections()
            self.shims = [*install_cpu_shims(), *(f"interpreter correction: {c}" for c in CORRECTIONS)]

    def cases(self, profile):
        from fuzzer.targets.vllm_api import remap_api

        # Releases before flat_kv_row_view (0.26 and older) view the cache as contiguous rows.
        return attention_cases(profile, AttentionFeatures(kv_cache_dtypes=self.kv_cache_dtypes,
                                                          block_stride_rows=remap_api().has_block_stride_rows))

    def step(self, case, device, guards=None):
        """Everything the call needs, on `device`: inputs, poisoned cache, top-k buffer, config."""
        inp, slots, topk_buffer = step_tensors(case, device, guards=guards)
        return inp, slots, paged_cache(case, device, guards=guards), topk_buffer

    def run(self, case):
        dev = self.device
        guards = Guards()
        inp, slots, cache, topk_buffer = self.step(case, dev, guards)
        backend = self.backend_module().XPUMLASparseBackend
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        write, emulated = cache_writer()
        cfg = model_namespace(case, max_num_batched_tokens=topk_buffer.shape[0])
        spec = MLAAttentionSpec(block_size=case.block_size, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.bfloat16)
        before = []

        def call():
            # The cache as the layer leaves it before attention: every position of every request written
            # through vLLM's cache writer (shared prefix blocks once); all other rows stay poisoned.
            write(inp.kv_c[slots], inp.k_pe[slots], cache, slots, "auto", torch.ones((), device=dev))
            before.append(cache.clone())
            builder = backend.get_builder_cls()(spec, ["attnfuzz.layer"], cfg, torch.device(dev))
            metadata = builder.build(0, common_attn_metadata(case, inp.index, dev))
            # The buffer through an indexer, as the model passes it (0.23's impl accepts nothing else).
            impl = backend.get_impl_cls()(case.heads, HEAD_SIZE, SM_SCALE, 1, None, None, "auto", None, "decoder",
                                          None, indexer=SimpleNamespace(topk_indices_buffer=topk_buffer),
                                          kv_lora_rank=KV_LORA_RANK)
            q = with_padded_tokens(case, inp.q)  # CUDA-graph padding tokens' rows, if the case has any
            q = (q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:])  # (ql_nope, q_pe), as the layer passes it
            out, lse = impl.forward_mqa(q, cache, metadata, None)
            if case.padded_tokens and out is not None and out.shape[0] == case.num_actual_tokens:
                out = out[: case.num_tokens]  # the runner drops padding tokens' rows; none is judged
            return {"out": out, "lse": lse}

        obs = observe_paths(self.observe, call)
        obs.emulated = tuple(x for x in (emulated,) if x)
        obs.notes["shims"] = self.shims
        if guard := guards.check():
            obs.notes["guard"] = guard
        changed = (cache.view(torch.int16) != before[0].view(torch.int16)).any(dim=-1).nonzero() if before else []
        if len(changed):
            obs.notes["cache_changed"] = f"{len(changed)} rows, first block {int(changed[0][0])} offset {int(changed[0][1])}"
        return obs

    def render_repro(self, finding) -> tuple[str, dict]:
        from fuzzer.artifacts.repro import render_backend_repro
        from oracles.attention_judge import attention_tolerance, reference_for

        case, dev = finding.case, finding.host.device  # the values the finding ran with are drawn on its device
        inp, slots, cache, topk_buffer = self.step(case, dev)
        write, _ = cache_writer()
        write(inp.kv_c[slots], inp.k_pe[slots], cache, slots, "auto", torch.ones((), device=dev))
        cam = common_attn_metadata(case, inp.index, dev)
        atol, rtol = attention_tolerance(case, inp)
        tensors = dict(q=with_padded_tokens(case, inp.q), kv_cache_rows=cache.as_strided((case.num_blocks * case.stride_rows, HEAD_SIZE), (HEAD_SIZE, 1)),
                       topk_indices_buffer=topk_buffer, query_start_loc=inp.index.query_start_loc,
                       seq_lens=inp.index.seq_lens, block_table=inp.index.block_table, slot_mapping=cam.slot_mapping,
                       num_computed_tokens=torch.tensor([r.context_len for r in case.requests], dtype=torch.int32),
                       expected_out=reference_for(case, inp, dev)[0])
        constants = dict(HEADS=case.heads, SM_SCALE=SM_SCALE, BLOCK_SIZE=case.block_size,
                         BLOCK_STRIDE_ROWS=case.stride_rows, NUM_BLOCKS=case.num_blocks, NUM_REQS=len(case.requests),
                         NUM_TOKENS=case.num_actual_tokens, MAX_QUERY_LEN=max(r.query_len for r in case.requests),
                         MAX_SEQ_LEN=max(r.seq_len for r in case.requests), ATOL=atol, RTOL=rtol)
        return render_backend_repro(finding, self, tensors, constants, BACKEND_MODULE, "XPUMLASparseBackend"), tensors
