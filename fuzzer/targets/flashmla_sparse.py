"""`vllm.flashmla_sparse`: vLLM's FlashMLA sparse-MLA backend (`FLASHMLA_SPARSE`), whole, on the MQA route.

vLLM's FlashMLASparseMetadataBuilder and FlashMLASparseImpl.forward_mqa over every token (no prefill backend
on the layer, so nothing is split off to dense MHA), with a bf16 or fp8_ds_mla cache: the builder's split and
req_id_per_token, the index group and the index-remap Triton kernel, head padding, the fp8 mixed-batch and
separate prefill/decode paths. Where this host lacks FlashMLA's compiled kernels and vLLM's cache ops (any
CPU), torch stand-ins from `fuzzer.support.standins.flashmla_ops` are bound where `flashmla_sparse` looks them up.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from fuzzer.targets.probes import observe_paths
from fuzzer.targets.guards import Guards
from fuzzer.targets.harness import cache_writer, common_attn_metadata, paged_cache, step_tensors, with_padded_tokens
from fuzzer.targets.base import Target
from fuzzer.support.flashmla_runtime import (BACKEND_MODULE, FP8_ENTRY_BYTES, LAYER, configure, cpu_shims,
                                            define_missing_c_queries, guard_index_group, has_cache_op, impl_topk_kwargs, install_standins,
                                            prefill_outputs_under_initcheck, vllm_runtime)
from oracles.attention_judge import judge_attention
from strategies.tensors import HEAD_SIZE, KV_LORA_RANK, ROPE_DIM, SM_SCALE
from strategies.batches import AttentionFeatures, attention_cases


class FlashMLASparse(Target):
    name = "vllm.flashmla_sparse"
    summary = "FlashMLA sparse-MLA backend (FLASHMLA_SPARSE): builder + impl.forward_mqa, bf16 and fp8_ds_mla"
    bug_classes = "B C D G H I J K"
    oracle = staticmethod(judge_attention)
    real_parts = ("FlashMLASparseMetadataBuilder", "FlashMLASparseImpl.forward_mqa", "SparseMLAIndexGroup",
                  "the index-remap Triton kernel")
    kv_cache_dtypes = ("bfloat16", "fp8_ds_mla")
    outputs_stay_on_device = True  # the attention oracles judge on the device (oracles/attention_judge.py)

    def unavailable(self) -> str | None:
        try:
            importlib.import_module(BACKEND_MODULE)
        except Exception as e:
            return f"cannot import {BACKEND_MODULE}: {type(e).__name__}: {e}"
        return None

    def prepare(self) -> None:
        from fuzzer.env import STATE_DIR

        self.shims: list[str] = list(define_missing_c_queries())
        if self.device == "cpu":  # before the backend is imported: it binds PIN_MEMORY by name
            from fuzzer.support.interp.corrections import CORRECTIONS, install_corrections
            from fuzzer.support.standins.cpu_shims import install_cpu_shims

            install_corrections()
            self.shims += [*install_cpu_shims(), *cpu_shims(), *(f"interpreter correction: {c}" for c in CORRECTIONS)]
        self.emulated = install_standins(self.device)
        self.shims += prefill_outputs_under_initcheck(self.device)
        self.real_parts = self.real_parts_here()
        self.cfg = self.runtime(str(STATE_DIR))

    def real_parts_here(self) -> tuple[str, ...]:
        """What of vLLM really ran, as this release and host have it (every result lists it)."""
        from fuzzer.support.flashmla_runtime import _try_import

        parts = [p for p in type(self).real_parts if p != "SparseMLAIndexGroup"
                 or _try_import("vllm.v1.attention.backends.mla.index_group") is not None]
        if self.device == "cuda":  # the compiled FlashMLA extension; on a CPU its kernels are stand-ins (emulated)
            parts.append("FlashMLA's CUDA kernels (vllm._flashmla_C)")
        return tuple(parts)

    def runtime(self, state_dir: str):
        """vLLM's config and process groups for this process (one rank of its own)."""
        return vllm_runtime(self.device, state_dir)

    def cases(self, profile):
        from fuzzer.targets.vllm_api import remap_api

        # Releases before flat_kv_row_view (0.26 and older) view the cache as contiguous rows.
        return attention_cases(profile, AttentionFeatures(kv_cache_dtypes=self.kv_cache_dtypes, block_sizes=(64, 128),
                                                          block_stride_rows=remap_api().has_block_stride_rows,
                                                          cudagraph_padding=True))

    def step(self, case, device, guards=None):
        """Inputs, poisoned cache, top-k buffer, new-token slots for `case` on `device`."""
        inp, slots, topk_buffer = step_tensors(case, device, guards=guards)
        return inp, slots, self.cache(case, device, guards), topk_buffer

    @staticmethod
    def cache(case, device, guards=None, name: str = "kv_cache"):
        """The paged cache, every row poisoned: NaN for bf16; 0xFF for fp8_ds_mla (fp8 NaN codes, NaN scales and RoPE)."""
        if case.kv_cache_dtype == "fp8_ds_mla":
            return paged_cache(case, device, dtype=torch.uint8, width=FP8_ENTRY_BYTES, poison=255, guards=guards, name=name)
        return paged_cache(case, device, guards=guards, name=name)

    def writer(self, case):
        """(write(kv_c, k_pe, cache, slots), emulated op name or None): vLLM's cache writer or the stand-in."""
        if case.kv_cache_dtype != "fp8_ds_mla":
            write, emulated = cache_writer()
            return (lambda kv_c, k_pe, cache, slots: write(kv_c, k_pe, cache, slots, "auto", torch.ones((), device=cache.device))), emulated
        if has_cache_op("concat_and_cache_mla"):
            op = torch.ops._C_cache_ops.concat_and_cache_mla
            return (lambda kv_c, k_pe, cache, slots: op(kv_c, k_pe, cache, slots, "fp8_ds_mla", torch.ones((), device=cache.device))), None
        from fuzzer.support.standins.flashmla_ops import concat_and_cache_mla

        convention = case.fp8_scale if case.fp8_scale != "e8m0_trunc" else "pow2"  # pow2 scales survive e8m0
        return (lambda kv_c, k_pe, cache, slots: concat_and_cache_mla(kv_c, k_pe, cache, slots, "fp8_ds_mla", None, convention)), "concat_and_cache_mla"

    def run(self, case):
        from vllm.config import set_current_vllm_config
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        dev = self.device
        backend = importlib.import_module(BACKEND_MODULE).FlashMLASparseBackend
        guards = Guards()
        inp, slots, cache, topk_buffer = self.step(case, dev, guards)
        write, write_emulated = self.writer(case)
        cfg = configure(self.cfg, case, max_num_batched_tokens=topk_buffer.shape[0])
        spec = MLAAttentionSpec(block_size=case.block_size, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.bfloat16,
                                cache_dtype_str=case.kv_cache_dtype)
        before, overruns = [], []

        def call():
            # The cache as the layer leaves it before attention; every other row stays poisoned.
            write(inp.kv_c[slots], inp.k_pe[slots], cache, slots)
            before.append(cache.clone())
            with set_current_vllm_config(cfg), torch.inference_mode():
                builder = backend.get_builder_cls()(spec, [LAYER], cfg, torch.device(dev))
                metadata = builder.build(0, common_attn_metadata(case, inp.index, dev))
                # topk_indices_buffer= with indexer=None: the index group orders on the compute stream.
                impl = backend.get_impl_cls()(
                    case.heads, HEAD_SIZE, SM_SCALE, 1, None, None, case.kv_cache_dtype, None, "decoder", None,
                    **impl_topk_kwargs(backend.get_impl_cls(), topk_buffer), q_lora_rank=None, kv_lora_rank=KV_LORA_RANK,
                    qk_nope_head_dim=128, qk_rope_head_dim=ROPE_DIM, qk_head_dim=128 + ROPE_DIM, v_head_dim=128,
                    kv_b_proj=None)
                q = with_padded_tokens(case, inp.q)
                q = (q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:])  # (ql_nope, q_pe), as the layer passes it
                check_overrun = guard_index_group(impl)
                out, lse = impl.forward_mqa(q, cache, metadata, None)
                overruns.extend(check_overrun(case.num_actual_tokens))
            return {"out": out, "lse": lse}

        return self.finish(observe_paths(self.observe, call), case, slots, cache, before, write_emulated, overruns, guards)

    def finish(self, obs, case, slots, cache, before, write_emulated, overruns, guards):
        """What both FlashMLA targets add to an observation after the call: the fp8 entries written (for the
        oracle to read back), stand-ins and shims, overruns, guard regions, and whether the cache changed."""
        if before and case.kv_cache_dtype == "fp8_ds_mla":
            obs.outputs["cache_slots"] = slots  # on the device: the worker's oracle reads them back there
            obs.outputs["cache_entries"] = before[0][slots // case.block_size, slots % case.block_size]
        out = obs.outputs.get("out")
        if case.padded_tokens and out is not None and out.shape[0] == case.num_actual_tokens:
            obs.outputs["out"] = out[: case.num_tokens]  # the runner drops padding tokens' rows; none is judged
            obs.notes["padded_tokens"] = case.padded_tokens
        obs.emulated = tuple(dict.fromkeys(x for x in (*self.emulated, write_emulated) if x))  # each op once
        obs.notes["shims"] = self.shims
        if overruns:
            obs.notes["buffer_overrun"] = overruns
        if guard := guards.check():
            obs.notes["guard"] = guard
        changed = (cache.view(torch.uint8) != before[0].view(torch.uint8)).any(dim=-1).nonzero() if before else []
        if len(changed):
            obs.notes["cache_changed"] = f"{len(changed)} rows, first block {int(changed[0][0])} offset {int(changed[0][1])}"
        return obs

    def render_repro(self, finding) -> tuple[str, dict]:
        from fuzzer.artifacts.repro_flashmla import render_flashmla_repro

        return render_flashmla_repro(finding, self, layer=False)
