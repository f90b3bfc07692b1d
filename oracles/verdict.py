"""Verdicts: what an oracle concludes about one observation. Plain data, comparable and printable."""

from __future__ import annotations

from dataclasses import dataclass

# Every check an oracle (or the harness) emits, in the order that picks a finding's primary symptom: an
# out-of-bounds access outranks what follows from it. tests/oracles/test_verdict.py checks that every check name
# in the code is here.
CHECKS: dict[str, str] = {
    "memory": "an out-of-bounds or uninitialized access (interpreter bounds checks, compute-sanitizer, guards)",
    "crash": "the process running the case died (segfault, abort, lost CUDA context, out of memory)",
    "hang": "no result within the case timeout",
    "contract": "a call that must be refused (mis-sized arguments) was accepted",
    "error": "the code under test raised on a valid case",
    "cache": "the KV cache changed during a call that must not write it",
    "cache_write": "the cache writer's bytes differ from the layout's reference encoding",
    "metadata": "a metadata kernel's output differs from its definition (DeepSeek-V4: SWA indices and lengths, the "
                "C128A top-k, the compressed slot mapping, prefill gather lengths, the batch split)",
    "gather": "gathered or dequantized context K/V differs from the cache bytes' decoding",
    "dcp_filter": "a DCP rank's filtered top-k indices differ from its exact share",
    "dcp_empty_shard": "a rank that holds none of a row's tokens is not neutral in the merge",
    "dcp_rank_lse": "a rank's LSE over its own share is off",
    "nan": "NaN or Inf where the fp32 reference is finite",
    "empty_row": "a row with no valid index does not give LSE -inf / output 0",
    "count": "a valid count differs from the number of valid indices",
    "set": "the set of valid indices differs: entries missing from the valid prefix",
    "slot": "the valid prefix holds slots no entry maps to (a wrong address)",
    "layout": "valid indices are not where the mode puts them (compaction, padding)",
    "values": "index values differ from the documented remap",
    "topk": "the indexer's top-k rows are not a top-k of the step's scores (an id outside the causal window, a repeat, "
            "a wrong count, -1 before an id, or a selected score below the k-th best beyond the tolerance)",
    "dcp_topk": "DCP ranks' top-k buffers differ after the indexer's merge (every rank must hold the same merged rows)",
    "padded_rows": "a CUDA-graph padding token's row is not as vLLM's code leaves it (the indexer clears it to -1)",
    "buffer_rows": "a persistent buffer changed in rows past the step's",
    "route": "the indexer and the MLA layer disagree on a token's route: dense MHA over a causal window wider than "
             "the top-k, or forward_mqa over a top-k row the indexer left unscored",
    "output": "attention output outside the tolerance of the fp32 reference",
    "cpu_second_opinion": "vLLM's own CPU implementation (its layer and kernel), run on the same step as a second "
                          "opinion, outside the tolerance of the fp32 reference",
    "lse": "LSE outside the tolerance of the fp32 reference",
    "dcp_rank_out": "a rank's partial output over its own share is off",
    "cp_replica": "the ranks that must hold the same MLA cache entries (a DCP rank's PCP replicas; every rank "
                  "without DCP) hold them differently after the step",
    "pcp_rank_rows": "a PCP rank's own rows (a prefill every rank runs whole; one copy is kept) are off",
    "backends": "two sparse-MLA backends give outputs of the same step further apart than both tolerances",
    "graph": "a step replayed from a captured CUDA graph differs from the same step run eagerly (stale metadata)",
    "draft": "an MTP draft step on metadata updated in place differs from the same step on metadata built for it",
    "stateful": "a step that fails after the steps before it passes alone on a fresh engine (state a step left)",
    "rerun": "a step run again on the same metadata gave other bits (nondeterminism, state a call leaves behind)",
    "shape": "an output of the wrong shape",
    "selftest": "the harness's own fault target (not vLLM)",
}
PRIORITY = tuple(CHECKS)


@dataclass(frozen=True)
class Verdict:
    check: str  # a key of CHECKS
    ok: bool
    detail: str
    bug_class: str = ""  # the letter of ../shared/docs/bug-classes.md this symptom points at, if any
    margin: float | None = None  # error / tolerance (<= 1 passes), where the check is numeric
    where: str = ""  # a stable location for deduplication (kernel+argument, row kind, ...)
    step: int = 0  # which step of a trace it judged, from 1 (0: a single-step case)

    @property
    def signature(self) -> str:
        return f"{self.check}:{self.where}" if self.where else self.check


def passed(check: str, detail: str = "", margin: float | None = None) -> Verdict:
    return Verdict(check, True, detail, margin=margin)


def primary(failed: list[Verdict]) -> Verdict:
    return min(failed, key=lambda v: PRIORITY.index(v.check) if v.check in PRIORITY else len(PRIORITY))
