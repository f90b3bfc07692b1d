"""`vllm.flashmla_sparse`: vLLM's FlashMLA sparse-MLA backend (`FLASHMLA_SPARSE`), whole, on the MQA route.

vLLM's FlashMLASparseMetadataBuilder and FlashMLASparseImpl.forward_mqa over every token (no prefill backend
on the layer, so nothing is split off to dense MHA), with a bf16 or fp8_ds_mla cache: the builder's split and
req_id_per_token, the index group and the index-remap Triton kernel, head padding, the fp8 mixed-batch and
separate prefill/decode paths. Where this host lacks FlashMLA's compiled kernels and vLLM's cache ops (any
CPU), torch stand-ins from `fuzzer.support.standins.flashmla_ops` are bound where `flashmla_sparse` looks them up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fuzzer.env import STATE_DIR
from fuzzer.repro_spec import Judge, ReproSpec
from fuzzer.support.cudagraphs import EMULATED as EMULATED_GRAPHS
from fuzzer.support.flashmla_runtime import (
    BACKEND_MODULE,
    FP8_ENTRY_BYTES,
    LAYER,
    MAX_MODEL_LEN,
    _try_import,
    configure,
    cpu_shims,
    define_missing_c_queries,
    guard_index_group,
    has_cache_op,
    impl_topk_kwargs,
    prefill_outputs_under_initcheck,
    sparse_backend,
    vllm_runtime,
)
from fuzzer.support.interp.corrections import CORRECTIONS, install_corrections
from fuzzer.support.standins.cpu_shims import install_cpu_shims
from fuzzer.support.standins.flashmla_ops import concat_and_cache_mla
from fuzzer.targets.base import Target
from fuzzer.targets.guards import Guards
from fuzzer.targets.harness import (
    REPRO_CACHE,
    REPRO_CPU_PREPARE,
    REPRO_CPU_SUPPORT,
    REPRO_METADATA,
    DecodeGraphs,
    cache_writer,
    common_attn_metadata,
    fill_topk,
    note_guards_and_cache,
    paged_cache,
    repro_case,
    repro_constants,
    repro_step,
    step_slots,
    step_tensors,
    topk_buffer_for,
    with_padded_tokens,
)
from fuzzer.targets.probes import observe_paths
from fuzzer.targets.vllm_api import remap_api
from oracles.attention_judge import (
    attention_tolerance,
    judge_attention,
    judge_cache_entries,
    layer_reference_for,
    layer_tolerance,
    reference_for,
)
from oracles.steps import judge_steps
from strategies.batches import AttentionFeatures, attention_space
from strategies.tensors import (
    HEAD_SIZE,
    KV_LORA_RANK,
    ROPE_DIM,
    SM_SCALE,
    materialize_attention_inputs,
    materialize_layer_inputs,
    written_slots,
)


@dataclass
class StepContext:
    """What one step of a trace runs on: the engine's objects (builder, impl or layer, built in the first step),
    its config, cache and persistent top-k buffer, and what the step's call reports back."""

    engine: dict
    cfg: object
    spec: object
    cache: torch.Tensor
    topk_buffer: torch.Tensor
    guards: Guards
    first: bool  # the trace's first step (the engine is built in it)
    rerun: bool  # run the step a second time on the same metadata (the determinism check)
    graphs: DecodeGraphs | None = None  # a full-graph engine's runner buffers and captured graphs
    overruns: list = field(default_factory=list)
    notes: dict = field(default_factory=dict)


