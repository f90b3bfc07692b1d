"""`vllm.dsv4.all` and `vllm.dsv41.all`: DeepSeek-V4's (V4.1's) sparse-attention backends on the same step, each
judged against the DeepSeek-V4 oracle and each pair against each other (`oracles.backends.judge_dsv4_backends`).

V4: FLASHMLA_SPARSE_DSV4, FLASHINFER_MLA_SPARSE_DSV4 (SM100) and ROCM_FLASHMLA_SPARSE_DSV4 (AMD); V4.1:
FLASHMLA_SPARSE_DSV41, FLASHINFER_MLA_SPARSE_DSV41, FLASHMLA_MEGA_ATTN_DSV41 (SM100) and ROCM_FLASHMLA_SPARSE_DSV41.
Each takes the step through its own target's run() (`vllm.dsv4.flashmla`, `vllm.dsv4.flashinfer`, `vllm.dsv4.rocm`;
`vllm.dsv41.flashmla`, `vllm.dsv41.flashinfer`, `vllm.dsv41.flashmla_mega`, `vllm.dsv41.rocm`): vLLM's builders and
the layer's forward_mqa, with that target's stand-ins and shims, named in every result under the backend's name.

The backends store a step differently, so each runs its own form of the drawn case (`form`; the part's
notes["case_fields"], which the oracle judges it on): FlashMLA the drawn record (V4's 584 bytes; V4.1's 584 or
SM100's 528-byte MXFP8 one, as its target draws them); FlashInfer plain bf16 rows; ROCm the 584-byte record on the
drawn AMD arch; the mega layer the 528-byte record with q handed over unroped (its kernel ropes q itself:
`Dsv4.q_rope_removed`). The latents are drawn on the record's values (`Dsv4.latent_grid`): a plain bf16 row holds
exactly what the record decodes to, so every backend attends over the same keys and q, and their outputs agree
within the sum of their tolerances, compared in the RoPE'd frame (ROCm's and the mega layer's output has its RoPE
taken back out, which the oracle puts back: `oracles.dsv4.roped_frame`). FlashInfer's per-tensor fp8 rows and the
mega layer's NVFP4 compressed record hold other values than the record's, and its packed KV layout is its own
target's: not drawn here.

What every backend takes: compress ratios (V4 1/4/128, V4.1 0/1/2, a layer's own or shared compressed cache), MTP
decodes of mixed lengths, padding rows and tokens, block tables, the attention sink, the window of the model (128:
FlashInfer's kernel takes the first 128 columns as the window) and, for V4.1, the 128-token compressed block (the
kernel block of FlashInfer's and the mega layer's SM100 kernels; FlashMLA's SM90 64 is its own target's). A
backend that does not take a step is left out of it with why (`left_out`): ROCm of V4.1's 528-byte steps, the mega
layer of 584-byte steps (V4.1's steps have its 64 heads, TP1's: other head counts are each backend's own target's,
and the mega layer then takes about half the steps). ROCm's arch is drawn as its target draws it (gfx950, gfx1201, gfx1250; V4.1: gfx950, gfx1201), not
pinned to gfx950: the fallback decode of the un-tuned archs is compared with the others too, and its open bug (the
decode rows keep their RoPE, docs/bug-reports/vllm-0.33.0-rocm-dsv4-fallback-decode-no-inverse-rope.md) comes out
under the ROCm backend's name with the signature `attnfuzz gate` and `selftest` know for this target
(`fuzzer.commands.gate.SIDE_BY_SIDE`): counted as known, not a finding. ROCm runs last on a step, so that another
backend's failure on the same step is the finding's primary verdict, not the known one. A finding that names one
backend gets that backend's own reproducer, on its form of the step.
"""

from __future__ import annotations

import dataclasses

