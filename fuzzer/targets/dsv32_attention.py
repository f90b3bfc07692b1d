"""`vllm.dsv32.attention`: DeepSeek-V3.2 / GLM-5's attention module (`DeepseekV32Attention`) whole, its indexer feeding
its sparse MLA on FLASHMLA_SPARSE, over the steps of a trace.

One engine for the trace, as vLLM's model runner keeps it: the module's layer (vLLM's `DeepseekV32Indexer` inside it),
the indexer's `DeepseekV32IndexerMetadataBuilder` and FLASHMLA_SPARSE's builder, the index and MLA caches, the
persistent `topk_indices_buffer` and the index group over it; optionally a second layer with no indexer of its own
(skip_topk) that attends with the first's top-k through the same index group. Each step runs the module's own seam,
`_sparse_indexer_and_attn` (`fuzzer.support.dsv32_runtime`): the indexer op (its dense-MHA skip included), then the
layer's split (decodes through W_UK to `forward_mqa` over the indexer's rows, short prefills to dense MHA) and W_UV.

Judged stage by stage (`oracles/dsv32.py`): the indexer as `vllm.indexer` judges it, from the index cache's bytes;
attention against the dense fp32 reference over the top-k rows vLLM's indexer left in the buffer (a dense-MHA token
over its whole causal window); padding tokens' rows finite; a token whose route and top-k row disagree (class F).
"""

from __future__ import annotations

import contextlib
import importlib

import torch

from fuzzer.support import cudagraphs, dsv32_runtime
from fuzzer.support.dsv32_runtime import SKIP_TOPK_LAYER, clear_topk_rows, dsv32_layer, index_group_builder, module_step
from fuzzer.support.flashmla_runtime import record_routes
from fuzzer.support.vllm_setup import LAYER, guard_index_group, standins_forced
from fuzzer.support.indexer_runtime import (
    Sm90View,
    indexer_builder,
    indexer_layer,
    logits_budget,
    prepare_indexer_host,
    write_index_keys,
)
from fuzzer.support.sparse_mla_steps import (
    metadata_builder,
    release_builder,
    release_layers,
    uninitialized_memory_as_nan,
)
from fuzzer.targets.base import WHOLE, RunPlan
from fuzzer.targets.flashmla_layer import FlashMLASparseLayer
from fuzzer.targets.harness import DecodeGraphs, index_trace_step, paged_cache, trace_observation, with_padded_tokens
from fuzzer.targets.indexer import REAL_KERNELS, Indexer, engine_buffers
from fuzzer.targets.probes import observe_paths
from oracles.dsv32 import judge_dsv32
from oracles.steps import judge_steps
from strategies.indexer_batches import attention_module_space
from strategies.indexer_tensors import attention_view, materialize_indexer_inputs
from strategies.tensors import materialize_layer_inputs, written_slots

EMULATED = ("fused_norm_rope's side effects before the seam: the MLA cache write (concat_and_cache_mla), the index "
            "K-cache write (indexer_k_quant_and_cache) and the top-k rows cleared to -1; the projections, norms, "
            "RoPE and fused_q before it (the step hands the seam their outputs)",)


