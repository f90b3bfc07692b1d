"""`vllm.sparse_mla.all`: every sparse-MLA backend this host can run, on the same step, judged against the
reference and against each other (`oracles.backends`).

The same contracts, separate code: FLASHMLA_SPARSE, FLASH_ATTN_MLA_SPARSE, XPU_MLA_SPARSE (vLLM's pure-Triton
backend), FLASHINFER_MLA_SPARSE_SM90 and the Blackwell ones, FLASHINFER_MLA_SPARSE (SM100, trtllm-gen),
FLASHINFER_MLA_SPARSE_SM120 and FLASH_ATTN_MLA_SPARSE_FA4 (SM100, FA4), and ROCM_AITER_MLA_SPARSE (AMD), each take the
step through their own metadata builder, index conversion and kernel on the MQA route, as their own targets drive them
(`vllm.flashmla_sparse`, `vllm.flashattn_sparse`, `vllm.triton_sparse`, `vllm.flashinfer_sparse_sm90`,
`vllm.flashinfer_sparse_sm100`, `vllm.flashinfer_sparse_sm120`, `vllm.flashattn_sparse_fa4`, `vllm.rocm_aiter_sparse`).
Single fresh steps, blocks of 64 or 128 tokens. A step's cache is bf16 or fp8_ds_mla, and a backend takes it where
vLLM would route that cache to it (its target's kv_cache_dtypes): bf16 to all but SM120, fp8_ds_mla to FLASHMLA_SPARSE
and SM120 (SM120 takes fp8_ds_mla only; its fp8_ds_mla steps draw the tile-scale conventions whose model's scale format
reads them exactly, power-of-two with DeepSeek-V3.2, arbitrary with GLM-5, so FlashMLA and SM120 read the same bytes
alike). A backend that raises on such a case is a finding of its own (vLLM would route the step to it).
FLASHINFER_MLA_SPARSE_SM90 plans each top-k row's count from its context, ROCM_AITER_MLA_SPARSE computes it from the
positions, and trtllm-gen's answer for a row of no entry is not public (SM100, and FA4's non-decode batches): those
four run on the cases whose rows are the indexer's (the knob `topk_rows`, "indexer": about half), and the others say
they were left out, as a backend the step's cache does not fit is. ROCM_AITER_MLA_SPARSE also reads a row's first
entries as the valid ones (the indexer's -1 entries at the tail) and takes graph padding tokens only in a replayed FULL
graph, as vLLM pads metadata for no other step: it is left out of steps with -1 entries elsewhere or with padding
tokens. Compiled kernels a host lacks are each backend's stand-ins (FlashInfer's, FA4's and AITER's on every host),
named in every result as each target names them. A finding that names one backend gets that backend's reproducer.
"""

from __future__ import annotations

import dataclasses

from fuzzer.observation import Observation
from fuzzer.targets.base import WHOLE, RunPlan, Target
from fuzzer.targets.flashattn_sparse import FlashAttnMLASparse
from fuzzer.targets.flashattn_sparse_fa4 import FlashAttnMLASparseFA4
from fuzzer.targets.flashinfer_sparse_blackwell import FlashInferMLASparseSM100, FlashInferMLASparseSM120
from fuzzer.targets.flashinfer_sparse_sm90 import FlashInferMLASparseSM90
from fuzzer.targets.flashmla_sparse import FlashMLASparse
from fuzzer.targets.rocm_aiter_sparse import RocmAiterMLASparse
from fuzzer.targets.triton_sparse import TritonSparse
from oracles.backends import judge_backends
from strategies.batches import AttentionFeatures, attention_space


