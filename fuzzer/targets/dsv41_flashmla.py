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
the mega-attention backend. A finding's repro.py is the V4 target's, making V4.1's objects (dsv41_runtime.step_layer)
and calling V4's builders and forward_mqa (dsv4_runtime) as run() does.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from fuzzer.support import dsv41_runtime as runtime
from fuzzer.targets.base import WHOLE, RunPlan
from fuzzer.targets.dsv4_flashmla import Dsv4FlashMLA
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
    config = staticmethod(runtime.dsv41_config)
    step_config = staticmethod(runtime.step_config)

    # A campaign whose cases run in a worker plans in a process that never ran prepare(): the records come from it.
    PLANNED = ("kv_records",)

    def prepare(self) -> None:
        super().prepare()
        # SM100's MXFP8 record only where a decode kernel reads it: the stand-in does, SM90's FlashMLA refuses it
        # (vLLM writes it on SM100 only: `_use_v41_mxfp8_kv_record`).
        sm100 = self.device != "cpu" and torch.cuda.get_device_capability()[0] == 10
        emulated = "flash_mla_with_kvcache" in self.emulated
        self.kv_records = V41_FEATURES.kv_records if emulated or sm100 else (584,)

    def cases(self, profile, plan: RunPlan = WHOLE):
        return dsv4_space(profile, replace(V41_FEATURES, kv_records=tuple(self.kv_records)))

    # V4.1's objects (dsv41_runtime.step_layer: its SWA cache layer of the case's record, its layer and a consumer's kv
    # source, the compressed group under the source's prefix), its compressed builder's slot mapping only (no C128A),
    # unguarded; vLLM's CPU layer reads V4's record only. The builders and forward_mqa are V4's calls.
    step_layer = staticmethod(runtime.step_layer)
    metadata_outputs = staticmethod(runtime.metadata_outputs_v41)
    guard_compressed_builder = False
    cpu_second_opinion = False

    def layer_sizes(self, case) -> dict:
        d = case.dsv4
        return dict(compress_ratio=d.compress_ratio, kv_source=d.kv_source, window_size=d.window_size,
                    swa_block_size=case.block_size, kv_record=d.kv_record, compressed_block_size=d.compressed_block_size,
                    entries_per_block=d.entries_per_block, num_heads=case.heads)
