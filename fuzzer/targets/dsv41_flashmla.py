"""`vllm.dsv41.flashmla`: DeepSeek-V4.1's sparse attention on vLLM's FLASHMLA_SPARSE_DSV41 route, one step.

The DeepSeek-V4 target (dsv4_flashmla.py) run on V4.1's own classes: vLLM's DeepseekSparseSWAFlashMLAMetadataBuilder
(V4.1's, on DeepseekV41SparseSWAMetadataBuilder: tile-scheduler plans per V4.1 layer type) and
DeepseekV4FlashMLAMetadataBuilder of `vllm.models.deepseek_v41` (the compressed slot mapping; no C128A metadata), and
V4.1's `DeepseekV4FlashMLAAttention.forward_mqa`, decode and prefill routes (the global top-k conversion, V4.1's
dequantizing gather and top-k/window combine, all Triton, then FlashMLA's sparse decode and prefill kernels), for
compress ratios 0 (sliding window only), 1 and 2 (`Case.dsv4`, version "4.1"). What V4.1 adds that a step can
show: a ratio-1 layer reads a full-length compressed cache through the indexer's top-k (V4's ratio 1 was the
sliding-window layer), the compressed block is the kernel block size (64 or 128 tokens), the SWA block is 32, and a
consumer layer reads its kv-source layer's cache and metadata (`compressed_cache_prefix`). The caches hold V4's
584-byte record (what the layer writes on every arch but SM100) or SM100's interleaved 528-byte MXFP8 record (knob
`kv_record`; drawn where FlashMLA's decode is a stand-in or SM100's), written by attnfuzz's torch writer; the
indexer's top-k rows are inputs. Where the host lacks FlashMLA's compiled kernels (any CPU) they are bounds-checked
stand-ins. Not covered: PCP (the builders' rank-local slots), SWA bounded replay, the NVFP4 compressed record and
the mega-attention backend. A finding's repro.py is the V4 target's, making V4.1's objects.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import torch

from fuzzer.support import dsv41_runtime as runtime
from fuzzer.repro_spec import ReproSpec
from fuzzer.targets.dsv4_flashmla import _REPRO_SETUP, Dsv4FlashMLA
from strategies.dsv4_batches import V41_FEATURES, dsv4_space

WRITER = ("cache writes: attnfuzz's torch writers of the 584-byte and 528-byte records (byte-equal to vLLM's Triton "
          "quantize_and_insert_k_cache, bytes_per_token 584 or 528) in place of the layer's fused insert and the "
          "compressor")


class Dsv41FlashMLA(Dsv4FlashMLA):
    name = "vllm.dsv41.flashmla"
    summary = ("DeepSeek-V4.1 sparse attention (FLASHMLA_SPARSE_DSV41): SWA + compressed-KV builders and the layer's "
               "forward_mqa, compress ratios 0/1/2, own or shared (kv-source) compressed cache")
    bug_classes = "C H J K N"
    real_parts = ("DeepseekSparseSWAFlashMLAMetadataBuilder (V4.1)", "DeepseekV4FlashMLAMetadataBuilder (V4.1)",
                  "DeepseekV4FlashMLAAttention.forward_mqa (V4.1)",
                  "Triton: SWA indices/lens, prefill gather lens, compressed slot mapping, global top-k, "
                  "dequantize-and-gather, top-k/SWA combine")

    runtime = runtime
    model = "DeepSeek-V4.1"
    writer = WRITER

    @staticmethod
    def config(device: str, state_dir: str):
        return runtime.dsv41_config(device, state_dir)

    # A campaign whose cases run in a worker plans in a process that never ran prepare(): the records come from it.
    PLANNED = ("kv_records",)

    def prepare(self) -> None:
        super().prepare()
        # SM100's MXFP8 record only where a decode kernel reads it: the stand-in does, SM90's FlashMLA refuses it
        # (vLLM writes it on SM100 only: `_use_v41_mxfp8_kv_record`).
        sm100 = self.device != "cpu" and torch.cuda.get_device_capability()[0] == 10
        emulated = "flash_mla_with_kvcache" in self.emulated
        self.kv_records = V41_FEATURES.kv_records if emulated or sm100 else (584,)

    def cases(self, profile):
        return dsv4_space(profile, replace(V41_FEATURES, kv_records=tuple(self.kv_records)))

    # V4.1's compressed builder is not guarded, and vLLM's CPU layer reads V4's record only
    guard_compressed_builder = False
    cpu_second_opinion = False

    def layer_objects(self, cfg, case, s) -> SimpleNamespace:
        """V4.1's objects: the SWA cache layer of the case's record, the compressed spec of its block size and record,
        the layer under test (and its kv source, a consumer's), the compressed group under the source's prefix."""
        d = case.dsv4
        layer_id, source_id = runtime.layer_ids(d.compress_ratio, d.kv_source)
        swa_layer = runtime.swa_cache_layer(cfg, layer_id, d.window_size, case.block_size, d.kv_record)
        swa_layer.kv_cache = runtime.paged(s.swa_raw, case.block_size, d.kv_record)
        spec = kv_cache = None
        if s.comp_raw is not None:
            spec = runtime.compressed_spec(d.compress_ratio, d.compressed_block_size, d.kv_record)
            kv_cache = runtime.paged(s.comp_raw, d.entries_per_block, d.kv_record)
        layer = runtime.attention_layers(cfg, d.compress_ratio, d.kv_source, swa_layer, kv_cache, s.topk_buffer,
                                         s.inputs.attn_sink.clone(), case.heads)
        prefix = runtime.layer_prefix(source_id) if source_id is not None else None
        return SimpleNamespace(swa_layer=swa_layer, spec=spec, layer=layer, compressed_prefix=prefix)

    def metadata_outputs(self, swa_md, compressed_md) -> dict:
        """The SWA builder's metadata, and of V4.1's compressed builder only its slot mapping (it has no C128A)."""
        out = runtime.metadata_outputs(swa_md, None)
        if compressed_md is not None:
            out["compressed_slot_mapping"] = compressed_md.slot_mapping.clone()
        return out

    def repro_spec(self, finding) -> ReproSpec:
        """The V4 target's reproducer (the same saved step and judge) making V4.1's objects: its SWA cache layer of
        the case's record, its layer (and kv source) from dsv41_runtime, the compressed builder under the source's
        prefix."""
        d = finding.case.dsv4
        spec = super().repro_spec(finding)
        compressed = d.compressed
        return replace(
            spec, constants={**spec.constants, "KV_SOURCE": d.kv_source, "KV_RECORD": d.kv_record,
                             "COMPRESSED_BLOCK_SIZE": d.compressed_block_size, "HEADS": finding.case.heads},
            support={**spec.support, "runtime": runtime.__name__},
            setup=_REPRO_SETUP.replace("dsv4_config", "dsv41_config").replace(
                "from vllm.models.deepseek_v4.nvidia.flashmla", f"from {runtime.FLASHMLA_LAYER_MODULE}").replace(
                "raw pages of 584-byte records", "raw pages of KV_RECORD-byte records"),
            call=_REPRO_CALL.format(kv_cache=_REPRO_KV_CACHE[compressed]) + (_REPRO_COMPRESSED if compressed else "")
            + _REPRO_FORWARD + (_REPRO_COMPRESSED_MD if compressed else ""))


# The calls of run(), on the loaded step (the V4 reproducer's setup and forward; V4.1's layers and builders).
_REPRO_CALL = """\
layer_id, source_id = runtime.layer_ids(COMPRESS_RATIO, KV_SOURCE)  # the layer under test, its kv source
swa_layer = runtime.swa_cache_layer(cfg, layer_id, WINDOW_SIZE, SWA_BLOCK_SIZE, KV_RECORD)  # DeepseekV4SWACache
swa_layer.kv_cache = runtime.paged(swa_pages, SWA_BLOCK_SIZE, KV_RECORD)
kv_cache = {kv_cache}
# V4.1's DeepseekV4FlashMLAAttention made without its __init__ (it needs a TP group, linears, CUDA events and
# DeepGEMM), with the attributes forward_mqa reads, set as __init__ sets them; a consumer's kv source beside it
layer = runtime.attention_layers(cfg, COMPRESS_RATIO, KV_SOURCE, swa_layer, kv_cache, T["topk_indices_buffer"],
                                 T["attn_sink"], HEADS)
with set_current_vllm_config(cfg), torch.inference_mode():
    swa_spec = swa_layer.get_kv_cache_spec(cfg)
    swa_builder = Layer.swa_backend_cls.get_builder_cls()(swa_spec, [swa_layer.prefix], cfg, torch.device(DEVICE))
    check = runtime.guard_buffers(swa_builder)  # its persistent buffers poisoned: stray writes show
    metadata = {{swa_layer.prefix: swa_builder.build(0, common("swa"))}}
    found += check(metadata[swa_layer.prefix])
"""
_REPRO_KV_CACHE = {True: "runtime.paged(compressed_pages, ENTRIES_PER_BLOCK, KV_RECORD)  # the kv source's compressed cache",
                   False: "None  # a sliding-window layer has no compressed K cache"}
_REPRO_COMPRESSED = """\
    spec = runtime.compressed_spec(COMPRESS_RATIO, COMPRESSED_BLOCK_SIZE, KV_RECORD)
    source = runtime.layer_prefix(source_id)  # the compressed cache's KV-cache group is the kv source's
    builder = Layer.backend_cls.get_builder_cls()(spec, [source], cfg, torch.device(DEVICE))
    metadata[source] = builder.build(0, common("compressed"))
"""
_REPRO_FORWARD = """\
    md = runtime.metadata_outputs(metadata[swa_layer.prefix])
    out = torch.full_like(T["q"], float("nan"))
    with set_forward_context(metadata, cfg):
        layer.forward_mqa(T["q"], None, T["positions"], out)
"""
_REPRO_COMPRESSED_MD = """\
    md["compressed_slot_mapping"] = metadata[source].slot_mapping.clone()
"""