from fuzzer.observation import Observation
from fuzzer.targets.base import WHOLE, RunPlan, Target
from fuzzer.targets.dsv4_flashinfer import Dsv4FlashInfer, Dsv41FlashInfer
from fuzzer.targets.dsv4_flashmla import Dsv4FlashMLA
from fuzzer.targets.dsv4_rocm import Dsv4Rocm, Dsv41Rocm
from fuzzer.targets.dsv41_flashmla import Dsv41FlashMLA
from fuzzer.targets.dsv41_flashmla_mega import Dsv41FlashMLAMega
from fuzzer.targets.sparse_mla_all import named_backend, side_by_side
from oracles.backends import judge_dsv4_backends
from strategies.case import PLAIN_BF16_RECORD, ROCM_ARCHS
from strategies.dsv4_batches import V41_FEATURES, Dsv4Features, dsv4_form, dsv4_space

# How a backend stores the step (`Dsv4All.form`): the drawn record, plain bf16 rows, the record on an AMD arch, the
# mega layer's 528-byte record and unroped q.
RECORD, PLAIN_BF16, ROCM, MEGA = "record", "plain_bf16", "rocm", "mega"


class Dsv4All(Target):
    name = "vllm.dsv4.all"
    summary = ("DeepSeek-V4's sparse-attention backends (FLASHMLA_SPARSE_DSV4, FLASHINFER_MLA_SPARSE_DSV4, "
               "ROCM_FLASHMLA_SPARSE_DSV4) on the same step, each in its own cache form, judged pairwise")
    bug_classes = "C H J K N"
    oracle = staticmethod(judge_dsv4_backends)
    kv_cache_dtypes = ("fp8_ds_mla",)
    outputs_stay_on_device = True
    # vLLM's backend name -> (the target that drives it, how it stores the step); ROCm last (module docstring).
    BACKENDS = {"FLASHMLA_SPARSE_DSV4": (Dsv4FlashMLA, RECORD), "FLASHINFER_MLA_SPARSE_DSV4": (Dsv4FlashInfer, PLAIN_BF16),
                "ROCM_FLASHMLA_SPARSE_DSV4": (Dsv4Rocm, ROCM)}
    features = Dsv4Features(window_sizes=(128,), rocm_archs=ROCM_ARCHS, latent_grid=True)
    # What prepare() found (a worker campaign's parent plans from it and never imports vLLM).
    PLANNED = ("backends",)
    backends: tuple[str, ...] = ()

    def __init__(self, device: str) -> None:
        super().__init__(device)
        self.parts = {name: cls(device) for name, (cls, _) in self.BACKENDS.items()}

    def unavailable(self) -> str | None:
        why = {name: t.unavailable() for name, t in self.parts.items()}
        if sum(w is None for w in why.values()) < 2:
            return "fewer than two of its backends run here: " + "; ".join(f"{n}: {w}" for n, w in why.items() if w)
        return None

    def prepare(self) -> None:
        self.backends = tuple(name for name, t in self.parts.items() if t.unavailable() is None)
        for name in self.backends:
            self.parts[name].prepare()
        self.real_parts = tuple(f"{name}: {part}" for name in self.backends for part in self.parts[name].real_parts)

    def features_here(self) -> Dsv4Features:
        """The case space's features: an arch is drawn only where ROCm's backend runs."""
        rocm = any(self.BACKENDS[n][1] == ROCM for n in self.backends or self.BACKENDS)
        return self.features if rocm else dataclasses.replace(self.features, rocm_archs=())

    def cases(self, profile, plan: RunPlan = WHOLE):
        return dsv4_space(profile, self.features_here())

    def form(self, case, name: str) -> dict:
        """The fields of `case` that backend `name`'s form of the step sets (`dsv4_form`; module docstring)."""
        kind = self.BACKENDS[name][1]
        if kind == PLAIN_BF16:
            return {"kv_cache_dtype": "bfloat16", "cache_dtype": "bfloat16", "kv_record": PLAIN_BF16_RECORD,
                    "rocm_arch": ""}
        if kind == MEGA:
            return {"mega_attn": True, "q_rope_removed": True}
        return {"rocm_arch": ""} if kind == RECORD and case.dsv4.rocm_arch else {}

    def left_out(self, case) -> dict[str, str]:
        """The backends this host runs that do not take `case`, each with why."""
        d, why = case.dsv4, {}
        for name in self.backends:
            kind = self.BACKENDS[name][1]
            if kind == PLAIN_BF16 and d.window_size != 128:
                why[name] = "its kernel takes the first 128 columns of a row as the window (the model's 128)"
            elif kind == PLAIN_BF16 and d.version == "4.1" and d.compressed_block_size != 128:
                why[name] = "its compressed K cache is in the backend's 128-token kernel blocks"
            elif kind == ROCM and d.kv_record != 584:
                why[name] = ("it reads V4's 584-byte record only (vLLM writes V4.1's 528-byte MXFP8 record on SM100 "
                             "only)")
            elif kind == MEGA and d.kv_record != 528:
                why[name] = "it reads SM100's 528-byte MXFP8 record only"
            elif kind == MEGA and (case.heads != 64 or d.compressed_block_size != 128):
                why[name] = "its fused q layout is modelled for 64 heads (TP1), its kernels for 128-token blocks"
        return why

    def run(self, case) -> Observation:
        left_out = self.left_out(case)
        parts = {}
        for name in (n for n in self.backends if n not in left_out):
            fields = self.form(case, name)
            parts[name] = self.parts[name].run(dsv4_form(case, fields))
            parts[name].notes["case_fields"] = fields
        return side_by_side(self, parts, left_out)

    def repro_spec(self, finding):
        """The reproducer of the one backend the finding names (its failing verdicts', or the one out of line), as
        its own target renders it on its form of the step: that backend alone, against the reference. None where
        the finding names several."""
        name = named_backend(self, finding)
        if name is None:
            return None
        form = dsv4_form(finding.case, self.form(finding.case, name))
        return self.parts[name].repro_spec(dataclasses.replace(finding, case=form,
                                                               observation=finding.observation.parts[name]))