class FlashMLASparse(Target):
    name = "vllm.flashmla_sparse"
    summary = "FlashMLA sparse-MLA backend (FLASHMLA_SPARSE): builder + impl.forward_mqa, bf16 and fp8_ds_mla"
    bug_classes = "B C D G H I J K M"
    oracle = staticmethod(judge_steps(judge_attention))
    real_parts = ("FlashMLASparseMetadataBuilder", "FlashMLASparseImpl.forward_mqa", "SparseMLAIndexGroup",
                  "the index-remap Triton kernel")
    kv_cache_dtypes = ("bfloat16", "fp8_ds_mla")
    cudagraph_modes = ("none", "full")
    outputs_stay_on_device = True  # the attention oracles judge on the device (oracles/attention_judge.py)
    vllm_backend = "FLASHMLA_SPARSE"  # vLLM's name for the backend whose builder and impl every step runs
    # Traces with MTP draft steps (Case.mtp_draft): for a builder that updates draft metadata in place.
    # FlashMLA's cannot (vLLM rebuilds it, an ordinary step), so its traces draw none.
    mtp_draft = False
    # What prepare() reads of the release that cases() needs (a worker campaign's parent never imports vLLM):
    # whether the index remap takes BLOCK_STRIDE_ROWS (releases before flat_kv_row_view view the cache as
    # contiguous rows).
    PLANNED = ("block_stride_rows",)
    block_stride_rows: bool | None = None

    def unavailable(self) -> str | None:
        try:
            sparse_backend(self.vllm_backend, self.device)
        except Exception as e:
            return f"cannot import vLLM's {self.vllm_backend} backend: {type(e).__name__}: {e}"
        return None

    def prepare(self) -> None:

        self.shims: list[str] = list(define_missing_c_queries())
        if self.device == "cpu":  # before the backend is imported: it binds PIN_MEMORY by name

            install_corrections()
            self.shims += [*install_cpu_shims(), *cpu_shims(), *(f"interpreter correction: {c}" for c in CORRECTIONS)]
        self.backend, self.emulated = sparse_backend(self.vllm_backend, self.device)
        self.shims += prefill_outputs_under_initcheck(self.device)
        self.real_parts = self.real_parts_here()
        self.cfg = self.runtime(str(STATE_DIR))
        self.block_stride_rows = remap_api().has_block_stride_rows

    def real_parts_here(self) -> tuple[str, ...]:
        """What of vLLM really ran, as this release and host have it (every result lists it)."""

        parts = [p for p in type(self).real_parts if p != "SparseMLAIndexGroup"
                 or _try_import("vllm.v1.attention.backends.mla.index_group") is not None]
        if self.device == "cuda":  # the compiled FlashMLA extension; on a CPU its kernels are stand-ins (emulated)
            parts.append("FlashMLA's CUDA kernels (vllm._flashmla_C)")
        return tuple(parts)

    def runtime(self, state_dir: str):
        """vLLM's config and process groups for this process (one rank of its own)."""
        return vllm_runtime(self.device, state_dir)

    def has_block_stride_rows(self) -> bool:
        """As prepare() (or, in a campaign's parent, the worker's prepare()) read it; else from the release."""
        return self.block_stride_rows if self.block_stride_rows is not None else remap_api().has_block_stride_rows

    def cases(self, profile):
        return attention_space(profile, AttentionFeatures(kv_cache_dtypes=self.kv_cache_dtypes, block_sizes=(64, 128),
                                                          block_stride_rows=self.has_block_stride_rows(),
                                                          cudagraph_padding=True, traces=True,
                                                          cudagraph_modes=self.cudagraph_modes,
                                                          mtp_draft=self.mtp_draft))

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
            write, emulated = cache_writer(self.device)
            return (lambda kv_c, k_pe, cache, slots: write(kv_c, k_pe, cache, slots, "auto", torch.ones((), device=cache.device))), emulated
        if self.device != "cpu" and has_cache_op("concat_and_cache_mla"):
            op = torch.ops._C_cache_ops.concat_and_cache_mla
            return (lambda kv_c, k_pe, cache, slots: op(kv_c, k_pe, cache, slots, "fp8_ds_mla", torch.ones((), device=cache.device))), None

        convention = case.fp8_scale if case.fp8_scale != "e8m0_trunc" else "pow2"  # pow2 scales survive e8m0
        return (lambda kv_c, k_pe, cache, slots: concat_and_cache_mla(kv_c, k_pe, cache, slots, "fp8_ds_mla", None, convention)), "concat_and_cache_mla"

    def run(self, case):
        return self.run_steps(case, self.mqa_step)

    def run_steps(self, case, step_call):
        """Every step of `case` (one, or a trace's) on ONE builder, impl, cache and top-k buffer, as vLLM's model
        runner keeps them for the life of the engine. Before each step's call the cache holds what the layer
        leaves there (`written_slots`: its new tokens; in a first step every slot its requests hold) and the
        top-k buffer the indexer's rows; each step is observed on its own (`Observation.steps`) and the trace
        ends at the first step that fails. The last step of a trace runs twice on the same metadata: a
        deterministic backend gives the same bits (`out_again`)."""
        from vllm.config import set_current_vllm_config

        dev = self.device
        guards = Guards()
        cache = self.cache(case, dev, guards)
        topk_buffer = topk_buffer_for(case, dev, guards)
        write, write_emulated = self.writer(case)
        cfg = configure(self.cfg, case, max_num_batched_tokens=topk_buffer.shape[0])
        spec = self.kv_cache_spec(case, cfg)
        engine: dict = {}  # what the runner keeps across steps: built in the first step's call
        graphs = DecodeGraphs(case, dev, MAX_MODEL_LEN) if case.cudagraph == "full" else None
        observed = []
        steps = case.steps
        for k, step in enumerate(steps):
            inputs = self.step_inputs(step)
            inp = getattr(inputs, "attention", inputs)
            fill_topk(topk_buffer, step, inp.index)
            written = written_slots(step).to(dev)
            ctx = StepContext(engine, cfg, spec, cache, topk_buffer, guards, first=k == 0,
                              rerun=bool(case.earlier) and k == len(steps) - 1, graphs=graphs)
            before: list = []

            def call(step=step, inputs=inputs, inp=inp, written=written, before=before, ctx=ctx):
                write(inp.kv_c[written], inp.k_pe[written], cache, written)
                before.append(cache.clone())
                with set_current_vllm_config(cfg), torch.inference_mode():
                    out = step_call(ctx, step, inputs)
                # A later step may reuse the buffers this one's outputs live in: keep them as they were.
                return {name: t.clone() for name, t in out.items() if t is not None} if len(steps) > 1 else out

            obs = self.finish(observe_paths(self.observe, call), step, step_slots(inp, dev), cache, before,
                              write_emulated, ctx.overruns, guards)
            obs.notes.update(ctx.notes)
            if graphs is not None and graphs.emulated:
                obs.emulated = (*obs.emulated, EMULATED_GRAPHS)
            observed.append(obs)
            if obs.error_type or obs.memory or obs.notes.get("guard"):
                break
        last = observed[-1]
        last.steps = observed[:-1]
        if last.steps:  # the trace's paths, every step's
            last.notes["paths"] = sorted({p for o in observed for p in o.notes.get("paths", ())})
        return last

    def kv_cache_spec(self, case, cfg):
        """The layer's KV-cache spec as the builder gets it."""
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        return MLAAttentionSpec(block_size=case.block_size, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.bfloat16,
                                cache_dtype_str=case.kv_cache_dtype)

    def step_inputs(self, step):
        return materialize_attention_inputs(step, self.device)

    def new_engine(self, ctx: "StepContext", step) -> None:
        """The objects vLLM's runner keeps for the engine's life, in `ctx.engine`: the metadata builder, the impl and
        (`layer`) what the layer hands forward_mqa as itself (None: FlashMLA reads nothing of it)."""
        backend, engine = self.backend, ctx.engine
        engine["builder"] = backend.get_builder_cls()(ctx.spec, [LAYER], ctx.cfg, torch.device(self.device))
        # topk_indices_buffer= with indexer=None: the index group orders on the compute stream.
        engine["impl"] = backend.get_impl_cls()(
            step.heads, HEAD_SIZE, SM_SCALE, 1, None, None, step.kv_cache_dtype, None, "decoder", None,
            **impl_topk_kwargs(backend.get_impl_cls(), ctx.topk_buffer), q_lora_rank=None,
            kv_lora_rank=KV_LORA_RANK, qk_nope_head_dim=128, qk_rope_head_dim=ROPE_DIM, qk_head_dim=128 + ROPE_DIM,
            v_head_dim=128, kv_b_proj=None)
        engine["layer"] = None

    def mqa_step(self, ctx: "StepContext", step, inp):
        """One step through FlashMLASparseImpl.forward_mqa (every token), on the engine's builder and impl; in a
        full-graph engine a uniform decode step is replayed from the graph captured at start-up, and run
        eagerly on the same metadata too (`out_eager`)."""
        dev, engine = self.device, ctx.engine
        if not engine:
            self.new_engine(ctx, step)
        impl, builder, layer = engine["impl"], engine["builder"], engine["layer"]

        def forward(q, metadata):  # (ql_nope, q_pe), as the layer passes it
            out, lse = impl.forward_mqa((q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:]), ctx.cache, metadata, layer)
            return {"out": out, "lse": lse}

        graphs = ctx.graphs
        if graphs is not None and ctx.first and graphs.sizes:  # the runner captures before its first step
            graphs.capture(builder, forward, (step.heads, HEAD_SIZE), inp.q.dtype, ctx.topk_buffer)
            ctx.notes["cudagraph"] = {"captured": [list(s) for s in graphs.sizes], "emulated": graphs.emulated}
        if step.mtp_draft:
            metadata = self.draft_metadata(ctx, step, inp)
        else:
            cam = graphs.stage(step, inp.index) if graphs is not None else common_attn_metadata(step, inp.index, dev)
            metadata = builder.build(0, cam)
            engine["cam"], engine["metadata"] = cam, metadata
        q = with_padded_tokens(step, inp.q)
        check_overrun = guard_index_group(impl, poison=ctx.first)
        if step.replays_graph:
            outputs = graphs.replay(step, q)
            ctx.overruns.extend(check_overrun(step.num_actual_tokens))
            outputs["out_eager"] = forward(q, metadata)["out"]  # the same step, eagerly: the bits a replay must give
            if ctx.rerun:
                outputs["out_again"] = graphs.replay(step, q)["out"]
            ctx.notes.setdefault("cudagraph", {"emulated": graphs.emulated})["replayed"] = step.num_actual_tokens
            return outputs
        outputs = forward(q, metadata)
        ctx.overruns.extend(check_overrun(step.num_actual_tokens))
        if ctx.notes.get("mtp_draft") == "update_draft_decode_metadata":  # the bits a build gives the same step
            outputs["out"] = outputs["out"].clone()
            outputs["out_rebuilt"] = forward(q, builder.build(0, common_attn_metadata(step, inp.index, dev)))["out"]
        if ctx.rerun:  # the same step again, on the same metadata and buffers
            outputs["out"] = outputs["out"].clone()
            outputs["out_again"] = forward(q, metadata)["out"]
        return outputs

    def draft_metadata(self, ctx: "StepContext", step, inp):
        """An MTP draft step's metadata as vLLM's speculator makes it (fused multi-step decode): the step
        before's, its runner inputs advanced in place (`seq_lens` + 1 and the new tokens' `slot_mapping`; the
        block table and `query_start_loc` stay), then the builder's `update_draft_decode_metadata`; a builder
        that cannot (`supports_draft_decode_metadata_update` false) is rebuilt, as the speculator falls back."""
        engine = ctx.engine
        cam, builder = engine["cam"], engine["builder"]
        advanced = common_attn_metadata(step, inp.index, self.device)
        cam.seq_lens.copy_(advanced.seq_lens)
        cam.slot_mapping.copy_(advanced.slot_mapping)
        if getattr(builder, "supports_draft_decode_metadata_update", False):  # a release without draft updates lacks it
            builder.update_draft_decode_metadata(engine["metadata"])
            ctx.notes["mtp_draft"] = "update_draft_decode_metadata"
            return engine["metadata"]
        ctx.notes["mtp_draft"] = "rebuilt"
        engine["cam"], engine["metadata"] = advanced, builder.build(0, advanced)
        return engine["metadata"]

    def finish(self, obs, case, slots, cache, before, write_emulated, overruns, guards):
        """What both FlashMLA targets add to an observation after the call: the fp8 entries written (for the
        oracle to read back), stand-ins and shims, overruns, guard regions, and whether the cache changed."""
        if before and case.kv_cache_dtype in ("fp8_ds_mla", "fp8"):
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
        note_guards_and_cache(obs, guards, cache, before)
        return obs


    def repro_spec(self, finding) -> ReproSpec:
        return flashmla_repro(self, finding, layer=False)