class Dsv32Attention(FlashMLASparseLayer):
    name = "vllm.dsv32.attention"
    summary = ("DeepSeek-V3.2/GLM-5 attention module (DeepseekV32Attention._sparse_indexer_and_attn): the real "
               "indexer feeding FLASHMLA_SPARSE, dense-MHA split, skip_topk layers, traces")
    bug_classes = "A C D F H I O"
    oracle = staticmethod(judge_steps(judge_dsv32))
    real_parts = ("DeepseekV32Attention._sparse_indexer_and_attn (the indexer/attention seam, dense-MHA split, W_UV)",
                  "DeepseekV32Indexer", "DeepseekV32IndexerMetadataBuilder", "sparse_attn_indexer (the op)",
                  "SparseIndexerTopk", "vLLM's wrappers of DeepGEMM", "FlashMLASparseMetadataBuilder",
                  "FlashMLASparseImpl.forward_mqa / forward_mha", "SparseMLAIndexGroup (shared by the layers)",
                  "the index-remap Triton kernel", "CPU_SDPA_MLA prefill backend",
                  "pack_seq_triton / unpack_seq_triton, as_fp32_logits and the builders' Triton kernels")
    kv_cache_dtypes = ("bfloat16",)  # the MLA cache's; the index cache is always fp8 with ue8m0 scales
    # full: the steps' padded decode batches under FULL's runtime mode; on a CUDA device the module's seam (both
    # layers, the indexer in it) is captured at start-up and every uniform decode step replayed (`ModuleGraphs`), as
    # vLLM's runner runs FULL_DECODE_ONLY; on a CPU they run eagerly under FULL's mode (no graphs to capture).
    cudagraph_modes = ("none", "full")
    replays_graphs = False  # a CPU run replays nothing (so a backend's known graph-replay bug is not taken as met)
    outputs_stay_on_device = True

    def unavailable(self) -> str | None:
        return super().unavailable() or Indexer(self.device).unavailable()

    def prepare(self) -> None:
        super().prepare()
        emulated, overrides = prepare_indexer_host(self.device, standins_forced())
        attention = importlib.import_module(dsv32_runtime.V32_ATTENTION)
        if self.device == "cpu":  # its __init__ turns the indexer's dense-MHA skip on for CUDA only
            if not isinstance(attention.current_platform, Sm90View):
                attention.current_platform = Sm90View(attention.current_platform)
            overrides = (*overrides, f"current_platform of {attention.__name__}: an SM90 CUDA platform (Sm90View)",
                         *dsv32_runtime.cpu_capture_query())
        real = [p for p, names in REAL_KERNELS if not set(names) & set(emulated)]
        # the backend's compiled kernels where the host runs them (what the backend's prepare added to its parts)
        compiled = [p for p in self.real_parts if p not in type(self).real_parts and "prefill backend" not in p]
        self.real_parts = (*type(self).real_parts, *real, *compiled)
        self.emulated = tuple(dict.fromkeys((*self.emulated, *emulated)))
        self.shims = (*self.shims, *overrides)

    def cases(self, profile, plan: RunPlan = WHOLE):
        return attention_module_space(profile, profile.attn_heads, plan.graph_modes(self))

    def captures_graphs(self) -> bool:
        """Whether a full-graph engine captures and replays CUDA graphs: on a CUDA device (a CPU runs FULL steps
        eagerly; tests call the emulated capture of `cudagraphs.FullGraph` by answering True there)."""
        return torch.device(self.device).type == "cuda"

    run = Indexer.run  # the trace under the SMs its case schedules for DeepGEMM's paged logits

    def run_trace(self, case):
        dev = self.device
        steps = case.steps
        x = case.indexer
        pool, index_kv, topk_buffer, cfg = engine_buffers(case, dev)
        cfg.model_config.get_num_attention_heads = lambda parallel_config=None: x.attention_heads  # the MLA heads
        views = [attention_view(case, layer) for layer in range(2 if x.skip_topk_layer else 1)]
        caches = [paged_cache(v, dev) for v in views]
        write, write_emulated = self.writer(views[0])
        emulated = tuple(dict.fromkeys(e for e in (*self.emulated, write_emulated, *EMULATED) if e))
        index_written = torch.zeros(pool.shape[0], dtype=torch.bool, device=dev)
        engine: dict = {}
        graphs = (ModuleGraphs(case, dev, cfg.model_config.max_model_len)
                  if case.cudagraph == "full" and self.captures_graphs() else None)
        observed = []
        with engines_ended([engine]):
            for k, step in enumerate(steps):
                inp = materialize_indexer_inputs(step, pool)
                # the context no earlier step of the engine wrote
                fresh = inp.context_slots[~index_written[inp.context_slots]]
                layer_steps = [v.steps[k] for v in views]
                layer_inputs = [materialize_layer_inputs(s, dev) for s in layer_steps]

                def call(step=step, inp=inp, fresh=fresh, layer_steps=layer_steps, layer_inputs=layer_inputs,
                         first=k == 0):
                    from vllm.config import set_current_vllm_config

                    if not engine:
                        self.new_engine(engine, cfg, case, layer_inputs, topk_buffer, index_kv, caches)
                    with set_current_vllm_config(cfg), torch.inference_mode(), \
                            logits_budget(step.indexer.max_logits_mb), uninitialized_memory_as_nan():
                        return self.module_step(engine, cfg, step, inp, pool[fresh], fresh, layer_steps, layer_inputs,
                                                topk_buffer, index_kv, caches, write, first, graphs)

                obs = self.observe_step(call, lambda: engine.get("routes", []))
                if graphs is not None and graphs.cudagraph:
                    obs.notes["cudagraph"] = dict(graphs.cudagraph)
                    graphs.cudagraph.pop("replayed", None)
                step_emulated = (*emulated, cudagraphs.EMULATED) if graphs is not None and graphs.emulated else emulated
                if index_trace_step(observed, obs, step, inp, index_written, step_emulated, self.shims):
                    break
        return trace_observation(observed)

    def observe_step(self, call, routes, notes: dict | None = None):
        """A step's observation: `call()` returns (outputs, index-group overruns, MLA cache rows the attention changed);
        the overruns and changed rows go into the notes, with the first layer's route counts (`routes()`: the
        engine's counters, filled by the call) and the routes of every layer."""
        result: list = []
        obs = observe_paths(self.observe, lambda: _keep(result, call()), notes=notes)
        if result:
            _, overruns, changed = result[0]
            if overruns:
                obs.notes["buffer_overrun"] = overruns
            if any(changed):
                obs.notes["cache_changed"] = f"MLA cache rows changed by attention: {changed}"
        counts = routes()
        obs.notes["route"] = dict(counts[0]) if counts else {}
        obs.notes["layer_routes"] = self.routes
        return obs

    def module_step(self, engine, cfg, step, inp, fresh_keys, fresh, layer_steps, layer_inputs, topk_buffer, index_kv,
                    caches, write, first: bool, graphs: "ModuleGraphs | None" = None):
        """One step: the caches and the top-k buffer as the model's fused_norm_rope leaves them before the seam,
        both builders' metadata from the step's CommonAttentionMetadata, then each layer's `_sparse_indexer_and_attn`.
        A full-graph engine (`graphs`) captures its decode graphs before its first step, stages every step's inputs
        in the runner's buffers, and replays a uniform decode step from its graph, then runs it eagerly on the same
        metadata (`out_eager`: the bits the replay must give). Returns (outputs, index-group overruns, MLA cache rows
        the attention changed per layer)."""
        dev = self.device
        if graphs is not None and first and graphs.sizes:  # the runner captures before its first step
            graphs.capture(engine, cfg, layer_inputs, inp, topk_buffer)
        real = inp.slots >= 0
        write_index_keys(fresh_keys, index_kv, fresh)  # what earlier steps (or a prefix-cache hit) left there
        write_index_keys(inp.k[real], index_kv, inp.slots[real])
        for s, li, cache in zip(layer_steps, layer_inputs, caches):
            w = written_slots(s).to(dev)
            write(li.attention.kv_c[w], li.attention.k_pe[w], cache, w)
        clear_topk_rows(topk_buffer, step.num_actual_tokens)
        before = topk_buffer.clone()
        cache_before = [c.clone() for c in caches]
        for route in engine["routes"]:
            route.clear()
            route.update(mqa_tokens=0, mha_tokens=0)
        check_overrun = guard_index_group(engine["layers"][0].impl, poison=first)
        common = Indexer.common_metadata(step, inp, dev)
        if graphs is not None:
            common = graphs.stage(step, common)
        indexer_md = engine["indexer_builder"].build(0, common)
        mla_md = engine["mla_builder"].build(0, common)
        inputs = {**module_inputs(layer_steps, layer_inputs, dev), "q_fp8": inp.q_fp8, "weights": inp.weights,
                  "positions": inp.positions}

        def eager():
            outs = []
            for i, layer in enumerate(engine["layers"]):
                outs += module_step(cfg, [layer], indexer_md, mla_md, inputs[f"q{i}"], inputs[f"kv_c{i}"],
                                    inputs[f"k_pe{i}"], inp.q_fp8, inp.weights, inp.positions, common.slot_mapping,
                                    step.cudagraph)
            return outs

        out: dict = {}
        if graphs is not None and graphs.replays(step):
            replayed = graphs.replay(step, inputs)
            outs = [replayed[name] for name in LAYER_OUTPUTS if name in replayed]
            out["topk_indices_buffer"] = topk_buffer.clone()  # as the replay left it
            for route in engine["routes"]:  # the eager run's counts (a replay runs no Python on a GPU)
                route.clear()
                route.update(mqa_tokens=0, mha_tokens=0)
            clear_topk_rows(topk_buffer, step.num_actual_tokens)  # as fused_norm_rope leaves them before the seam
            out["out_eager"] = eager()[0][: step.num_tokens].clone()
            out["topk_eager"] = topk_buffer.clone()  # its own rows: the top-k kernels promise no order (oracles/steps)
        else:
            outs = eager()
        overruns = check_overrun(engine["routes"][0]["mqa_tokens"])
        n = step.num_tokens
        out = {"topk_indices_buffer": topk_buffer.clone(), **out, "topk_before": before,
               "index_cache": index_kv.clone()}
        for name, o in zip(LAYER_OUTPUTS, outs):
            out[name], out[name + "_padded"] = o[:n].clone(), o[n:].clone()
        changed = [int((c.view(torch.uint8) != b.view(torch.uint8)).any(dim=-1).sum()) for c, b in zip(caches, cache_before)]
        return out, overruns, changed

    def new_engine(self, engine: dict, cfg, case, layer_inputs, topk_buffer, index_kv, caches) -> None:
        """What the runner keeps for the engine's life: the indexer module and its builder, the attention layers
        (the first with the indexer, a skip_topk one after it) over one index group, FLASHMLA_SPARSE's builder."""
        from vllm.config import set_current_vllm_config

        dev = self.device
        indexer = indexer_layer(cfg, topk_buffer, index_kv)
        group = index_group_builder(cfg, topk_buffer)
        layers, routes = [], []
        with set_current_vllm_config(cfg), torch.inference_mode():
            for i, li in enumerate(layer_inputs):
                layer = dsv32_layer(cfg, case.indexer.attention_heads, li.kv_b_weight, topk_buffer,
                                    indexer if i == 0 else None, group, dev, prefix=LAYER if i == 0 else SKIP_TOPK_LAYER,
                                    backend=self.backend)
                layer.kv_cache = caches[i]
                route: dict = {}
                record_routes(layer.impl, route)
                layers.append(layer)
                routes.append(route)
            engine["mla_builder"] = self.mla_metadata_builder(case, cfg)
        engine["indexer_builder"] = indexer_builder(cfg, indexer, dev, len(case.block_table[0]))
        engine["layers"], engine["routes"] = layers, routes

    def mla_metadata_builder(self, case, cfg):
        """The attention backend's metadata builder, made after the layers (it reads the first from the forward
        context). A subclass on another backend names it in `vllm_backend` and, where needed, overrides this."""
        return metadata_builder(self.backend, self.kv_cache_spec(case, cfg), cfg, self.device)

    def repro_spec(self, finding):
        return None  # a standalone reproducer of the module: not yet


