"""What a target saw when it ran one case. Targets fill it in; they never judge it.

The contract between targets and oracles: the outputs a target returns, the error the code under test
raised, the memory violations seen, and `notes`, whose keys are named and typed below (`Notes`): the oracle
reads the first group; the harness and the reports read the rest."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypedDict


class Notes(TypedDict, total=False):
    # what the oracles read
    compacted: bool  # the index call compacted valid entries to the front (oracles/index.py)
    route: dict[str, int]  # vLLM's split of the step: decode / MQA / dense-MHA token counts (the layer target)
    guard: list[str]  # guard-region bytes a call overwrote (fuzzer/targets/guards.py)
    buffer_overrun: list[str]  # writes past the index group's persistent buffers
    cache_changed: str  # rows of the KV cache an attention call changed (it must write none)
    rerun_differs: str  # the last step run again on the same metadata gave other bits (nondeterminism)
    dcp_filter_call: dict[str, Any]  # how vLLM called the DCP filter (its block stride, whether it compacted)
    dcp_cache_dtypes: list[str]  # the caches this release runs FlashMLA sparse under DCP on
    rank_batches: list[Any]  # each PCP x TP rank's share of the step, as the runner partitioned it (pcp_dcp)
    query_fp8_scale: float  # the layer's q_scale: forward_mqa was handed the query quantized to fp8 with it
    case_fields: dict[str, Any]  # a side-by-side part's form of the step: the case fields it ran with (vllm.dsv4.all)
    # what the harness and the reports read
    paths: list[str]  # vLLM's paths the case took (fuzzer/targets/probes.py)
    layer_routes: dict[str, Any]  # what this release's forward_impl offers a sparse impl
    left_out: dict[str, str]  # backends sparse_mla.all (vllm.dsv4.all) did not run on this case, and why
    padded_tokens: int  # CUDA-graph padding tokens the case carried (their rows are not judged)
    padded_tokens_not_judged: str  # why the padding tokens' rows are not even judged finite (a stand-in's open contract)
    padded_replay_not_run_eagerly: str  # why a padded graph replay was not compared with the step run eagerly
    not_public: list[str]  # what a stand-in met that the real kernel's public contract does not settle
    cudagraph: dict[str, Any]  # a full-graph engine's captured sizes, the tokens a step replayed, emulated or not
    mtp_draft: str  # an MTP draft step's metadata: "update_draft_decode_metadata" (in place) or "rebuilt"
    shims: tuple[str, ...]  # CPU shims and interpreter corrections in force
    second_opinion: str  # the other implementation that also ran the step (vLLM's CPU kernel), judged on its own
    allocator_poisoned: bool  # the caching allocator's free memory was poisoned before the call
    traceback: str  # where the code under test raised
    log_tail: str  # a crashed or hung worker's last output
    watchdog: dict[str, float]  # a hang: the watchdog's deadline, and the longer one a fresh worker hung past too
    watchdog_retry: str  # the case passed the watchdog's deadline and gave its result on a fresh worker (no hang)
    shrink_cut_short: bool  # a signal stopped the finding's shrink: its case is the smallest failing one so far
    device_lost: bool  # the case lost the CUDA context, told by the exception's type (a worker is replaced)
    out_of_memory: bool  # it lost it to the device running out of memory (targets/base.py out_of_device_memory)
    worker_recycled: str  # the worker was replaced after this case (why)
    device_memory_low: str  # the device's free memory fell below what the worker may leave (worker.recycle_below_free)
    sanitizer: str  # the compute-sanitizer tool the case ran under
    sanitizer_log: str  # compute-sanitizer's log for the case
    sanitizer_reports: list[dict]  # the log's reports, parsed (fuzzer/run/compute_sanitizer.py)
    sanitizer_worker_retired: str  # the sanitized worker neared its print limit (why)
    memcheck_rerun: str  # why `--sanitizer auto` re-ran the case under memcheck (or skipped it: a graph case)
    resumed: bool  # rebuilt from a saved finding.json (a resumed or replayed finding)
    stage_seconds: dict[str, float]  # where the case ran: "target" (target.run whole) and "oracle" seconds


@dataclass
class Observation:
    target: str
    device: str
    outputs: dict[str, Any] = field(default_factory=dict)  # tensors: on the CPU, or the device (outputs_stay_on_device)
    error_type: str | None = None  # exception raised by the code under test, if any
    error: str | None = None
    memory: list[Any] = field(default_factory=list)  # out-of-bounds accesses (interpreter sanitizer)
    real: tuple[str, ...] = ()  # vLLM functions/kernels that ran for real
    emulated: tuple[str, ...] = ()  # compiled ops replaced by attnfuzz stand-ins (must be reported)
    seconds: float = 0.0
    notes: Notes = field(default_factory=dict)  # type: ignore[assignment]
    # A trace's earlier steps, oldest first, each observed as this one is; this observation is the last step
    # that ran (a step that failed ends the trace, so it may be an earlier step of the case).
    steps: list["Observation"] = field(default_factory=list)
    # A target that runs the case through several backends (vllm.sparse_mla.all): each one's observation, by
    # vLLM's backend name. Its own outputs are empty; the oracle judges the parts, and each pair of them.
    parts: dict[str, "Observation"] = field(default_factory=dict)


NOTE_KEYS = frozenset(Notes.__annotations__)
