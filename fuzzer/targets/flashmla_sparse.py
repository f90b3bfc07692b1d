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
from fuzzer.repro_spec import Call, Judge, ReproSpec, unchecked_unless_memory
from fuzzer.support.cudagraphs import EMULATED as EMULATED_GRAPHS
from fuzzer.support.flashmla_runtime import (
    FP8_ENTRY_BYTES,
    SPARSE_BACKENDS,
    bf16_kernel,
    flashmla_sparse_backend_for,
    fp8_decode,
    fp8_prefill,
    prefill_outputs_under_initcheck,
    q_concat,
)
from fuzzer.support.vllm_setup import (
    MAX_MODEL_LEN,
    configure,
    guard_index_group,
    has_cache_op,
    try_import,
    vllm_runtime,
)
from fuzzer.support.sparse_mla_steps import (
    forward_mqa,
    mla_attention_engine,
    mla_spec,
    poisoned_cache,
    prepare_host,
    prepare_host_for_integer_kernels,
    prepare_layer_host,
    replay_graph_steps,
    replay_layer_steps,
    replay_steps,
    sparse_mla_engine,
    step_config,
    topk_buffer,
    update_draft_metadata,
)
from fuzzer.support.standins.flashmla_ops import concat_and_cache_mla
from fuzzer.targets.base import WHOLE, RunPlan, Target
from fuzzer.targets.guards import Guards
from fuzzer.targets.harness import (
    DecodeGraphs,
    cache_writer,
    common_attn_metadata,
    fill_topk,
    note_guards_and_cache,
    paged_cache,
    repro_constants,
    repro_step,
    step_slots,
    step_tensors,
    topk_buffer_for,
    trace_observation,
    with_padded_tokens,
)
from fuzzer.targets.probes import observe_paths
from fuzzer.targets.vllm_api import remap_api
from oracles.attention_judge import (
    attention_tolerance,
    fp8_query,
    judge_attention,
    judge_cache_entries,
    layer_reference_for,
    layer_tolerance,
    reference_for,
)
from oracles.steps import judge_steps
from strategies.batches import AttentionFeatures, attention_space
from strategies.tensors import HEAD_SIZE, materialize_attention_inputs, written_slots


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
    replays_graphs = True  # full: decode steps captured and replayed (fuzzer/support/cudagraphs.py)
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
            SPARSE_BACKENDS[self.vllm_backend](self.device)
        except Exception as e:
            return f"cannot import vLLM's {self.vllm_backend} backend: {type(e).__name__}: {e}"
        return None

    def prepare(self) -> None:
        self.backend, self.emulated, shims = prepare_host(SPARSE_BACKENDS[self.vllm_backend], self.device)
        self.shims = [*shims, *prefill_outputs_under_initcheck(self.device)]
        self.real_parts = self.real_parts_here()
        self.cfg = self.runtime(str(STATE_DIR))
        self.block_stride_rows = remap_api().has_block_stride_rows

    def real_parts_here(self) -> tuple[str, ...]:
        """What of vLLM really ran, as this release and host have it (every result lists it)."""

        parts = [p for p in type(self).real_parts if p != "SparseMLAIndexGroup"
                 or try_import("vllm.v1.attention.backends.mla.index_group") is not None]
        if self.device == "cuda":  # the compiled FlashMLA extension; on a CPU its kernels are stand-ins (emulated)
            parts.append("FlashMLA's CUDA kernels (vllm._flashmla_C)")
        return tuple(parts)

    def runtime(self, state_dir: str):
        """vLLM's config and process groups for this process (one rank of its own)."""
        return vllm_runtime(self.device, state_dir)

    def has_block_stride_rows(self) -> bool:
        """As prepare() (or, in a campaign's parent, the worker's prepare()) read it; else from the release."""
        return self.block_stride_rows if self.block_stride_rows is not None else remap_api().has_block_stride_rows

    def cases(self, profile, plan: RunPlan = WHOLE):
        return attention_space(profile, AttentionFeatures(kv_cache_dtypes=plan.kv_dtypes(self), block_sizes=(64, 128),
                                                          block_stride_rows=self.has_block_stride_rows(),
                                                          cudagraph_padding=True, traces=True,
                                                          cudagraph_modes=plan.graph_modes(self),
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
        return trace_observation(observed)

    def query_fp8_scale(self, case) -> float | None:
        """The layer's q_scale where MLAAttention hands forward_mqa a quantized query (the oracle then judges against
        attention over that query); None: it hands the query as it is."""
        return None

    def kv_cache_spec(self, case, cfg):
        """The layer's KV-cache spec as the builder gets it."""
        return mla_spec(case.block_size, case.kv_cache_dtype)

    def step_inputs(self, step):
        return materialize_attention_inputs(step, self.device)

    def new_engine(self, ctx: "StepContext", step) -> None:
        """The objects vLLM's runner keeps for the engine's life, in `ctx.engine`: the metadata builder, the impl and
        (`layer`) what the layer hands forward_mqa as itself (None: FlashMLA reads nothing of it)."""
        engine = ctx.engine
        engine["builder"], engine["impl"] = sparse_mla_engine(self.backend, ctx.spec, ctx.cfg, step.heads,
                                                              step.kv_cache_dtype, ctx.topk_buffer, self.device)
        engine["layer"] = None

    def mqa_step(self, ctx: "StepContext", step, inp):
        """One step through FlashMLASparseImpl.forward_mqa (every token), on the engine's builder and impl; in a
        full-graph engine a uniform decode step is replayed from the graph captured at start-up, and run
        eagerly on the same metadata too (`out_eager`)."""
        dev, engine = self.device, ctx.engine
        if not engine:
            self.new_engine(ctx, step)
        impl, builder, layer = engine["impl"], engine["builder"], engine["layer"]

        def forward(q, metadata):
            out, lse = forward_mqa(impl, q, ctx.cache, metadata, layer)
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
        advanced = common_attn_metadata(step, inp.index, self.device)
        engine["cam"], engine["metadata"], ctx.notes["mtp_draft"] = update_draft_metadata(
            engine["builder"], engine["cam"], engine["metadata"], advanced)
        return engine["metadata"]

    def finish(self, obs, case, slots, cache, before, write_emulated, overruns, guards):
        """What both FlashMLA targets add to an observation after the call: the fp8 entries written (for the
        oracle to read back), stand-ins and shims, overruns, guard regions, and whether the cache changed."""
        if before and case.kv_cache_dtype in ("fp8_ds_mla", "fp8", "nvfp4_ds_mla"):
            obs.outputs["cache_slots"] = slots  # on the device: the worker's oracle reads them back there
            obs.outputs["cache_entries"] = before[0][slots // case.block_size, slots % case.block_size]
        out = obs.outputs.get("out")
        if case.padded_tokens and out is not None and out.shape[0] == case.num_actual_tokens:
            # the reference covers the requests' tokens; the padding tokens' rows are judged finite (padded_rows)
            obs.outputs["out"], obs.outputs["out_padded"] = out[: case.num_tokens], out[case.num_tokens:]
            obs.notes["padded_tokens"] = case.padded_tokens
        obs.emulated = tuple(dict.fromkeys(x for x in (*self.emulated, write_emulated) if x))  # each op once
        obs.notes["shims"] = self.shims
        if overruns:
            obs.notes["buffer_overrun"] = overruns
        note_guards_and_cache(obs, guards, cache, before)
        return obs


    def repro_spec(self, finding) -> ReproSpec:
        """The step's reproducer; a finding that is not a memory one runs vLLM's interpreted kernels without the bounds
        checker (the layer's keeps it: its dense-MHA kernels' scalar masks need the checker's correction)."""
        return unchecked_unless_memory(flashmla_repro(self, finding, layer=False), finding,
                                       "the stand-ins check their own accesses")

    # The reproducer's calls that differ between the backends of this family (flashmla_repro makes the rest).
    def repro_prepare(self, layer: bool, case=None) -> tuple[Call, ...]:
        """What prepare() ran: the host prepared for this backend (its loader passed: the reproducer carries this
        backend's stand-ins only; FLASHMLA_SPARSE's, those of `case`'s path: `standin_paths`) and, in a GPU
        reproducer, FlashMLA's outputs prefilled under initcheck (a CPU one's DEVICE never takes that path)."""
        load = dict(load_backend=SPARSE_BACKENDS[self.vllm_backend])
        prepare = prepare_layer_host if layer else prepare_host
        if self.vllm_backend == "FLASHMLA_SPARSE" and case is not None:
            load = dict(load_backend=flashmla_sparse_backend_for, paths=standin_paths(case))
            if not layer:  # its Triton kernels are the index remap's: no interpreter correction reaches them
                prepare = prepare_host_for_integer_kernels
        host = Call(prepare, dict(load, device="DEVICE"), assign="backend, emulated, shims")
        if self.device == "cpu":
            return (host,)
        return host, Call(prefill_outputs_under_initcheck, dict(device="DEVICE"),
                          note="under compute-sanitizer initcheck only (ATTNFUZZ_SANITIZER=initcheck): "
                               "FlashMLA's outputs filled with NaN first")

    def repro_spec_call(self) -> Call:
        return Call(mla_spec, dict(block_size="BLOCK_SIZE", kv_cache_dtype="KV_CACHE_DTYPE"), assign="spec")

    def repro_engine(self, case, layer: bool) -> Call:
        if layer:
            return Call(mla_attention_engine, dict(backend="backend", spec="spec", cfg="cfg", heads="HEADS",
                                                   kv_b_weight='T["kv_b_weight"]', topk_indices_buffer="topk_indices_buffer",
                                                   device="DEVICE"), assign="builder, layer, route")
        return Call(sparse_mla_engine, dict(backend="backend", spec="spec", cfg="cfg", heads="HEADS",
                                            kv_cache_dtype="KV_CACHE_DTYPE", topk_indices_buffer="topk_indices_buffer",
                                            device="DEVICE"), assign="builder, impl")


def standin_paths(case) -> tuple:
    """The paths of flashmla_sparse that call compiled ops in `case` (flashmla_runtime's path functions), decided from
    the case: the query's concatenation (forward_mqa is handed (ql_nope, q_pe), as MLAAttention hands it), then a bf16
    cache's kernel, or a quantized cache's decode and, where a request has more than one new token (a prefill, the
    separate path's), its upconverting gather and bf16 kernel."""
    quantized = case.kv_cache_dtype != "bfloat16"
    prefill = any(r.query_len > 1 for step in case.steps for r in step.requests)
    if not quantized:
        return q_concat, bf16_kernel
    return (q_concat, fp8_decode, fp8_prefill) if prefill else (q_concat, fp8_decode)


def flashmla_repro(target, finding, layer: bool) -> ReproSpec:
    """The trace as the finding ran it, up to its first failing step (one step: a trace of one). Per step it saves
    what the layer writes to the cache (the rows at the step's written slots, as the cache writer wrote them),
    the indexer's rows, the metadata's inputs and q (the layer's: q, kv_c_normed, k_pe, and kv_b_proj's weight);
    the reproducer runs them through the calls the target makes (`fuzzer.support.sparse_mla_steps`), and judges
    the last step against the fp32 reference."""
    case, dev = finding.case, finding.host.device
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
        step_t.update(topk_indices=inp.index.topk_indices, written_slots=written, q=with_padded_tokens(step, inputs.q),
                      written_rows=scratch[written // case.block_size, written % case.block_size])
        if layer:
            new = [inp.slot_of[r][req.context_len:] for r, req in enumerate(step.requests)]
            new_slots = (torch.cat(new) if new else torch.zeros(0, dtype=torch.int64)).to(dev)
            step_t.update(kv_c_normed=with_padded_tokens(step, inp.kv_c[new_slots]),
                          k_pe=with_padded_tokens(step, inp.k_pe[new_slots]).unsqueeze(1))
        tensors.update({f"s{k}.{name}": t for name, t in step_t.items()})
        constants.append({name: value for name, value in repro_constants(step).items()
                          if name in ("NUM_TOKENS", "MAX_QUERY_LEN", "MAX_SEQ_LEN")})
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
        expected = reference_for(last, inp, dev, slot_values, q=fp8_query(inp.q, target.query_fp8_scale(last)))[0]
        atol, rtol = attention_tolerance(last, inp)
    tensors["expected_out"] = expected
    graphs = DecodeGraphs(case, dev, MAX_MODEL_LEN) if case.cudagraph == "full" and not layer else None
    drafts = any(s.mtp_draft for s in steps) and not layer
    engine = target.repro_engine(case, layer)
    replay = dict(builder="builder", cfg="cfg", steps="STEPS", T="T", rows="rows", cache="cache",
                  topk_indices_buffer="topk_indices_buffer", block_size="BLOCK_SIZE",
                  block_stride_rows="BLOCK_STRIDE_ROWS", device="DEVICE", found="found")
    forward_layer = {"layer": "layer"} if "layer" in engine.assign.split(", ") else {}  # what forward_mqa is handed
    if layer:
        call = Call(replay_layer_steps, dict(replay, layer="layer", route="route"), assign="out, before")
    elif graphs:
        call = Call(replay_graph_steps, dict(replay, impl="impl", graph_sizes="GRAPH_SIZES", max_reqs="MAX_REQS",
                                             table_width="TABLE_WIDTH", **forward_layer),
                    assign="out, before, cuda_graphs")
    else:
        call = Call(replay_steps, dict(replay, impl="impl", **forward_layer), assign="out, before")
    return ReproSpec(
        about=(f"Shrunk trace of {len(case.steps)} steps, run here up to step {failing}, whose output is judged: "
               if len(case.steps) > 1 else "Shrunk case: ")
              + "; ".join(f"step {k}: {s.summary()}" if len(case.steps) > 1 else s.summary()
                          for k, s in enumerate(steps, start=1))
              + f".\n{case.heads} heads, kv_cache_dtype {case.kv_cache_dtype}, values {case.values}. One builder and "
              + ("one layer" if layer else "one impl") + " run every step, on one cache and one top-k buffer, as vLLM's "
              "model runner keeps them." + (" The engine runs full CUDA graphs: captured at start-up from dummy decode "
                                           "batches, replayed for every uniform decode step (REPLAY)." if graphs else "")
              + (" Steps marked DRAFT are MTP draft steps, as vLLM's speculator runs them: on the step before's "
                 "metadata, its inputs advanced in place, then the builder's update_draft_decode_metadata; each is "
                 "also run on metadata built for it." if drafts else "")
              + "\nInputs per step in tensors.safetensors beside this file; the expected output "
              "is attnfuzz's " + ("fp32 oracle (after W_UV)." if layer else "fp32 oracle (latent, 512 wide)."),
        constants=dict(BLOCK_SIZE=case.block_size, BLOCK_STRIDE_ROWS=case.stride_rows, NUM_BLOCKS=case.pool_blocks,
                       HEADS=case.heads, KV_CACHE_DTYPE=case.kv_cache_dtype, TOPK_WIDTH=case.topk_width,
                       TOPK_ROWS=max(s.num_actual_tokens for s in case.steps) + 8,
                       **(dict(GRAPH_SIZES=[list(s) for s in graphs.sizes], MAX_REQS=graphs.buffers.seq_lens.shape[0],
                               TABLE_WIDTH=len(case.block_table[0])) if graphs else {}),
                       STEPS=constants, ATOL=atol, RTOL=rtol),
        tensors=tensors,
        prepare=target.repro_prepare(layer, case),
        setup=(Call(step_config, dict(device="DEVICE", heads="HEADS", topk_width="TOPK_WIDTH",
                                      kv_cache_dtype="KV_CACHE_DTYPE", block_size="BLOCK_SIZE",
                                      max_num_batched_tokens="TOPK_ROWS"), assign="cfg"),
               target.repro_spec_call(),
               Call(poisoned_cache, dict(T="T", num_blocks="NUM_BLOCKS", block_size="BLOCK_SIZE",
                                         block_stride_rows="BLOCK_STRIDE_ROWS",
                                         fp8=repr(case.kv_cache_dtype != "bfloat16"), device="DEVICE"),
                    assign="rows, cache", note="every row poisoned, as the fuzzer's cache"),
               Call(topk_buffer, dict(rows="TOPK_ROWS", topk_width="TOPK_WIDTH", device="DEVICE"),
                    assign="topk_indices_buffer")),
        call=(engine, call),
        judge=Judge("attention", dict(out="out", expected='T["expected_out"]', cache="cache", before="before",
                                      atol="ATOL", rtol="RTOL")),
        report={**({"routes of the last step:": "route"} if layer else {}),
                "stand-ins for ops this host lacks:": '", ".join(emulated) or "none"',
                **({"CUDA graphs:": "cuda_graphs"} if graphs else {})},
        bounds_checked=dev == "cpu")