class SparseMLAAll(Target):
    name = "vllm.sparse_mla.all"
    summary = ("every sparse-MLA backend this host runs (FlashMLA, FlashAttention FA3 and FA4, Triton, FlashInfer SM90, "
               "SM100 and SM120, ROCm AITER), one step each (bf16, or fp8_ds_mla where it fits), judged pairwise")
    bug_classes = "B C D I J K"
    oracle = staticmethod(judge_backends)
    kv_cache_dtypes = ("bfloat16", "fp8_ds_mla")
    outputs_stay_on_device = True
    # vLLM's backend name -> the target that drives it on the MQA route.
    BACKENDS = {FlashMLASparse.vllm_backend: FlashMLASparse, FlashAttnMLASparse.vllm_backend: FlashAttnMLASparse,
                "XPU_MLA_SPARSE": TritonSparse, FlashInferMLASparseSM90.vllm_backend: FlashInferMLASparseSM90,
                FlashInferMLASparseSM100.vllm_backend: FlashInferMLASparseSM100,
                FlashInferMLASparseSM120.vllm_backend: FlashInferMLASparseSM120,
                FlashAttnMLASparseFA4.vllm_backend: FlashAttnMLASparseFA4,
                RocmAiterMLASparse.vllm_backend: RocmAiterMLASparse}
    # Backends that take a case only when each top-k row holds min(context, top-k) valid positions (the indexer's rows).
    INDEXER_ROWS_ONLY = (FlashInferMLASparseSM90.vllm_backend, FlashInferMLASparseSM100.vllm_backend,
                         FlashAttnMLASparseFA4.vllm_backend, RocmAiterMLASparse.vllm_backend)
    # Backends that read a row's first min(position + 1, top-k) entries as its valid ones, and whose Python refuses
    # padded metadata run eagerly (vLLM pads it only for a FULL graph, `pad_attn`; this target's steps are eager).
    RAGGED_ROWS = (RocmAiterMLASparse.vllm_backend,)
    # fp8_ds_mla tile-scale conventions whose readers agree: each with the model SM120 reads it for (exactly)
    FP8_SCALES = FlashInferMLASparseSM120.FP8_SCALES
    # What prepare() found (a worker campaign's parent plans from it and never imports vLLM).
    PLANNED = ("backends", "block_stride_rows")
    backends: tuple[str, ...] = ()
    block_stride_rows: bool | None = None

    def __init__(self, device: str) -> None:
        super().__init__(device)
        self.parts = {name: cls(device) for name, cls in self.BACKENDS.items()}

    def unavailable(self) -> str | None:
        why = {name: t.unavailable() for name, t in self.parts.items()}
        if sum(w is None for w in why.values()) < 2:
            return "fewer than two sparse-MLA backends run here: " + "; ".join(f"{n}: {w}" for n, w in why.items() if w)
        return None

    def prepare(self) -> None:
        self.backends = tuple(name for name, t in self.parts.items() if t.unavailable() is None)
        for name in self.backends:
            self.parts[name].prepare()
        # Each backend's remap is the release's one: block strides are drawn where it takes them.
        self.block_stride_rows = all(self.parts[name].block_stride_rows for name in self.backends)
        self.real_parts = tuple(f"{name}: {part}" for name in self.backends for part in self.parts[name].real_parts)

    def cases(self, profile, plan: RunPlan = WHOLE):
        stride_rows = self.block_stride_rows if self.block_stride_rows is not None else \
            self.parts[FlashMLASparse.vllm_backend].has_block_stride_rows()
        rows = ("drawn", "indexer") if set(self.backends or self.BACKENDS) & set(self.INDEXER_ROWS_ONLY) else ("drawn",)
        return attention_space(profile, AttentionFeatures(kv_cache_dtypes=plan.kv_dtypes(self), block_sizes=(64, 128),
                                                          block_stride_rows=stride_rows, cudagraph_padding=True,
                                                          topk_rows=rows, fp8_scales=self.FP8_SCALES))

    def left_out(self, case) -> dict[str, str]:
        """The backends this host runs that do not take `case`, each with why."""
        indexer_rows = all(t.valid == case.topk_width for t in case.topk)
        why = {}
        for name in self.backends:
            if case.kv_cache_dtype not in self.BACKENDS[name].kv_cache_dtypes:
                why[name] = (f"it takes {', '.join(self.BACKENDS[name].kv_cache_dtypes)} caches (vLLM routes no "
                             f"{case.kv_cache_dtype} step to it)")
            elif not indexer_rows and name in self.INDEXER_ROWS_ONLY:
                why[name] = "its rows are the indexer's only (min(context, top-k) valid); this case's are drawn otherwise"
            elif name in self.RAGGED_ROWS and any(t.invalid_at != "tail" for t in case.topk):
                why[name] = "it reads a row's valid entries first, as the indexer writes them; this case's -1 entries " \
                            "are elsewhere"
            elif name in self.RAGGED_ROWS and case.padded_tokens:
                why[name] = "vLLM pads its metadata only in a FULL graph, and its Python refuses padded metadata " \
                            "run eagerly; this case's step is eager with graph padding"
        return why

    def run(self, case) -> Observation:
        left_out = self.left_out(case)
        names = [n for n in self.backends if n not in left_out]
        return side_by_side(self, {name: self.parts[name].run(case) for name in names}, left_out)

    def repro_spec(self, finding):
        """The reproducer of the one backend the finding names (its failing verdicts', or the one out of line),
        as its own target renders it: that backend alone on the step, against the reference. None where the
        finding names several."""
        name = named_backend(self, finding)
        if name is None:
            return None
        return self.parts[name].repro_spec(dataclasses.replace(finding, observation=finding.observation.parts[name]))


def side_by_side(target: Target, parts: dict[str, Observation], left_out: dict[str, str]) -> Observation:
    """One observation of a step run through several backends (`parts`, by vLLM's backend name): each part's emulated
    ops, paths and shims under its name, its seconds summed, the backends left out with why."""
    obs = Observation(target.name, target.device, real=target.real_parts, parts=parts,
                      emulated=tuple(dict.fromkeys(f"{name}: {e}" for name, p in parts.items() for e in p.emulated)))
    # Each backend's paths, under its name: coverage says which backend took which route.
    obs.notes["paths"] = sorted(f"{name}/{path}" for name, p in parts.items() for path in p.notes.get("paths", ()))
    obs.notes["shims"] = tuple(dict.fromkeys(s for p in parts.values() for s in p.notes.get("shims", ())))
    obs.seconds = sum(p.seconds for p in parts.values())
    if left_out:
        obs.notes["left_out"] = left_out
    return obs


def named_backend(target: Target, finding) -> str | None:
    """The one backend a side-by-side finding names (its failing verdicts', or the one out of line) that took part in
    the step; None where it names several or none."""
    named = {v.where.split(":")[0] for v in finding.verdicts if not v.ok} & set(target.parts)
    name = next(iter(named)) if len(named) == 1 else None
    return name if name in finding.observation.parts else None