class Dsv41All(Dsv4All):
    name = "vllm.dsv41.all"
    summary = ("DeepSeek-V4.1's sparse-attention backends (FLASHMLA_SPARSE_DSV41, FLASHINFER_MLA_SPARSE_DSV41, "
               "FLASHMLA_MEGA_ATTN_DSV41, ROCM_FLASHMLA_SPARSE_DSV41) on the same step, each in its own cache form, "
               "judged pairwise")
    BACKENDS = {"FLASHMLA_SPARSE_DSV41": (Dsv41FlashMLA, RECORD),
                "FLASHINFER_MLA_SPARSE_DSV41": (Dsv41FlashInfer, PLAIN_BF16),
                "FLASHMLA_MEGA_ATTN_DSV41": (Dsv41FlashMLAMega, MEGA), "ROCM_FLASHMLA_SPARSE_DSV41": (Dsv41Rocm, ROCM)}
    features = dataclasses.replace(V41_FEATURES, window_sizes=(128,), compressed_blocks=(128,), heads=(64,),
                                   rocm_archs=ROCM_ARCHS[:2], latent_grid=True)
    PLANNED = ("backends", "kv_records")
    kv_records: tuple[int, ...] = V41_FEATURES.kv_records

    def prepare(self) -> None:
        super().prepare()
        # The records FlashMLA's decode reads here (its target's: SM100's 528-byte one where it is a stand-in or SM100's)
        flashmla = self.parts["FLASHMLA_SPARSE_DSV41"]
        self.kv_records = tuple(flashmla.kv_records) if "FLASHMLA_SPARSE_DSV41" in self.backends else (584,)

    def features_here(self) -> Dsv4Features:
        return dataclasses.replace(super().features_here(), kv_records=tuple(self.kv_records))