def flashmla_repro(target, finding, layer: bool) -> ReproSpec:
    """The step as the finding ran it (its values are drawn on its device: q, the cache as written, the top-k
    buffer, the metadata's inputs, for the layer kv_b_proj's weight and the new tokens' latents), the call the
    target makes on it (`forward_mqa`, or the layer's `forward_impl`), judged against the fp32 reference."""

    if finding.case.earlier or finding.case.cudagraph == "full":
        return flashmla_trace_repro(target, finding, layer)
    case, dev = finding.case, finding.host.device
    cpu = dev == "cpu"
    inputs = materialize_layer_inputs(case, dev) if layer else None
    inp, slots, topk_buffer = step_tensors(case, dev, inputs.attention if layer else materialize_attention_inputs(case, dev))
    cache = target.cache(case, dev)
    target.writer(case)[0](inp.kv_c[slots], inp.k_pe[slots], cache, slots)
    slot_values = None
    if case.kv_cache_dtype != "bfloat16":  # the oracle reads what the fp8 entries hold
        slot_values, _ = judge_cache_entries(case, inp, slots, cache[slots // case.block_size, slots % case.block_size])
    tensors = repro_step(case, inp.index, cache, topk_buffer, dev)
    if layer:
        mha_tokens = int(finding.observation.notes.get("route", {}).get("mha_tokens", 0))
        expected, _ = layer_reference_for(case, inputs, dev, slot_values, mha_tokens)
        atol, rtol = layer_tolerance(case, inputs)
        new = [inp.slot_of[r][req.context_len:] for r, req in enumerate(case.requests)]  # the step's own tokens
        new_slots = (torch.cat(new) if new else torch.zeros(0, dtype=torch.int64)).to(dev)
        tensors.update(q=with_padded_tokens(case, inputs.q), kv_b_weight=inputs.kv_b_weight,
                       kv_c_normed=with_padded_tokens(case, inp.kv_c[new_slots]),
                       k_pe=with_padded_tokens(case, inp.k_pe[new_slots]).unsqueeze(1))
    else:
        expected = reference_for(case, inp, dev, slot_values)[0]
        atol, rtol = attention_tolerance(case, inp)
        tensors["q"] = with_padded_tokens(case, inp.q)
    tensors["expected_out"] = expected
    return ReproSpec(
        about=f"Shrunk case: {case.summary()}; {case.heads} heads, kv_cache_dtype {case.kv_cache_dtype}, values "
              f"{case.values}.\nInputs in tensors.safetensors beside this file; the expected output is attnfuzz's "
              + ("fp32 oracle (after W_UV)." if layer else "fp32 oracle (latent, 512 wide)."),
        imports=("import dataclasses", "import tempfile", "from types import SimpleNamespace"),
        constants=dict(**repro_constants(case), ATOL=atol, RTOL=rtol), tensors=tensors,
        support={"runtime": "fuzzer.support.flashmla_runtime", **(REPRO_CPU_SUPPORT if cpu else {})},
        prepare=(REPRO_CPU_PREPARE + "runtime.cpu_shims()  # no streams on a CPU\n" if cpu else "")
        + repro_backend(target, layer),
        setup=REPRO_SETUP_ANY + repro_case(case) + REPRO_CONFIG + REPRO_CACHE + REPRO_METADATA + ("route = {}\n" if layer else ""),
        call=_LAYER_CALL if layer else _MQA_CALL,
        judge=Judge("attention", dict(out="out", expected='T["expected_out"]', cache="cache", before="before",
                                      atol="ATOL", rtol="RTOL")),
        report=('print("routes:", route, "| stand-ins for ops this host lacks:", ", ".join(emulated) or "none")\n'
                if layer else 'print("stand-ins for ops this host lacks:", ", ".join(emulated) or "none")\n'),
        # On a CPU the interpreter always runs under attnfuzz's checker: besides the bounds checks it broadcasts
        # the 0-d masks the bare interpreter rejects ("mask has unsupported dtype", Trap 4, hit by the remap
        # kernel on FlashMLA's fp8 separate path).
        bounds_checked=cpu)


def flashmla_trace_repro(target, finding, layer: bool) -> ReproSpec:
    """A trace's reproducer: its steps up to the first failing one, on one builder and impl (or layer), one
    cache and one top-k buffer, as the target ran them. Per step it loads what the layer writes to the cache
    (the rows at the step's written slots, as the cache writer wrote them), the indexer's rows and the
    metadata's inputs; the last step is judged against the fp32 reference."""
    case, dev = finding.case, finding.host.device
    cpu = dev == "cpu"
    failing = min((v.step for v in finding.verdicts if v.step), default=len(case.steps))
    steps = case.steps[:failing]
    scratch = target.cache(case, dev)  # the cache as the steps leave it, to read back what each wrote
    write = target.writer(case)[0]
    tensors, constants = {}, []
    for k, step in enumerate(steps, start=1):
        inputs = target.step_inputs(step)
        inp = getattr(inputs, "attention", inputs)
        written = written_slots(step).to(dev)
        write(inp.kv_c[written], inp.k_pe[written], scratch, written)
        step_t = repro_step(step, inp.index, None, inp.index.topk_indices, dev)
        step_t.pop("topk_indices_buffer")
        step_t.update(topk_indices=inp.index.topk_indices, written_slots=written,
                      written_rows=scratch[written // case.block_size, written % case.block_size])
        if layer:
            new = [inp.slot_of[r][req.context_len:] for r, req in enumerate(step.requests)]
            new_slots = (torch.cat(new) if new else torch.zeros(0, dtype=torch.int64)).to(dev)
            step_t.update(q=with_padded_tokens(step, inputs.q), kv_c_normed=with_padded_tokens(step, inp.kv_c[new_slots]),
                          k_pe=with_padded_tokens(step, inp.k_pe[new_slots]).unsqueeze(1))
        else:
            step_t["q"] = with_padded_tokens(step, inp.q)
        tensors.update({f"s{k}.{name}": t for name, t in step_t.items()})
        constants.append({name: value for name, value in repro_constants(step).items()
                          if name in ("NUM_REQS", "NUM_TOKENS", "MAX_QUERY_LEN", "MAX_SEQ_LEN")})
        if case.cudagraph == "full":
            constants[-1]["REPLAY"] = step.replays_graph
        if step.mtp_draft:
            constants[-1]["DRAFT"] = True
    last = steps[-1]
    inputs = target.step_inputs(last)
    inp = getattr(inputs, "attention", inputs)
    slots = step_slots(inp, dev)
    slot_values = None
    if case.kv_cache_dtype != "bfloat16":  # the oracle reads what the fp8 entries hold
        slot_values, _ = judge_cache_entries(last, inp, slots, scratch[slots // case.block_size, slots % case.block_size])
    if layer:
        mha_tokens = int(finding.observation.notes.get("route", {}).get("mha_tokens", 0))
        expected, _ = layer_reference_for(last, inputs, dev, slot_values, mha_tokens)
        atol, rtol = layer_tolerance(last, inputs)
        tensors["kv_b_weight"] = inputs.kv_b_weight
    else:
        expected = reference_for(last, inp, dev, slot_values)[0]
        atol, rtol = attention_tolerance(last, inp)
    tensors["expected_out"] = expected
    graphs = DecodeGraphs(case, dev, MAX_MODEL_LEN) if case.cudagraph == "full" and not layer else None
    drafts = any(s.mtp_draft for s in steps) and not layer
    graph_constants = dict(GRAPH_SIZES=[list(s) for s in graphs.sizes], MAX_REQS=graphs.buffers.seq_lens.shape[0],
                           TABLE_WIDTH=len(case.block_table[0])) if graphs else {}
    return ReproSpec(
        about=f"Shrunk trace of {len(case.steps)} steps, run here up to step {failing}, whose output is judged: "
              + "; ".join(f"step {k}: {s.summary()}" for k, s in enumerate(steps, start=1))
              + f".\n{case.heads} heads, kv_cache_dtype {case.kv_cache_dtype}, values {case.values}. One builder and "
              + ("one layer" if layer else "one impl") + " run every step, on one cache and one top-k buffer, as vLLM's "
              "model runner keeps them." + (" The engine runs full CUDA graphs: captured at start-up from dummy decode "
                                           "batches, replayed for every uniform decode step (REPLAY)." if graphs else "")
              + (" Steps marked DRAFT are MTP draft steps, as vLLM's speculator runs them: on the step before's "
                 "metadata, its inputs advanced in place, then the builder's update_draft_decode_metadata; each is "
                 "also run on metadata built for it." if drafts else "")
              + "\nInputs per step in tensors.safetensors beside this file; the expected output "
              "is attnfuzz's " + ("fp32 oracle (after W_UV)." if layer else "fp32 oracle (latent, 512 wide)."),
        imports=("import dataclasses", "import tempfile", "from types import SimpleNamespace"),
        constants=dict(BLOCK_SIZE=case.block_size, BLOCK_STRIDE_ROWS=case.stride_rows, NUM_BLOCKS=case.pool_blocks,
                       FP8_POISON=case.kv_cache_dtype != "bfloat16", TOPK_ROWS=max(s.num_actual_tokens for s in case.steps) + 8,
                       **graph_constants, STEPS=constants, ATOL=atol, RTOL=rtol),
        tensors=tensors,
        support={"runtime": "fuzzer.support.flashmla_runtime", **({"cudagraphs": "fuzzer.support.cudagraphs"} if graphs else {}),
                 **(REPRO_CPU_SUPPORT if cpu else {})},
        prepare=(REPRO_CPU_PREPARE + "runtime.cpu_shims()  # no streams on a CPU\n" if cpu else "")
        + repro_backend(target, layer),
        setup=REPRO_SETUP_ANY + repro_case(case) + _TRACE_CONFIG + ("route = {}\n" if layer else ""),
        call=_TRACE_CALL.format(engine=_TRACE_LAYER_ENGINE if layer else _TRACE_MQA_ENGINE,
                                capture=_GRAPH_CAPTURE if graphs else "",
                                metadata=_GRAPH_METADATA if graphs else _DRAFT_METADATA if drafts else _TRACE_METADATA,
                                forward=_TRACE_LAYER_FORWARD if layer else _GRAPH_FORWARD if graphs
                                else _DRAFT_FORWARD if drafts else _TRACE_MQA_FORWARD),
        judge=Judge("attention", dict(out="out", expected='T["expected_out"]', cache="cache", before="before",
                                      atol="ATOL", rtol="RTOL")),
        report=('print("routes of the last step:", route, "| stand-ins for ops this host lacks:", ", ".join(emulated) or "none")\n'
                if layer else 'print("stand-ins for ops this host lacks:", ", ".join(emulated) or "none")\n'),
        bounds_checked=cpu)


_TRACE_CONFIG = """\
cfg = runtime.configure(runtime.vllm_runtime(DEVICE, tempfile.mkdtemp()), case, max_num_batched_tokens=TOPK_ROWS)
spec = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                        cache_dtype_str=case.kv_cache_dtype)
width = T["s1.written_rows"].shape[-1]
# Every row poisoned, as the fuzzer's cache: NaN for bf16, 0xFF bytes (fp8 NaN codes, NaN scales) for fp8_ds_mla.
rows = torch.full((NUM_BLOCKS * BLOCK_STRIDE_ROWS, width), 255 if FP8_POISON else float("nan"),
                  dtype=T["s1.written_rows"].dtype, device=DEVICE)
cache = rows.as_strided((NUM_BLOCKS, BLOCK_SIZE, width), (BLOCK_STRIDE_ROWS * width, width, 1))
topk_indices_buffer = torch.full((TOPK_ROWS, case.topk_width), 2**30 - 1, dtype=torch.int32, device=DEVICE)
fields = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
"""

_TRACE_CALL = """\
with set_current_vllm_config(cfg), torch.inference_mode():
{engine}    builder = Backend.get_builder_cls()(spec, [runtime.LAYER], cfg, torch.device(DEVICE))
{capture}    for k, step in enumerate(STEPS, start=1):
        S = {{name.split(".", 1)[1]: t for name, t in T.items() if name.startswith(f"s{{k}}.")}}
        # The layer's cache write: this step's rows, as vLLM's cache writer wrote them.
        slots = S["written_slots"]
        rows[slots // BLOCK_SIZE * BLOCK_STRIDE_ROWS + slots % BLOCK_SIZE] = S["written_rows"]
        # The indexer's rows; its rows past this step's tokens keep what earlier steps left.
        n = S["topk_indices"].shape[0]
        topk_indices_buffer[:n] = S["topk_indices"]
        topk_indices_buffer[n : step["NUM_TOKENS"]] = -1
        before = cache.clone()
{metadata}{forward}"""

_TRACE_METADATA = """\
        cam = CommonAttentionMetadata(**{name: v for name, v in dict(
            query_start_loc=S["query_start_loc"], query_start_loc_cpu=S["query_start_loc"].cpu(),
            seq_lens=S["seq_lens"], seq_lens_cpu=S["seq_lens"].cpu(), seq_lens_cpu_upper_bound=S["seq_lens"].cpu(),
            num_computed_tokens_cpu=S["num_computed_tokens"].cpu(), num_reqs=step["NUM_REQS"],
            num_actual_tokens=step["NUM_TOKENS"], max_query_len=step["MAX_QUERY_LEN"], max_seq_len=step["MAX_SEQ_LEN"],
            block_table_tensor=S["block_table"], slot_mapping=S["slot_mapping"]).items() if name in fields})
        metadata = builder.build(0, cam)
"""
# A trace with MTP draft steps (DRAFT): a draft step runs on the step before's metadata, the runner's inputs
# advanced in place and the builder's update_draft_decode_metadata, as vLLM's speculator runs its drafts.
_DRAFT_METADATA = _TRACE_METADATA.replace("        cam = ", "        fresh = ").replace("""        metadata = builder.build(0, cam)
""", """        if step.get("DRAFT"):
            cam.seq_lens.copy_(fresh.seq_lens)
            cam.slot_mapping.copy_(fresh.slot_mapping)
            builder.update_draft_decode_metadata(metadata)
        else:
            cam, metadata = fresh, builder.build(0, fresh)
""")
# A full-graph engine: every step's inputs go into the runner's persistent buffers, which its metadata views.
_GRAPH_METADATA = """\
        cam = runner.stage(S["query_start_loc"], S["seq_lens"], S["block_table"], S["slot_mapping"],
                           S["num_computed_tokens"], step["NUM_TOKENS"], step["MAX_QUERY_LEN"], step["MAX_SEQ_LEN"])
        metadata = builder.build(0, cam)
"""
_GRAPH_CAPTURE = """\
    # vLLM's runner: persistent step inputs, and a full CUDA graph per uniform decode size, captured before the
    # first step from a dummy batch (null-block rows, slots -1) with build_for_cudagraph_capture's metadata.
    runner = cudagraphs.RunnerBuffers(MAX_REQS, TOPK_ROWS, TABLE_WIDTH, DEVICE)

    def forward(q, metadata):  # (ql_nope | q_pe), as the layer hands it to forward_mqa
        out, lse = impl.forward_mqa((q[..., :512], q[..., 512:]), cache, metadata, None)
        return {"out": out, "lse": lse}

    graphs = {}
    for tokens, query_len in GRAPH_SIZES:
        def capture_metadata(tokens=tokens, query_len=query_len):
            return builder.build_for_cudagraph_capture(runner.stage_capture(tokens, query_len, runtime.MAX_MODEL_LEN))

        static_q = torch.zeros((tokens, case.heads, 576), dtype=torch.bfloat16, device=DEVICE)
        topk_indices_buffer[:tokens] = -1  # the dummy batch's indexer rows
        graph = cudagraphs.FullGraph(lambda md, q=static_q: forward(q, md), capture_metadata, DEVICE)
        graphs[tokens, query_len] = graph, static_q
    topk_indices_buffer.fill_(2**30 - 1)
    if any(graph.emulated for graph, _ in graphs.values()):
        emulated = (*emulated, cudagraphs.EMULATED)
"""
_GRAPH_FORWARD = """\
        check_overrun = runtime.guard_index_group(impl, poison=k == 1)
        if step["REPLAY"]:  # a uniform decode step: its graph replayed, and the same step eagerly for comparison
            graph, static_q = graphs[step["NUM_TOKENS"], step["MAX_QUERY_LEN"]]
            static_q.copy_(S["q"])
            out = graph.replay()["out"]
            eager = forward(S["q"], metadata)["out"]
            if not torch.equal(out.view(torch.uint8), eager.view(torch.uint8)):
                found.append(f"step {k}: replayed from its CUDA graph, it differs from the step run eagerly in "
                             f"{int((out.view(torch.uint8) != eager.view(torch.uint8)).any(dim=-1).any(dim=-1).sum())} "
                             f"of {out.shape[0]} tokens")
        else:
            out = forward(S["q"], metadata)["out"]
        found += [f"step {k}: {m}" for m in check_overrun(step["NUM_TOKENS"])]
"""

_TRACE_MQA_ENGINE = """\
    # topk_indices_buffer= with indexer=None: the index group orders on the compute stream.
    impl = Backend.get_impl_cls()(
        case.heads, 576, runtime.SM_SCALE, 1, None, None, case.kv_cache_dtype, None, "decoder", None,
        **runtime.impl_topk_kwargs(Backend.get_impl_cls(), topk_indices_buffer),
        q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, qk_head_dim=192, v_head_dim=128, kv_b_proj=None)
"""
_TRACE_MQA_FORWARD = """\
        check_overrun = runtime.guard_index_group(impl, poison=k == 1)
        q = S["q"]  # (ql_nope | q_pe), as the layer hands it to forward_mqa
        out, _lse = impl.forward_mqa((q[..., :512], q[..., 512:]), cache, metadata, None)
        found += [f"step {k}: {m}" for m in check_overrun(step["NUM_TOKENS"])]
"""
_DRAFT_FORWARD = _TRACE_MQA_FORWARD + """\
        if step.get("DRAFT"):  # the same step on metadata built for it: the bits the in-place update promises
            out = out.clone()
            rebuilt, _lse = impl.forward_mqa((q[..., :512], q[..., 512:]), cache, builder.build(0, fresh), None)
            if not torch.equal(out.view(torch.uint8), rebuilt.view(torch.uint8)):
                found.append(f"step {k}: the MTP draft step on metadata updated in place (update_draft_decode_metadata) "
                             f"differs from the same step on metadata built for it in "
                             f"{int((out != rebuilt).any(dim=-1).any(dim=-1).sum())} of {out.shape[0]} tokens")
"""
_TRACE_LAYER_ENGINE = """\
    layer = runtime.mla_layer(cfg, case.heads, T["kv_b_weight"], topk_indices_buffer, DEVICE, backend=Backend)
    runtime.record_routes(layer.impl, route)
"""
_TRACE_LAYER_FORWARD = """\
        route.clear()
        check_overrun = runtime.guard_index_group(layer.impl, poison=k == 1)
        out = torch.full((step["NUM_TOKENS"], case.heads * 128), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        # Decode tokens go to forward_mqa, short prefills to dense MHA: vLLM's own split.
        layer.forward_impl(S["q"], S["kv_c_normed"], S["k_pe"], cache, metadata, out)
        found += [f"step {k}: {m}" for m in check_overrun(route.get("mqa_tokens", 0))]
"""


def repro_backend(target, layer: bool) -> str:
    """A reproducer's line that gets vLLM's backend class (`Backend`) and binds the stand-ins it needs here."""
    if layer:
        return (f"Backend, emulated = runtime.sparse_backend({target.vllm_backend!r}, DEVICE)\n"
                "emulated = tuple(dict.fromkeys(emulated + runtime.install_layer_standins(DEVICE)))\n")
    return f"Backend, emulated = runtime.sparse_backend({target.vllm_backend!r}, DEVICE)\n"


# What every FlashMLA reproducer sets up: vLLM's imports, the config the target builds (`Backend` comes from
# `repro_backend`; the DCP reproducer imports FlashMLA's itself).
REPRO_SETUP_ANY = """\
from vllm.config import set_current_vllm_config
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import MLAAttentionSpec

"""
REPRO_SETUP = REPRO_SETUP_ANY.replace("from vllm.v1.kv_cache_interface", f"from {BACKEND_MODULE} import "
                                      "FlashMLASparseBackend as Backend\nfrom vllm.v1.kv_cache_interface")
REPRO_CONFIG = """\
cfg = runtime.configure(runtime.vllm_runtime(DEVICE, tempfile.mkdtemp()), case,
                        max_num_batched_tokens=T["topk_indices_buffer"].shape[0])
spec = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                        cache_dtype_str=case.kv_cache_dtype)
"""

_MQA_CALL = """\
with set_current_vllm_config(cfg), torch.inference_mode():
    metadata = Backend.get_builder_cls()(spec, [runtime.LAYER], cfg, torch.device(DEVICE)).build(0, cam)
    # topk_indices_buffer= with indexer=None: the index group orders on the compute stream.
    impl = Backend.get_impl_cls()(
        case.heads, 576, runtime.SM_SCALE, 1, None, None, case.kv_cache_dtype, None, "decoder", None,
        **runtime.impl_topk_kwargs(Backend.get_impl_cls(), T["topk_indices_buffer"]),
        q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, qk_head_dim=192, v_head_dim=128, kv_b_proj=None)
    check_overrun = runtime.guard_index_group(impl)
    q = T["q"]  # (ql_nope | q_pe), as the layer hands it to forward_mqa
    out, _lse = impl.forward_mqa((q[..., :512], q[..., 512:]), cache, metadata, None)
    found += check_overrun(NUM_TOKENS)
"""

_LAYER_CALL = """\
with set_current_vllm_config(cfg), torch.inference_mode():
    layer = runtime.mla_layer(cfg, case.heads, T["kv_b_weight"], T["topk_indices_buffer"], DEVICE, backend=Backend)
    metadata = Backend.get_builder_cls()(spec, [runtime.LAYER], cfg, torch.device(DEVICE)).build(0, cam)
    runtime.record_routes(layer.impl, route)
    check_overrun = runtime.guard_index_group(layer.impl)
    out = torch.full((NUM_TOKENS, case.heads * 128), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    # Decode tokens go to forward_mqa, short prefills to dense MHA: vLLM's own split.
    layer.forward_impl(T["q"], T["kv_c_normed"], T["k_pe"], cache, metadata, out)
    found += check_overrun(route.get("mqa_tokens", 0))
"""
