"""`vllm.sparse_mla.all`: every sparse-MLA backend this host can run, on the same step, judged against the
reference and against each other (`oracles.backends`).

The same contracts, separate code: FLASHMLA_SPARSE, FLASH_ATTN_MLA_SPARSE, XPU_MLA_SPARSE (vLLM's pure-Triton
backend) and FLASHINFER_MLA_SPARSE_SM90 each take the step through their own metadata builder, index conversion and
kernel on the MQA route, as their own targets drive them (`vllm.flashmla_sparse`, `vllm.flashattn_sparse`,
`vllm.triton_sparse`, `vllm.flashinfer_sparse_sm90`). A case is what all of them take: a bf16 cache (FLASH_ATTN and
XPU refuse fp8, so vLLM routes no fp8 step to them) and blocks of 64 or 128 tokens; single fresh steps. A backend
that raises on such a case is a finding of its own (vLLM would route the step to it). FLASHINFER_MLA_SPARSE_SM90
plans each top-k row's count from its context (min(context, top-k), as the indexer fills rows): it runs on the cases
whose rows are the indexer's (the knob `topk_rows`, "indexer": about half), and the others say it was left out.
Compiled kernels a host lacks are each backend's stand-ins (FlashInfer's on every host), named in every result as
each target names them. A finding that names one backend gets that backend's reproducer.
"""

from __future__ import annotations

import dataclasses

from fuzzer.observation import Observation
from fuzzer.targets.base import WHOLE, RunPlan, Target
from fuzzer.targets.flashattn_sparse import FlashAttnMLASparse
from fuzzer.targets.flashinfer_sparse_sm90 import FlashInferMLASparseSM90
from fuzzer.targets.flashmla_sparse import FlashMLASparse
from fuzzer.targets.triton_sparse import TritonSparse
from oracles.backends import judge_backends
from strategies.batches import AttentionFeatures, attention_space


class SparseMLAAll(Target):
    name = "vllm.sparse_mla.all"
    summary = ("every sparse-MLA backend this host runs (FlashMLA, FlashAttention, Triton, FlashInfer SM90), one bf16 "
               "step each, judged pairwise")
    bug_classes = "B C D I J K"
    oracle = staticmethod(judge_backends)
    kv_cache_dtypes = ("bfloat16",)
    outputs_stay_on_device = True
    # vLLM's backend name -> the target that drives it on the MQA route.
    BACKENDS = {FlashMLASparse.vllm_backend: FlashMLASparse, FlashAttnMLASparse.vllm_backend: FlashAttnMLASparse,
                "XPU_MLA_SPARSE": TritonSparse, FlashInferMLASparseSM90.vllm_backend: FlashInferMLASparseSM90}
    # Backends that take a case only when each top-k row holds min(context, top-k) valid positions (the indexer's rows).
    INDEXER_ROWS_ONLY = (FlashInferMLASparseSM90.vllm_backend,)
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
                                                          topk_rows=rows))

    def run(self, case) -> Observation:
        indexer_rows = all(t.valid == case.topk_width for t in case.topk)
        names = [n for n in self.backends if indexer_rows or n not in self.INDEXER_ROWS_ONLY]
        parts = {name: self.parts[name].run(case) for name in names}
        obs = Observation(self.name, self.device, real=self.real_parts, parts=parts,
                          emulated=tuple(dict.fromkeys(f"{name}: {e}" for name, p in parts.items() for e in p.emulated)))
        # Each backend's paths, under its name: coverage says which backend took which route.
        obs.notes["paths"] = sorted(f"{name}/{path}" for name, p in parts.items() for path in p.notes.get("paths", ()))
        obs.notes["shims"] = tuple(dict.fromkeys(s for p in parts.values() for s in p.notes.get("shims", ())))
        obs.seconds = sum(p.seconds for p in parts.values())
        if len(names) < len(self.backends):
            obs.notes["left_out"] = {n: "its rows are the indexer's only (min(context, top-k) valid); this case's are "
                                        "drawn otherwise" for n in self.backends if n not in names}
        return obs

    def repro_spec(self, finding):
        """The reproducer of the one backend the finding names (its failing verdicts', or the one out of line),
        as its own target renders it: that backend alone on the step, against the reference. None where the
        finding names several."""
        named = {v.where.split(":")[0] for v in finding.verdicts if not v.ok} & set(self.parts)
        part = finding.observation.parts.get(next(iter(named))) if len(named) == 1 else None
        if part is None:
            return None
        return self.parts[next(iter(named))].repro_spec(dataclasses.replace(finding, observation=part))
