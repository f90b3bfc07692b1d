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

from fuzzer.repro_spec import Judge, ReproSpec
from fuzzer.support.builder_config import model_namespace
from fuzzer.support.interp.corrections import CORRECTIONS, install_corrections
from fuzzer.support.standins.cpu_shims import install_cpu_shims
from fuzzer.targets import harness
from fuzzer.targets.base import Target
from fuzzer.targets.guards import Guards
from fuzzer.targets.probes import observe_paths
from fuzzer.targets.vllm_api import remap_api
from oracles.attention_judge import attention_tolerance, judge_attention, reference_for
from strategies.batches import AttentionFeatures, attention_space
from strategies.tensors import HEAD_SIZE, KV_LORA_RANK, SM_SCALE

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

    # What prepare() reads of the release for cases() (a worker campaign's parent never imports vLLM): whether the
    # index remap takes BLOCK_STRIDE_ROWS (releases before flat_kv_row_view view the cache as contiguous rows).
    PLANNED = ("block_stride_rows",)
    block_stride_rows: bool | None = None

    def prepare(self) -> None:
        self.block_stride_rows = remap_api().has_block_stride_rows
        self.shims: list[str] = []
        if self.device == "cpu":

            install_corrections()
            self.shims = [*install_cpu_shims(), *(f"interpreter correction: {c}" for c in CORRECTIONS)]

    def cases(self, profile):
        stride_rows = self.block_stride_rows if self.block_stride_rows is not None else remap_api().has_block_stride_rows
        return attention_space(profile, AttentionFeatures(kv_cache_dtypes=self.kv_cache_dtypes,
                                                          block_stride_rows=stride_rows))

    def step(self, case, device, guards=None):
        """Everything the call needs, on `device`: inputs, poisoned cache, top-k buffer, config."""
        inp, slots, topk_buffer = harness.step_tensors(case, device, guards=guards)
        return inp, slots, harness.paged_cache(case, device, guards=guards), topk_buffer

    def run(self, case):
        dev = self.device
        guards = Guards()
        inp, slots, cache, topk_buffer = self.step(case, dev, guards)
        backend = self.backend_module().XPUMLASparseBackend
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        write, emulated = harness.cache_writer(self.device)
        cfg = model_namespace(case, max_num_batched_tokens=topk_buffer.shape[0])
        spec = MLAAttentionSpec(block_size=case.block_size, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.bfloat16)
        before = []

        def call():
            # The cache as the layer leaves it before attention: every position of every request written
            # through vLLM's cache writer (shared prefix blocks once); all other rows stay poisoned.
            write(inp.kv_c[slots], inp.k_pe[slots], cache, slots, "auto", torch.ones((), device=dev))
            before.append(cache.clone())
            builder = backend.get_builder_cls()(spec, ["attnfuzz.layer"], cfg, torch.device(dev))
            metadata = builder.build(0, harness.common_attn_metadata(case, inp.index, dev))
            # The buffer through an indexer, as the model passes it (0.23's impl accepts nothing else).
            impl = backend.get_impl_cls()(case.heads, HEAD_SIZE, SM_SCALE, 1, None, None, "auto", None, "decoder",
                                          None, indexer=SimpleNamespace(topk_indices_buffer=topk_buffer),
                                          kv_lora_rank=KV_LORA_RANK)
            q = harness.with_padded_tokens(case, inp.q)  # CUDA-graph padding tokens' rows, if the case has any
            q = (q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:])  # (ql_nope, q_pe), as the layer passes it
            out, lse = impl.forward_mqa(q, cache, metadata, None)
            if case.padded_tokens and out is not None and out.shape[0] == case.num_actual_tokens:
                out = out[: case.num_tokens]  # the runner drops padding tokens' rows; none is judged
            return {"out": out, "lse": lse}

        obs = observe_paths(self.observe, call)
        obs.emulated = tuple(x for x in (emulated,) if x)
        obs.notes["shims"] = self.shims
        harness.note_guards_and_cache(obs, guards, cache, before)
        return obs


    def repro_spec(self, finding) -> ReproSpec:
        """The step as the finding ran it (its values are drawn on its device): the cache as written, the builder
        and forward_mqa on it, judged against the fp32 reference."""

        case, dev = finding.case, finding.host.device
        cpu = dev == "cpu"
        inp, slots, cache, topk_buffer = self.step(case, dev)
        write, _ = harness.cache_writer(dev)
        write(inp.kv_c[slots], inp.k_pe[slots], cache, slots, "auto", torch.ones((), device=dev))
        tensors = harness.repro_step(case, inp.index, cache, topk_buffer, dev)
        tensors.update(q=harness.with_padded_tokens(case, inp.q), expected_out=reference_for(case, inp, dev)[0])
        atol, rtol = attention_tolerance(case, inp)
        return ReproSpec(
            about=f"Shrunk case: {case.summary()}; {case.heads} heads, values {case.values}.\n"
                  "Inputs in tensors.safetensors beside this file: q, the paged KV cache as written before attention,\n"
                  "the top-k buffer, the step's metadata and the fp32 reference output (attnfuzz's oracle).",
            imports=("import dataclasses", "from types import SimpleNamespace"),
            constants=dict(HEADS=case.heads, SM_SCALE=SM_SCALE, **harness.repro_constants(case), ATOL=atol, RTOL=rtol),
            tensors=tensors,
            support={"builder_config": "fuzzer.support.builder_config", **(harness.REPRO_CPU_SUPPORT if cpu else {})},
            prepare=harness.REPRO_CPU_PREPARE if cpu else "",
            setup=_REPRO_SETUP + harness.repro_case(case) + harness.REPRO_CACHE + _REPRO_CONFIG + harness.REPRO_METADATA,
            call=_REPRO_CALL,
            judge=Judge("attention", dict(out="out", expected='T["expected_out"]', cache="cache", before="before",
                                          atol="ATOL", rtol="RTOL")),
            bounds_checked=cpu and bool(finding.observation.memory))


_REPRO_SETUP = f"""\
from vllm.v1.attention.backend import CommonAttentionMetadata
from {BACKEND_MODULE} import XPUMLASparseBackend as Backend
from vllm.v1.kv_cache_interface import MLAAttentionSpec

"""
_REPRO_CONFIG = """\
cfg = builder_config.model_namespace(case, max_num_batched_tokens=T["topk_indices_buffer"].shape[0])
spec = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
"""
_REPRO_CALL = """\
metadata = Backend.get_builder_cls()(spec, ["layer"], cfg, torch.device(DEVICE)).build(0, cam)
impl = Backend.get_impl_cls()(HEADS, 576, SM_SCALE, 1, None, None, "auto", None, "decoder", None,
                              indexer=SimpleNamespace(topk_indices_buffer=T["topk_indices_buffer"]),
                              kv_lora_rank=512)
q = T["q"]  # (ql_nope | q_pe), as the layer hands it to forward_mqa
out, _lse = impl.forward_mqa((q[..., :512], q[..., 512:]), cache, metadata, None)
"""
