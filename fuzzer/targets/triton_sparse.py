"""`vllm.triton_sparse`: vLLM's pure-Triton sparse-MLA backend (`XPU_MLA_SPARSE`), whole.

Its own metadata builder and impl: the builder's `req_id_per_token`, the impl's `forward_mqa` over every
token (this backend routes prefills through MQA too), the index remap over the paged bf16 cache, and the
Triton attention kernel. Interpreted on a CPU (with attnfuzz's corrections for the interpreter's bf16 dot
and bounds checks), native on a GPU.
"""

from __future__ import annotations

import importlib

import torch

from fuzzer.repro_spec import Call, Judge, ReproSpec
from fuzzer.support.attn_metadata import attn_metadata
from fuzzer.support.triton_sparse_steps import (BACKEND_MODULE, backend_config, paged_cache_view, prepare_triton_host,
                                               sparse_attention)
from fuzzer.targets import harness
from fuzzer.targets.base import WHOLE, RunPlan, Target
from fuzzer.targets.guards import Guards
from fuzzer.targets.probes import observe_paths
from fuzzer.targets.vllm_api import remap_api
from oracles.attention_judge import attention_tolerance, judge_attention, reference_for
from strategies.batches import AttentionFeatures, attention_space
from strategies.tensors import SM_SCALE


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

    # What prepare() reads of the release for cases() (a worker campaign's parent never imports vLLM): whether the
    # index remap takes BLOCK_STRIDE_ROWS (releases before flat_kv_row_view view the cache as contiguous rows).
    PLANNED = ("block_stride_rows",)
    block_stride_rows: bool | None = None

    def prepare(self) -> None:
        self.block_stride_rows = remap_api().has_block_stride_rows
        self.shims: list[str] = prepare_triton_host() if self.device == "cpu" else []

    def cases(self, profile, plan: RunPlan = WHOLE):
        stride_rows = self.block_stride_rows if self.block_stride_rows is not None else remap_api().has_block_stride_rows
        return attention_space(profile, AttentionFeatures(kv_cache_dtypes=plan.kv_dtypes(self),
                                                          block_stride_rows=stride_rows))

    def step(self, case, device, guards=None):
        """Everything the call needs, on `device`: inputs, poisoned cache, top-k buffer, config."""
        inp, slots, topk_buffer = harness.step_tensors(case, device, guards=guards)
        return inp, slots, harness.paged_cache(case, device, guards=guards), topk_buffer

    @staticmethod
    def config_fields(case) -> dict:
        """The step's fields `backend_config` gives the builder (and max_num_batched_tokens: the top-k buffer's rows)."""
        return dict(heads=case.heads, topk_width=case.topk_width, kv_cache_dtype=case.kv_cache_dtype,
                    block_size=case.block_size)

    def run(self, case):
        dev = self.device
        guards = Guards()
        inp, slots, cache, topk_buffer = self.step(case, dev, guards)
        write, emulated = harness.cache_writer(self.device)
        cfg, spec = backend_config(**self.config_fields(case), max_num_batched_tokens=topk_buffer.shape[0])
        before = []

        def call():
            # The cache as the layer leaves it before attention: every position of every request written
            # through vLLM's cache writer (shared prefix blocks once); all other rows stay poisoned.
            write(inp.kv_c[slots], inp.k_pe[slots], cache, slots, "auto", torch.ones((), device=dev))
            before.append(cache.clone())
            q = harness.with_padded_tokens(case, inp.q)  # CUDA-graph padding tokens' rows, if the case has any
            out, lse = sparse_attention(cfg, spec, harness.common_attn_metadata(case, inp.index, dev), case.heads,
                                        SM_SCALE, topk_buffer, q, cache, dev)
            if case.padded_tokens and out is not None and out.shape[0] == case.num_actual_tokens:
                # the reference covers the requests' tokens; the padding tokens' rows are judged finite (padded_rows)
                return {"out": out[: case.num_tokens], "out_padded": out[case.num_tokens:], "lse": lse}
            return {"out": out, "lse": lse}

        obs = observe_paths(self.observe, call)
        obs.emulated = tuple(x for x in (emulated,) if x)
        obs.notes["shims"] = self.shims
        harness.note_guards_and_cache(obs, guards, cache, before)
        return obs

    def repro_spec(self, finding) -> ReproSpec:
        """The step as the finding ran it (its values are drawn on its device): the cache as written, then the calls
        run() makes (triton_sparse_steps: the builder and forward_mqa) on it, judged against the fp32 reference."""
        case, dev = finding.case, finding.host.device
        inp, slots, cache, topk_buffer = self.step(case, dev)
        write, _ = harness.cache_writer(dev)
        write(inp.kv_c[slots], inp.k_pe[slots], cache, slots, "auto", torch.ones((), device=dev))
        tensors = harness.repro_step(case, inp.index, cache, topk_buffer, dev)
        tensors.update(q=harness.with_padded_tokens(case, inp.q), expected_out=reference_for(case, inp, dev)[0])
        atol, rtol = attention_tolerance(case, inp)
        lens = dict(max_query_len=max(r.query_len for r in case.requests), max_seq_len=max(r.seq_len for r in case.requests))
        return ReproSpec(
            about=f"Shrunk case: {case.summary()}; {case.heads} heads, values {case.values}.\n"
                  "Inputs in tensors.safetensors beside this file: q, the paged KV cache as written before attention,\n"
                  "the top-k buffer, the step's metadata and the fp32 reference output (attnfuzz's oracle).",
            prepare=(Call(prepare_triton_host, note="Triton's interpreter corrected; no pinned memory"),) if dev == "cpu" else (),
            setup=(Call(attn_metadata, dict(
                       query_start_loc='T["query_start_loc"]', seq_lens='T["seq_lens"]',
                       num_computed_tokens='T["num_computed_tokens"]', block_table='T["block_table"]',
                       slot_mapping='T["slot_mapping"]', num_actual_tokens=repr(case.num_actual_tokens),  # padding too
                       **{k: repr(v) for k, v in lens.items()}), assign="common"),
                   Call(backend_config, dict(**{k: repr(v) for k, v in self.config_fields(case).items()},
                                             max_num_batched_tokens='T["topk_indices_buffer"].shape[0]'),
                        assign="cfg, spec"),
                   Call(paged_cache_view, dict(rows='T["kv_cache_rows"]', num_blocks=repr(case.num_blocks),
                                               block_size=repr(case.block_size),
                                               block_stride_rows=repr(case.stride_rows)), assign="cache, before")),
            call=(Call(sparse_attention, dict(cfg="cfg", spec="spec", common="common", heads=repr(case.heads),
                                              sm_scale=repr(SM_SCALE), topk_indices_buffer='T["topk_indices_buffer"]',
                                              q='T["q"]', kv_cache="cache", device="DEVICE"), assign="out, lse"),),
            judge=Judge("attention", dict(out="out", expected='T["expected_out"]', cache="cache", before="before",
                                          atol="ATOL", rtol="RTOL")),
            constants=dict(ATOL=atol, RTOL=rtol), tensors=tensors,
            bounds_checked=dev == "cpu" and bool(finding.observation.memory))
