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
from fuzzer.repro_spec import Judge, ReproSpec
from fuzzer.support import dsv4_runtime as runtime
from fuzzer.support import vllm_cpu_ops
from fuzzer.support.flashmla_runtime import _try_import, define_missing_c_queries
from fuzzer.support.interp.corrections import CORRECTIONS, install_corrections
from fuzzer.support.standins.cpu_shims import install_cpu_shims
from fuzzer.targets.base import Target
from fuzzer.targets.harness import REPRO_CPU_PREPARE, REPRO_CPU_SUPPORT
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

    @staticmethod
    def config(device: str, state_dir: str):
        return runtime.dsv4_config(device, state_dir)

    def unavailable(self) -> str | None:
        rt = self.runtime
        for module in (rt.FLASHMLA_LAYER_MODULE, rt.SPARSE_MLA_MODULE, rt.SWA_MODULE):
            try:
                if _try_import(module) is None:
                    return f"this vLLM has no {module} ({self.model} attention)"
            except Exception as e:  # a module that is there but cannot import here
                return f"cannot import {module}: {type(e).__name__}: {e}"
        return None

    def prepare(self) -> None:
        self.shims: list[str] = list(define_missing_c_queries())
        if self.device == "cpu":
            install_corrections()
            self.shims += [*install_cpu_shims(), *self.runtime.cpu_shims(),
                           *(f"interpreter correction: {c}" for c in CORRECTIONS)]
        self.shims.append(f"DeepseekV4FlashMLAAttention ({self.model}) made without __init__ (it needs a TP group, "
                          "linears, CUDA events and DeepGEMM): the attributes forward_mqa reads set as __init__ sets them")
        self.emulated = (*self.runtime.install_standins(self.device), self.writer)
        self.real_parts = type(self).real_parts + (("FlashMLA's CUDA kernels (vllm._flashmla_C)",)
                                                   if "flash_mla_with_kvcache" not in self.emulated else ())
        if self.device == "cuda" and runtime.has_cutedsl():
            # vLLM's has_cutedsl() (`cutlass` importable: scripts/gpu-kernels.sh, ATTNFUZZ_CUTEDSL=real) sends the
            # fp8 records' dequantize-and-gather to the CuTe-DSL kernel instead of the Triton one.
            self.real_parts = tuple(p.replace(", dequantize-and-gather", "") for p in self.real_parts) + (
                "CuTe-DSL dequantize-and-gather (deepseek_v4/nvidia/ops/dequant_gather_k_cutedsl.py) in the Triton "
                "kernel's place",)
        self.cfg = self.config(self.device, str(STATE_DIR))

    def cases(self, profile):
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

    # What V4.1's target (dsv41_flashmla.py) changes of run(): the objects it makes, what it reads of the compressed
    # builder's metadata, whether that builder's buffers are guarded, whether vLLM's CPU layer gives a second opinion.
    guard_compressed_builder = True
    cpu_second_opinion = True  # vLLM's CPU layer reads V4's 584-byte record

    def layer_objects(self, cfg, case, s) -> SimpleNamespace:
        """vLLM's objects for the step, made inside the observed call: the SWA cache layer (pages bound) and its spec,
        the compressed cache's spec (None at ratio 1), the attention layer, the compressed KV-cache group's prefix."""
        d = case.dsv4
        swa_layer = runtime.swa_cache_layer(cfg, d.window_size, case.block_size)
        swa_layer.kv_cache = runtime.paged(s.swa_raw, case.block_size)
        spec = kv_cache = None
        if s.comp_raw is not None:
            spec = runtime.compressed_spec(d.compress_ratio)
            kv_cache = runtime.paged(s.comp_raw, d.entries_per_block)
        layer = runtime.attention_layer(cfg, d.compress_ratio, swa_layer, kv_cache, s.topk_buffer,
                                        s.inputs.attn_sink.clone())
        return SimpleNamespace(swa_layer=swa_layer, spec=spec, layer=layer, compressed_prefix=runtime.LAYER)

    def metadata_outputs(self, swa_md, compressed_md) -> dict:
        return runtime.metadata_outputs(swa_md, compressed_md)

    def run(self, case):
        from vllm.config import set_current_vllm_config  # deferred: vLLM loads after fuzzer.env prepares the process
        from vllm.forward_context import set_forward_context

        rt, dev, d = self.runtime, self.device, case.dsv4
        s = self.step(case, dev)
        inputs, swa_raw, comp_raw = s.inputs, s.swa_raw, s.comp_raw
        cfg = rt.configure(self.cfg, window_size=d.window_size, index_topk=case.topk_width,
                           num_speculative_tokens=d.num_speculative_tokens,
                           max_num_batched_tokens=s.topk_buffer.shape[0], max_model_len=d.max_model_len)
        layer_cls = _try_import(rt.FLASHMLA_LAYER_MODULE).DeepseekV4FlashMLAAttention
        second_opinion = self.cpu_second_opinion and self.device == "cpu" and vllm_cpu_ops.load()
        notes: dict = {"shims": tuple(self.shims)}

        def common(table, slots):
            return rt.common_metadata(inputs.query_start_loc, inputs.seq_lens, table, slots, inputs.positions,
                                      case.num_actual_tokens)

        def call():
            outputs: dict = {}
            # vLLM's objects are made inside the observed call: what they raise is an observation, not ours.
            objs = self.layer_objects(cfg, case, s)
            swa_layer, spec = objs.swa_layer, objs.spec
            swa_spec = swa_layer.get_kv_cache_spec(cfg)
            assert swa_raw.shape[1] == swa_spec.page_size_bytes, (swa_raw.shape, swa_spec.page_size_bytes)
            assert comp_raw is None or comp_raw.shape[1] == spec.page_size_bytes, (comp_raw.shape, spec.page_size_bytes)
            heads = layer_cls.get_padded_num_q_heads(case.heads)  # vLLM's padding of the layer's q heads
            assert heads == inputs.q.shape[1], (heads, inputs.q.shape)
            with set_current_vllm_config(cfg), torch.inference_mode():
                swa_builder = layer_cls.swa_backend_cls.get_builder_cls()(swa_spec, [swa_layer.prefix], cfg,
                                                                          torch.device(dev))
                check = rt.guard_buffers(swa_builder)
                metadata = {swa_layer.prefix: swa_builder.build(0, common(inputs.block_table, s.swa_slots))}
                overruns = check(metadata[swa_layer.prefix])
                compressed_md = None
                if comp_raw is not None:  # the compressed KV-cache group (V4.1: the kv source's): its builder
                    builder = layer_cls.backend_cls.get_builder_cls()(spec, [objs.compressed_prefix], cfg,
                                                                      torch.device(dev))
                    check = rt.guard_buffers(builder) if self.guard_compressed_builder else None
                    compressed_md = metadata[objs.compressed_prefix] = builder.build(
                        0, common(inputs.compressed_block_table, s.compressed_slots))
                    if check is not None:
                        overruns += check(compressed_md)
                if overruns:
                    notes["buffer_overrun"] = overruns
                outputs.update({f"md.{k}": v for k, v in self.metadata_outputs(metadata[swa_layer.prefix],
                                                                              compressed_md).items()})
                before = [swa_raw.clone(), None if comp_raw is None else comp_raw.clone()]
                out = torch.full_like(inputs.q, float("nan"))
                with set_forward_context(metadata, cfg):
                    if second_opinion:
                        outputs["cpu_layer_out"] = vllm_cpu_ops.cpu_forward_mqa(objs.layer, inputs.q, inputs.positions)
                    objs.layer.forward_mqa(inputs.q, None, inputs.positions, out)
            changed = [f"{name} cache: {int((after != was).any(dim=1).sum())} of {len(was)} pages"
                       for name, after, was in (("SWA", swa_raw, before[0]), ("compressed", comp_raw, before[1]))
                       if was is not None and not torch.equal(after, was)]
            if changed:
                notes["cache_changed"] = "; ".join(changed)
            outputs.update(out=out, swa_pages=swa_raw, compressed_pages=comp_raw)
            return outputs

        obs = observe_paths(self.observe, call)
        obs.notes.update(notes)
        if second_opinion:
            obs.notes["second_opinion"] = (f"vLLM's CPU layer ({vllm_cpu_ops.CPU_LAYER}.forward_mqa) on every token, "
                                           f"with {vllm_cpu_ops.load()}")
        obs.emulated = self.emulated
        return obs

    def repro_spec(self, finding) -> ReproSpec:
        """The step as the finding ran it (its values are drawn on its device): both caches' bytes as written before
        attention, q, the indexer's top-k buffer, the sink, each KV-cache group's metadata inputs; the calls the
        target makes on it (vLLM's two builders, then forward_mqa on the layer dsv4_runtime makes); judged against
        the fp64 reference, each metadata tensor's definition, the builders' guarded buffers, the caches unchanged."""
        case, dev = finding.case, finding.host.device
        cpu, d = dev == "cpu", case.dsv4
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
        width = max(c128a_visible(case), 1) if d.compress_ratio == 128 else None
        tensors.update({f"expected_md.{k}": v for k, v in expected_metadata(case, width).items()})
        return ReproSpec(
            about=f"Shrunk case: {case.summary()}; values {case.values}.\n"
                  "Inputs in tensors.safetensors beside this file: both caches' bytes as the model leaves them\n"
                  "before attention (written by attnfuzz's torch writer, byte-equal to vLLM's\n"
                  "quantize_and_insert_k_cache), q, the indexer's top-k buffer, the builders' inputs; the expected\n"
                  "output (attnfuzz's fp64 reference) and each metadata tensor as its definition gives it.",
            imports=("import tempfile",),
            constants=dict(COMPRESS_RATIO=d.compress_ratio, WINDOW_SIZE=d.window_size, INDEX_TOPK=case.topk_width,
                           MTP_TOKENS=d.num_speculative_tokens, MAX_MODEL_LEN=d.max_model_len,
                           SWA_BLOCK_SIZE=case.block_size, ENTRIES_PER_BLOCK=d.entries_per_block,
                           NUM_TOKENS=case.num_actual_tokens, ATOL=atol, RTOL=rtol),
            tensors=tensors,
            support={"runtime": "fuzzer.support.dsv4_runtime", **(REPRO_CPU_SUPPORT if cpu else {})},
            prepare=(_REPRO_CPU_PREPARE if cpu else "") + _REPRO_STANDINS,
            setup=_REPRO_SETUP,
            call=_REPRO_CALL.format(kv_cache=_REPRO_KV_CACHE[compressed]) + (_REPRO_COMPRESSED if compressed else "")
            + _REPRO_FORWARD,
            judge=Judge("dsv4", dict(out="out", expected='T["expected_out"]', metadata="md",
                                     expected_metadata="expected_md", caches="[swa_pages, compressed_pages]",
                                     before="before", atol="ATOL", rtol="RTOL")),
            report='print("stand-ins for ops this host lacks:", ", ".join(emulated) or "none")\n',
            bounds_checked=cpu)


