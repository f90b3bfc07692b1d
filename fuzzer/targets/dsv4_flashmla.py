"""`vllm.dsv4.flashmla`: DeepSeek-V4's sparse attention on vLLM's FLASHMLA_SPARSE_DSV4 route, one step.

vLLM's own metadata builders for the step (DeepseekSparseSWAFlashMLAMetadataBuilder for the sliding-window cache,
DeepseekV4FlashMLAMetadataBuilder for the compressed K cache of a C4/C128 layer: the batch split, SWA indices and
lengths, prefill gather lengths, the compressed slot mapping, the C128A top-k metadata, all Triton) and the layer's
`DeepseekV4FlashMLAAttention.forward_mqa`, decode and prefill routes (the global top-k conversion, the dequantizing
gather and the top-k/window combine, all Triton, then FlashMLA's sparse decode and prefill kernels), for compress
ratios 1, 4 and 128 (`Case.dsv4`). The layer is made without its `__init__` (which needs a TP group, linears, CUDA
events and DeepGEMM; fuzzer/support/dsv4_runtime.py), with the attributes forward_mqa reads. Its caches hold what the
model writes before attention (the new tokens' latents, every completed compressed entry), written by attnfuzz's
torch writer, byte-equal to vLLM's Triton `quantize_and_insert_k_cache` (the model's own writers are a compiled op and
the compressor, neither run here); the indexer's top-k rows are inputs. Where the host lacks FlashMLA's compiled
kernels (any CPU) they are bounds-checked stand-ins. Single fresh steps: a new builder pair and layer per case.
A finding's repro.py loads the step (both caches' bytes, q, the top-k buffer, the builders' inputs) and makes the
same calls, judged against the saved reference and each metadata tensor's definition.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from fuzzer.env import STATE_DIR
from fuzzer.repro_spec import Call, Judge, ReproSpec
from fuzzer.support import dsv4_runtime as runtime
from fuzzer.support import vllm_cpu_ops
from fuzzer.support.vllm_setup import try_import
from fuzzer.targets.base import WHOLE, RunPlan, Target
from fuzzer.targets.probes import observe_paths
from oracles.dsv4 import c128a_visible, expected_metadata, judge_dsv4, reference_for
from strategies.dsv4_batches import Dsv4Features, dsv4_space
from strategies.dsv4_tensors import (
    TOPK_POISON,
    compressed_pages,
    materialize_dsv4_inputs,
    num_blocks,
    swa_pages,
)

WRITER = ("cache writes: attnfuzz's torch writer of the 584-byte record (byte-equal to vLLM's Triton "
          "quantize_and_insert_k_cache) in place of the layer's fused insert and the compressor")


class Dsv4FlashMLA(Target):
    name = "vllm.dsv4.flashmla"
    summary = ("DeepSeek-V4 sparse attention (FLASHMLA_SPARSE_DSV4): SWA + compressed-KV builders and the layer's "
               "forward_mqa, compress ratios 1/4/128")
    bug_classes = "C H J K N"
    oracle = staticmethod(judge_dsv4)
    real_parts = ("DeepseekSparseSWAFlashMLAMetadataBuilder", "DeepseekV4FlashMLAMetadataBuilder",
                  "DeepseekV4FlashMLAAttention.forward_mqa",
                  "Triton: SWA indices/lens, prefill gather lens, compressed slot mapping, C128A top-k metadata, "
                  "global top-k, dequantize-and-gather, top-k/SWA combine")
    kv_cache_dtypes = ("fp8_ds_mla",)
    outputs_stay_on_device = True  # the caches and outputs are judged where they are (oracles/dsv4.py moves what it reads)

    # What a model version of this family (V4.1: dsv41_flashmla.py) sets: its runtime module, its name in messages,
    # its process-wide config and what its cache writer is.
    runtime = runtime
    model = "DeepSeek-V4"
    writer = WRITER
    config = staticmethod(runtime.dsv4_config)
    step_config = staticmethod(runtime.step_config)  # the config above, the case's fields set

    def unavailable(self) -> str | None:
        rt = self.runtime
        for module in (rt.FLASHMLA_LAYER_MODULE, rt.SPARSE_MLA_MODULE, rt.SWA_MODULE):
            try:
                if try_import(module) is None:
                    return f"this vLLM has no {module} ({self.model} attention)"
            except Exception as e:  # a module that is there but cannot import here
                return f"cannot import {module}: {type(e).__name__}: {e}"
        return None

    def prepare(self) -> None:
        self.shims, standins = runtime.prepare_host(self.device, self.runtime.FLASHMLA_LAYER_MODULE)
        self.shims.append(f"DeepseekV4FlashMLAAttention ({self.model}) made without __init__ (it needs a TP group, "
                          "linears, CUDA events and DeepGEMM): the attributes forward_mqa reads set as __init__ sets them")
        self.emulated = (*standins, self.writer)
        self.real_parts = type(self).real_parts + (("FlashMLA's CUDA kernels (vllm._flashmla_C)",)
                                                   if "flash_mla_with_kvcache" not in self.emulated else ())
        if self.device == "cuda" and runtime.has_cutedsl():
            # vLLM's has_cutedsl() (`cutlass` importable: scripts/gpu-kernels.sh, ATTNFUZZ_CUTEDSL=real) sends the
            # fp8 records' dequantize-and-gather to the CuTe-DSL kernel instead of the Triton one.
            self.real_parts = tuple(p.replace(", dequantize-and-gather", "") for p in self.real_parts) + (
                "CuTe-DSL dequantize-and-gather (deepseek_v4/nvidia/ops/dequant_gather_k_cutedsl.py) in the Triton "
                "kernel's place",)
        self.cfg = self.config(self.device, str(STATE_DIR))

    def cases(self, profile, plan: RunPlan = WHOLE):
        return dsv4_space(profile, Dsv4Features())

    def step(self, case, dev: str) -> SimpleNamespace:
        """The step's tensors on this device, as the model leaves them before its attention call: the inputs, both
        raw caches as written (None: no compressed cache at ratio 1), the indexer's top-k buffer (rows past the step
        poisoned), each KV-cache group's slots of the step's tokens."""
        d = case.dsv4
        inputs = materialize_dsv4_inputs(case, dev)
        comp_raw = compressed_pages(case, inputs, num_blocks(d.compressed_block_table), dev) if d.compressed else None
        topk_buffer = torch.full((case.num_actual_tokens + 16, case.topk_width), TOPK_POISON, dtype=torch.int32,
                                 device=dev)
        topk_buffer[: case.num_actual_tokens] = inputs.topk_indices
        return SimpleNamespace(inputs=inputs, swa_raw=swa_pages(case, inputs, num_blocks(case.block_table), dev),
                               comp_raw=comp_raw, topk_buffer=topk_buffer, swa_slots=inputs.slot_mapping,
                               compressed_slots=None if comp_raw is None else
                               _compressed_token_slots(inputs, d.compressed_block_size))

    # What V4.1's target (dsv41_flashmla.py) changes of run(): the objects it makes (its runtime's `step_layer`, on the
    # sizes `layer_sizes` names), what it reads of the compressed builder's metadata, whether that builder's buffers are
    # guarded, whether vLLM's CPU layer gives a second opinion. The calls themselves are dsv4_runtime's, for both.
    step_layer = staticmethod(runtime.step_layer)
    metadata_outputs = staticmethod(runtime.metadata_outputs)
    guard_compressed_builder = True
    cpu_second_opinion = True  # vLLM's CPU layer reads V4's 584-byte record

    forward_mqa = staticmethod(runtime.forward_mqa)

    def check_pages(self, case, swa_raw, comp_raw, swa_spec, spec) -> None:
        """The raw caches' pages are the size each cache's spec declares (what the runner allocates)."""
        assert swa_raw.shape[1] == swa_spec.page_size_bytes, (swa_raw.shape, swa_spec.page_size_bytes)
        assert comp_raw is None or comp_raw.shape[1] == spec.page_size_bytes, (comp_raw.shape, spec.page_size_bytes)

    def call_notes(self) -> dict:
        """What the call's stand-ins said of it, for the result's notes (none here)."""
        return {}

    def prepare_call(self, layer_module: dict) -> Call:
        """The reproducer's host preparation: FlashMLA's kernels stood in for where the host lacks them."""
        return Call(runtime.prepare_host, dict(device="DEVICE", **layer_module), assign="shims, emulated",
                    note="FlashMLA's kernels stood in for where this host lacks them")

    def layer_sizes(self, case) -> dict:
        """The arguments of `step_layer` that are the case's sizes (the others: the config, the step's tensors)."""
        d = case.dsv4
        return dict(compress_ratio=d.compress_ratio, window_size=d.window_size, swa_block_size=case.block_size,
                    entries_per_block=d.entries_per_block)

    @staticmethod
    def config_fields(case) -> dict:
        """The case's fields `configure` sets on the shared config (and max_num_batched_tokens: the top-k buffer's rows)."""
        d = case.dsv4
        return dict(window_size=d.window_size, index_topk=case.topk_width, num_speculative_tokens=d.num_speculative_tokens,
                    max_model_len=d.max_model_len)

    def run(self, case):
        from vllm.config import set_current_vllm_config  # deferred: vLLM loads after fuzzer.env prepares the process
        from vllm.forward_context import set_forward_context

        dev = self.device
        s = self.step(case, dev)
        inputs, swa_raw, comp_raw = s.inputs, s.swa_raw, s.comp_raw
        cfg = self.step_config(dev, str(STATE_DIR), **self.config_fields(case), max_num_batched_tokens=s.topk_buffer.shape[0])
        second_opinion = self.cpu_second_opinion and self.device == "cpu" and vllm_cpu_ops.load()
        notes: dict = {"shims": tuple(self.shims)}

        def common(table, slots):
            return runtime.common_metadata(inputs.query_start_loc, inputs.seq_lens, table, slots, inputs.positions,
                                           case.num_actual_tokens)

        def call():
            outputs: dict = {}
            # vLLM's objects are made inside the observed call: what they raise is an observation, not ours.
            layer, spec, prefix = self.step_layer(cfg, **self.layer_sizes(case), swa_pages=swa_raw,
                                                  compressed_pages=comp_raw, topk_indices_buffer=s.topk_buffer,
                                                  attn_sink=inputs.attn_sink.clone())
            swa_layer = layer.swa_cache_layer
            self.check_pages(case, swa_raw, comp_raw, swa_layer.get_kv_cache_spec(cfg), spec)
            heads = type(layer).get_padded_num_q_heads(case.heads)  # vLLM's padding of the layer's q heads
            assert heads == inputs.q.shape[1], (heads, inputs.q.shape)
            overruns: list[str] = []
            metadata = runtime.build_metadata(
                cfg, layer, common(inputs.block_table, s.swa_slots), spec, prefix,
                None if comp_raw is None else common(inputs.compressed_block_table, s.compressed_slots), dev, overruns,
                guard_compressed=self.guard_compressed_builder)
            if overruns:
                notes["buffer_overrun"] = overruns
            outputs.update({f"md.{k}": v for k, v in self.metadata_outputs(metadata[swa_layer.prefix],
                                                                          metadata.get(prefix)).items()})
            before = [swa_raw.clone(), None if comp_raw is None else comp_raw.clone()]
            if second_opinion:
                with set_current_vllm_config(cfg), torch.inference_mode(), set_forward_context(metadata, cfg):
                    outputs["cpu_layer_out"] = vllm_cpu_ops.cpu_forward_mqa(layer, inputs.q, inputs.positions)
            out = self.forward_mqa(cfg, layer, metadata, inputs.q, inputs.positions)
            changed = [f"{name} cache: {int((after != was).any(dim=1).sum())} of {len(was)} pages"
                       for name, after, was in (("SWA", swa_raw, before[0]), ("compressed", comp_raw, before[1]))
                       if was is not None and not torch.equal(after, was)]
            if changed:
                notes["cache_changed"] = "; ".join(changed)
            outputs.update(out=out, swa_pages=swa_raw, compressed_pages=comp_raw)
            return outputs

        obs = observe_paths(self.observe, call)
        obs.notes.update(notes, **self.call_notes())
        if second_opinion:
            obs.notes["second_opinion"] = (f"vLLM's CPU layer ({vllm_cpu_ops.CPU_LAYER}.forward_mqa) on every token, "
                                           f"with {vllm_cpu_ops.load()}")
        obs.emulated = self.emulated
        return obs

    def repro_spec(self, finding) -> ReproSpec:
        """The step as the finding ran it (its values are drawn on its device): both caches' bytes as written before
        attention, q, the indexer's top-k buffer, the sink, each KV-cache group's metadata inputs; the calls the
        target makes on it (dsv4_runtime's: the layer's objects, vLLM's two builders, then forward_mqa); judged against
        the fp64 reference, each metadata tensor's definition, the builders' guarded buffers, the caches unchanged."""
        case, dev = finding.case, finding.host.device
        s = self.step(case, dev)
        compressed = s.comp_raw is not None
        expected, atol, rtol, _ = reference_for(case, s.swa_raw, s.comp_raw, dev)
        inputs = s.inputs
        tensors = dict(q=inputs.q, positions=inputs.positions, query_start_loc=inputs.query_start_loc,
                       seq_lens=inputs.seq_lens, attn_sink=inputs.attn_sink, topk_indices_buffer=s.topk_buffer,
                       swa_pages=s.swa_raw, **{"swa.block_table": inputs.block_table, "swa.slot_mapping": s.swa_slots},
                       expected_out=expected[: case.num_tokens])
        if compressed:
            tensors.update({"compressed_pages": s.comp_raw, "compressed.block_table": inputs.compressed_block_table,
                            "compressed.slot_mapping": s.compressed_slots})
        # The C128A rows at the least width the definition allows; the judge pads them to the width vLLM chose.
        width = max(c128a_visible(case), 1) if case.dsv4.compress_ratio == 128 else None
        tensors.update({f"expected_md.{k}": v for k, v in expected_metadata(case, width).items()})

        step = dict(topk_indices_buffer='T["topk_indices_buffer"]', attn_sink='T["attn_sink"]')
        module = self.runtime.FLASHMLA_LAYER_MODULE  # V4's by default; V4.1's named
        layer_module = {} if module == runtime.FLASHMLA_LAYER_MODULE else {"layer_module": repr(module)}
        return ReproSpec(
            about=f"Shrunk case: {case.summary()}; values {case.values}.\n"
                  "Inputs in tensors.safetensors beside this file: both caches' bytes as the model leaves them\n"
                  "before attention (written by attnfuzz's torch writer, byte-equal to vLLM's\n"
                  "quantize_and_insert_k_cache), q, the indexer's top-k buffer, the builders' inputs; the expected\n"
                  "output (attnfuzz's fp64 reference) and each metadata tensor as its definition gives it.",
            prepare=(self.prepare_call(layer_module),),
            setup=(Call(self.step_config, dict(device="DEVICE", **{k: repr(v) for k, v in self.config_fields(case).items()},
                                               max_num_batched_tokens='T["topk_indices_buffer"].shape[0]'), assign="cfg"),
                   Call(runtime.saved_step, dict(T="T", num_actual_tokens=repr(case.num_actual_tokens)),
                        assign="swa_common, compressed_common, caches, before")),
            call=(Call(self.step_layer, dict(cfg="cfg", **{k: repr(v) for k, v in self.layer_sizes(case).items()},
                                             swa_pages="caches[0]", compressed_pages="caches[1]", **step),
                       assign="layer, spec, prefix"),
                  Call(runtime.build_metadata, dict(
                      cfg="cfg", layer="layer", swa_common="swa_common", compressed_spec="spec", compressed_prefix="prefix",
                      compressed_common="compressed_common", device="DEVICE", found="found",
                      **({} if self.guard_compressed_builder else {"guard_compressed": "False"})), assign="metadata"),
                  Call(self.metadata_outputs, dict(swa_md="metadata[layer.swa_cache_layer.prefix]",
                                                   md="metadata.get(prefix)"), assign="md"),
                  Call(self.forward_mqa, dict(cfg="cfg", layer="layer", metadata="metadata", q='T["q"]',
                                              positions='T["positions"]'), assign="out")),
            judge=Judge("dsv4", dict(out="out", expected='T["expected_out"]', metadata="md",
                                     expected_metadata='{k[len("expected_md."):]: t for k, t in T.items() '
                                                       'if k.startswith("expected_md.")}',
                                     caches="caches", before="before", atol="ATOL", rtol="RTOL")),
            report={"stand-ins for ops this host lacks:": '", ".join(emulated) or "none"'},
            constants=dict(ATOL=atol, RTOL=rtol), tensors=tensors, bounds_checked=dev == "cpu")


def _compressed_token_slots(inputs, block_size: int) -> torch.Tensor:
    """The step's tokens' slots in the compressed K cache's group (its table of `block_size`-token blocks), as the
    runner gives them to the builder, which maps them to compressed entries' slots; -1 for padding tokens."""
    table, real, pos = inputs.compressed_block_table, inputs.token_request >= 0, inputs.positions
    rows = table[inputs.token_request.clamp(min=0)].long()
    blocks = rows.gather(1, (pos // block_size)[:, None].clamp(max=table.shape[1] - 1)).flatten()
    return torch.where(real, blocks * block_size + pos % block_size, -1)