LAYER_OUTPUTS = ("out", "out_skip_topk")  # the indexer's layer, the skip_topk layer after it


def module_inputs(layer_steps, layer_inputs, device) -> dict[str, torch.Tensor]:
    """What the seam takes for a step, one row per token, CUDA-graph padding tokens included: each layer's q after
    RoPE and its new tokens' latent (`q<i>`, `kv_c<i>`, `k_pe<i>`)."""
    values = {}
    for i, (s, li) in enumerate(zip(layer_steps, layer_inputs)):
        new = torch.cat([li.attention.slot_of[r][req.context_len:] for r, req in enumerate(s.requests)]).to(device)
        values[f"q{i}"] = with_padded_tokens(s, li.q)
        values[f"kv_c{i}"] = with_padded_tokens(s, li.attention.kv_c[new])
        values[f"k_pe{i}"] = with_padded_tokens(s, li.attention.k_pe[new])
    return values


class ModuleGraphs:
    """A full-graph engine of the module, as vLLM's runner keeps one under FULL_DECODE_ONLY: the runner's persistent
    inputs (every step's CommonAttentionMetadata views them), and per uniform decode size one CUDA graph of the
    module's seam (both layers; the indexer, the index group's conversion, forward_mqa, W_UV: what vLLM captures of
    `_sparse_indexer_and_attn` under FULL's runtime mode, `eager_break_during_capture` running it inside the graph),
    captured at start-up from a dummy decode batch whose metadata both builders make with
    `build_for_cudagraph_capture`, over static inputs each replay refills in place (q, the latent, the indexer's
    queries and head weights, the positions). Captured only where both builders take uniform decode batches
    (`get_cudagraph_support` at least UNIFORM_BATCH), as vLLM's dispatcher decides."""

    def __init__(self, case, device, max_model_len: int):
        self.runner = DecodeGraphs(case, device, max_model_len)  # the capture sizes and the runner's buffers
        self.sizes, self.device, self.max_model_len = self.runner.sizes, device, max_model_len
        self.graphs: dict = {}
        self.cudagraph: dict = {}  # what notes["cudagraph"] reports: support, captured sizes, emulated, replayed

    @property
    def emulated(self) -> bool:
        return any(g.emulated for g, _ in self.graphs.values())

    def stage(self, step, common):
        """The step's CommonAttentionMetadata over the runner's buffers (its inputs copied in place)."""
        return self.runner.buffers.stage(
            common.query_start_loc, common.seq_lens, common.block_table_tensor, common.slot_mapping,
            torch.tensor([r.context_len for r in step.requests], dtype=torch.int32), common.num_actual_tokens,
            common.max_query_len, common.max_seq_len)

    def capture(self, engine: dict, cfg, layer_inputs, inp, topk_buffer) -> None:
        from vllm.v1.attention.backend import AttentionCGSupport

        builders = (engine["indexer_builder"], engine["mla_builder"])
        support = min((type(b).get_cudagraph_support(cfg, b.kv_cache_spec) for b in builders), key=lambda c: c.value)
        self.cudagraph["support"] = support.name
        if support.value < AttentionCGSupport.UNIFORM_BATCH.value:
            self.sizes = []  # vLLM's runner captures no FULL graph of these decode batches: they run eagerly
            return
        buffers = self.runner.buffers
        before = topk_buffer.clone()
        for tokens, query_len in self.sizes:
            statics = {f"{k}{i}": t.new_zeros((tokens, *t.shape[1:]))
                       for i, li in enumerate(layer_inputs)
                       for k, t in (("q", li.q), ("kv_c", li.attention.kv_c), ("k_pe", li.attention.k_pe))}
            statics.update(q_fp8=inp.q_fp8.new_zeros((tokens, *inp.q_fp8.shape[1:])),
                           weights=inp.weights.new_zeros((tokens, *inp.weights.shape[1:])),
                           positions=inp.positions.new_zeros((tokens,)))

            def forward(metadata, statics=statics, tokens=tokens):
                indexer_md, mla_md = metadata
                clear_topk_rows(topk_buffer, tokens)  # fused_norm_rope's, inside the graph as in vLLM's
                outs = []
                for i, layer in enumerate(engine["layers"]):
                    outs += module_step(cfg, [layer], indexer_md, mla_md, statics[f"q{i}"], statics[f"kv_c{i}"],
                                        statics[f"k_pe{i}"], statics["q_fp8"], statics["weights"],
                                        statics["positions"], buffers.slot_mapping[:tokens], "full")
                return dict(zip(LAYER_OUTPUTS, outs))

            def build(tokens=tokens, query_len=query_len):
                common = buffers.stage_capture(tokens, query_len, self.max_model_len)
                return tuple(b.build_for_cudagraph_capture(common) for b in builders)

            self.graphs[(tokens, query_len)] = cudagraphs.FullGraph(forward, build, self.device), statics
        topk_buffer.copy_(before)
        self.cudagraph.update(captured=[list(s) for s in self.sizes], emulated=self.emulated)

    def replays(self, step) -> bool:
        """Whether the step is replayed: a uniform decode batch of a size captured (vLLM's dispatcher)."""
        return step.replays_graph and (step.num_actual_tokens, max(r.query_len for r in step.requests)) in self.graphs

    def replay(self, step, inputs: dict) -> dict[str, torch.Tensor]:
        """The step replayed from its graph: its inputs copied into the graph's static ones."""
        graph, statics = self.graphs[(step.num_actual_tokens, max(r.query_len for r in step.requests))]
        for name, t in statics.items():
            t.copy_(inputs[name])
        self.cudagraph["replayed"] = step.num_actual_tokens
        return graph.replay()


@contextlib.contextmanager
def engines_ended(engines: list[dict]):
    """The engines end with the block (a trace's): their metadata builders and layers are released
    (`release_builder`, `release_layers`), so that nothing of them waits for Python's cyclic collector."""
    try:
        yield
    finally:
        for engine in engines:
            if "mla_builder" in engine:
                release_builder(engine["mla_builder"])
            release_layers(*engine.get("layers", ()))


def _keep(result: list, value):
    """call() returns (outputs, overruns, cache rows changed); observe() keeps the outputs, the rest is noted."""
    result.append(value)
    return value[0]