def _compressed_token_slots(inputs, block_size: int) -> torch.Tensor:
    """The step's tokens' slots in the compressed K cache's group (its table of `block_size`-token blocks), as the
    runner gives them to the builder, which maps them to compressed entries' slots; -1 for padding tokens."""
    table, real, pos = inputs.compressed_block_table, inputs.token_request >= 0, inputs.positions
    rows = table[inputs.token_request.clamp(min=0)].long()
    blocks = rows.gather(1, (pos // block_size)[:, None].clamp(max=table.shape[1] - 1)).flatten()
    return torch.where(real, blocks * block_size + pos % block_size, -1)


_REPRO_CPU_PREPARE = REPRO_CPU_PREPARE + "runtime.cpu_shims()  # the workspace manager: no accelerator cache to empty\n"
_REPRO_STANDINS = "emulated = runtime.install_standins(DEVICE)  # FlashMLA's kernels, where this host lacks them\n"
_REPRO_SETUP = f"""\
from vllm.config import set_current_vllm_config
from vllm.forward_context import set_forward_context
from {runtime.FLASHMLA_LAYER_MODULE} import DeepseekV4FlashMLAAttention as Layer

cfg = runtime.configure(runtime.dsv4_config(DEVICE, tempfile.mkdtemp()), window_size=WINDOW_SIZE,
                        index_topk=INDEX_TOPK, num_speculative_tokens=MTP_TOKENS,
                        max_num_batched_tokens=T["topk_indices_buffer"].shape[0], max_model_len=MAX_MODEL_LEN)
swa_pages, compressed_pages = T["swa_pages"], T.get("compressed_pages")  # raw pages of 584-byte records
before = [swa_pages.clone(), None if compressed_pages is None else compressed_pages.clone()]
expected_md = {{name.split(".", 1)[1]: t for name, t in T.items() if name.startswith("expected_md.")}}

def common(group):  # the runner's CommonAttentionMetadata of a KV-cache group: "swa" or "compressed"
    return runtime.common_metadata(T["query_start_loc"], T["seq_lens"], T[group + ".block_table"],
                                   T[group + ".slot_mapping"], T["positions"], NUM_TOKENS)
"""
_REPRO_CALL = """\
swa_layer = runtime.swa_cache_layer(cfg, WINDOW_SIZE, SWA_BLOCK_SIZE)  # vLLM's DeepseekV4SWACache
swa_layer.kv_cache = runtime.paged(swa_pages, SWA_BLOCK_SIZE)
kv_cache = {kv_cache}
# DeepseekV4FlashMLAAttention made without its __init__ (it needs a TP group, linears,
# CUDA events and DeepGEMM), with the attributes forward_mqa reads, set as __init__ sets them
layer = runtime.attention_layer(cfg, COMPRESS_RATIO, swa_layer, kv_cache, T["topk_indices_buffer"],
                                T["attn_sink"])
with set_current_vllm_config(cfg), torch.inference_mode():
    swa_spec = swa_layer.get_kv_cache_spec(cfg)
    swa_builder = Layer.swa_backend_cls.get_builder_cls()(swa_spec, [swa_layer.prefix], cfg, torch.device(DEVICE))
    check = runtime.guard_buffers(swa_builder)  # its persistent buffers poisoned: stray writes show
    metadata = {{swa_layer.prefix: swa_builder.build(0, common("swa"))}}
    found += check(metadata[swa_layer.prefix])
"""
_REPRO_KV_CACHE = {True: "runtime.paged(compressed_pages, ENTRIES_PER_BLOCK)  # the compressed K cache",
                   False: "None  # a sliding-window layer has no compressed K cache"}
_REPRO_COMPRESSED = """\
    spec = runtime.compressed_spec(COMPRESS_RATIO)
    builder = Layer.backend_cls.get_builder_cls()(spec, [runtime.LAYER], cfg, torch.device(DEVICE))
    check = runtime.guard_buffers(builder)
    metadata[runtime.LAYER] = builder.build(0, common("compressed"))
    found += check(metadata[runtime.LAYER])
"""
_REPRO_FORWARD = """\
    md = runtime.metadata_outputs(metadata[swa_layer.prefix], metadata.get(runtime.LAYER))
    out = torch.full_like(T["q"], float("nan"))
    with set_forward_context(metadata, cfg):
        layer.forward_mqa(T["q"], None, T["positions"], out)
"""
