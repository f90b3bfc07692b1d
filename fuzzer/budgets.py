"""Fixed budgets of `attnfuzz gate` and `attnfuzz selftest`: the one place they are declared.

Examples per campaign, per device and target. The CPU figures are sized so that the gate ends within 15
minutes on the 2-core CI machine (vLLM imported twice per campaign: the campaign and its worker) and the
GPU figures so that it ends within 10 minutes on one H200 (docs/benchmarks.md has the current gate and
selftest times). `--budget-scale` multiplies them all.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Budget:
    gate: int  # examples per gate campaign (one per target and kv-cache dtype)
    selftest: int  # examples per selftest campaign (each mutant on each of its targets; one clean run per target)


BUDGETS: dict[str, dict[str, Budget]] = {
    "cpu": {  # Triton interpreted and bounds-checked: 0.2-11 cases/s
        "vllm.index_remap": Budget(gate=100, selftest=80),
        "vllm.dcp_filter": Budget(gate=60, selftest=40),
        "vllm.triton_sparse": Budget(gate=30, selftest=12),
        "vllm.flashmla_sparse": Budget(gate=100, selftest=40),
        "vllm.flashmla_sparse.nvfp4": Budget(gate=100, selftest=40),
        "vllm.flashmla_sparse.layer": Budget(gate=50, selftest=30),
        "vllm.flashmla_sparse.dcp": Budget(gate=20, selftest=16),  # every DCP rank emulated: ~5 s a case
        "vllm.flashmla_sparse.layer.dcp": Budget(gate=24, selftest=12),  # every rank's layer emulated: 1-2 s a case (16 bf16: 0.6998 of the pairs)
        "vllm.flashmla_sparse.layer.pcp_dcp": Budget(gate=20, selftest=12),  # 2-4 PCP x TP ranks emulated: 1-5 s a case (12: 0.68 of the pairs)
        "vllm.flashattn_sparse": Budget(gate=60, selftest=30),
        "vllm.flashattn_sparse.layer": Budget(gate=30, selftest=20),  # steps of up to 300 tokens: 2-7 s a case
        "vllm.flashinfer_sparse_sm90": Budget(gate=40, selftest=30),  # interpreted remap/pack/clamp: ~1 case/s
        "vllm.flashinfer_sparse_sm90.layer": Budget(gate=30, selftest=20),  # steps of up to 300 tokens: ~0.5 case/s
        "vllm.flashinfer_sparse_sm100": Budget(gate=50, selftest=30),  # interpreted remap, torch stand-in: ~1.6 case/s
        "vllm.flashinfer_sparse_sm120": Budget(gate=50, selftest=30),  # interpreted remap, torch stand-in: ~1.9 case/s
        "vllm.flashattn_sparse_fa4": Budget(gate=50, selftest=30),  # FA4's stand-in, decode batches: ~2.8 case/s
        "vllm.rocm_aiter_sparse": Budget(gate=30, selftest=20),  # interpreted seqlen/remap kernels, AITER stand-in: ~0.3 case/s
        "vllm.sparse_mla.all": Budget(gate=20, selftest=10),  # four backends a case, the Triton ones interpreted: ~2 s (12: 0.69 of the pairs)
        "vllm.dsv4.flashmla": Budget(gate=30, selftest=16),  # decodes ~0.1 s, prefills' interpreted gathers 1-4 s
        "vllm.dsv41.flashmla": Budget(gate=30, selftest=16),  # V4.1's layer kinds on the same step: ~0.4 s a case
        "vllm.dsv41.flashmla_mega": Budget(gate=60, selftest=30),  # the mega stand-ins on V4.1's step: ~6 cases/s
        "vllm.dsv4.flashinfer": Budget(gate=40, selftest=30),  # interpreted index build, torch stand-in: ~3 cases/s
        "vllm.dsv41.flashinfer": Budget(gate=40, selftest=30),  # V4.1's objects on the same route: ~3 cases/s
        "vllm.dsv4.rocm": Budget(gate=30, selftest=30),  # interpreted ROCm decode/prefill kernels: 0.5-10 s a case
        "vllm.dsv41.rocm": Budget(gate=30, selftest=30),  # V4.1's objects on the same route: 0.4-10 s a case
        "vllm.dsv4.all": Budget(gate=30, selftest=16),  # the three V4 backends a case, ROCm's interpreted: ~3.2 s a case
        "vllm.dsv41.all": Budget(gate=30, selftest=16),  # three of V4.1's four backends a case: ~3.5 s a case
        "vllm.indexer": Budget(gate=100, selftest=60),  # torch stand-ins, little interpreted Triton: ~0.2 s a case
        "vllm.dsv32.attention": Budget(gate=30, selftest=30),  # indexer + FlashMLA stand-in + interpreted remap: ~2 s a case
        "vllm.dsv32.attention.flashattn": Budget(gate=24, selftest=20),  # indexer steps of up to 300 tokens: ~2.6 s a case
        "vllm.dsv32.attention.flashinfer_sm90": Budget(gate=24, selftest=20),  # and FlashInfer's stand-in: ~3.8 s a case
        "vllm.dsv32.attention.dcp": Budget(gate=24, selftest=12),  # 2-8 ranks' indexer and layer, interpreted combine: ~5 s a case
        "vllm.dsv32.attention.pcp_dcp": Budget(gate=40, selftest=30),  # PCP x TP ranks' indexer and layer: ~1 case/s (30: 0.698 of the pairs)
        "vllm.dsv32.attention.shardq": Budget(gate=30, selftest=20),  # 2-4 TP ranks' indexer and layer: 0.3-0.5 case/s
        "vllm.step5_dsa": Budget(gate=24, selftest=20),  # interpreted decode kernels, up to 9 steps a case: ~0.2-1 case/s
    },
    "cuda": {  # native kernels, 2-13 cases/s (mostly host-side work per case)
        "vllm.index_remap": Budget(gate=300, selftest=150),
        "vllm.dcp_filter": Budget(gate=300, selftest=150),
        "vllm.triton_sparse": Budget(gate=150, selftest=40),
        "vllm.flashmla_sparse": Budget(gate=200, selftest=60),
        "vllm.flashmla_sparse.nvfp4": Budget(gate=200, selftest=60),
        "vllm.flashmla_sparse.layer": Budget(gate=150, selftest=60),
        "vllm.flashmla_sparse.dcp": Budget(gate=100, selftest=40),
        "vllm.flashmla_sparse.layer.dcp": Budget(gate=60, selftest=40),
        "vllm.flashmla_sparse.layer.pcp_dcp": Budget(gate=60, selftest=40),
        "vllm.flashattn_sparse": Budget(gate=100, selftest=60),
        "vllm.flashattn_sparse.layer": Budget(gate=60, selftest=40),
        "vllm.flashinfer_sparse_sm90": Budget(gate=100, selftest=60),  # FlashInfer real where it imports (28 s a dtype)
        "vllm.flashinfer_sparse_sm90.layer": Budget(gate=100, selftest=60),
        "vllm.flashinfer_sparse_sm100": Budget(gate=100, selftest=60),  # FlashInfer's kernel a stand-in on every host
        "vllm.flashinfer_sparse_sm120": Budget(gate=100, selftest=60),
        "vllm.flashattn_sparse_fa4": Budget(gate=100, selftest=60),  # FA4 and trtllm-gen stand-ins on every host
        "vllm.rocm_aiter_sparse": Budget(gate=100, selftest=60),  # AITER's kernels a stand-in on every host
        "vllm.sparse_mla.all": Budget(gate=100, selftest=40),
        "vllm.dsv4.flashmla": Budget(gate=150, selftest=40),
        "vllm.dsv41.flashmla": Budget(gate=150, selftest=40),
        "vllm.dsv41.flashmla_mega": Budget(gate=150, selftest=40),
        "vllm.dsv4.flashinfer": Budget(gate=150, selftest=40),  # FlashInfer's kernel a stand-in on every host
        "vllm.dsv41.flashinfer": Budget(gate=150, selftest=40),
        "vllm.dsv4.all": Budget(gate=100, selftest=40),  # FlashMLA real, FlashInfer's stand-in (ROCm: CPU only)
        "vllm.dsv41.all": Budget(gate=100, selftest=40),
        "vllm.indexer": Budget(gate=60, selftest=30),  # ~1-3 s a case on an H100 (DeepGEMM's JIT, fp64 oracle)
        "vllm.dsv32.attention": Budget(gate=40, selftest=30),  # the indexer's cost and a backend step
        "vllm.dsv32.attention.flashattn": Budget(gate=40, selftest=30),
        "vllm.dsv32.attention.flashinfer_sm90": Budget(gate=40, selftest=30),
        "vllm.dsv32.attention.dcp": Budget(gate=40, selftest=30),  # every rank in one process: the ranks' calls in turn
        "vllm.dsv32.attention.shardq": Budget(gate=40, selftest=30),  # every TP rank in one process, as the DCP module's
        "vllm.step5_dsa": Budget(gate=100, selftest=60),  # native Triton decode kernels: 150 cases in 116-137 s on an H100
    },
}
DEFAULT = {"cpu": Budget(gate=30, selftest=30), "cuda": Budget(gate=100, selftest=60)}  # a target added later

# Wall-clock limit of one campaign process (a hung campaign is an error, not a pass) and of one repro.py.
CAMPAIGN_TIMEOUT_S = {"cpu": 600.0, "cuda": 300.0}
REPRO_TIMEOUT_S = {"cpu": 300.0, "cuda": 180.0}

GATE_SEED = 0
# The least share of the possible pairs of knob categories (fuzzer/search/combinations.py, impossible pairs
# counted) that each gate campaign's cases must cover; docs/benchmarks.md has what the gate's campaigns reach.
GATE_MIN_PAIR_COVERAGE = 0.7
# A mutant's self-test campaign stops at its first finding; this caps it where a narrow mutant is missed.
SELFTEST_MUTANT_CAP = 300
SELFTEST_SEED = 1
NOT_FUZZED = ("selftest.fault",)  # the harness's own fault target: it fails on purpose


def examples(device: str, target: str, kind: str, scale: float = 1.0) -> int:
    """The budget of one campaign: kind is "gate" or "selftest"."""
    if device not in BUDGETS:
        raise ValueError(f"device {device!r}: budgets exist for {', '.join(BUDGETS)}")
    if kind not in ("gate", "selftest"):
        raise ValueError(f"kind {kind!r}: gate or selftest")
    if scale <= 0:
        raise ValueError(f"budget scale {scale}: must be > 0")
    budget = BUDGETS[device].get(target, DEFAULT[device])
    return max(1, round(getattr(budget, kind) * scale))
