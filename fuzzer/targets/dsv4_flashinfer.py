"""`vllm.dsv4.flashinfer`: DeepSeek-V4's sparse attention on vLLM's FLASHINFER_MLA_SPARSE_DSV4 route (SM100), one step.

The DeepSeek-V4 target (dsv4_flashmla.py) run on FlashInfer's SM100 layer, `DeepseekV4FlashInferMLAAttention` of
vllm/models/deepseek_v4/nvidia/flashinfer_sparse.py (backend DeepseekV4FlashInferMLASparseBackend): vLLM's own SWA
builder (DeepseekSparseSWAFlashInferMetadataBuilder) and compressed builder (DeepseekV4FlashInferSparseMLAMetadata
Builder), then the layer's forward_mqa: `_build_sparse_index_metadata` (C4A's local top-k rows, C128A's builder
rows), vLLM's Triton `build_flashinfer_mixed_sparse_indices` (SWA slots then compressed slots a token, remapped to
storage rows by each pool's block span, `_packed_block_span`), and FlashInfer's `trtllm_batch_decode_sparse_mla_dsv4`
once for the decodes and once for the prefills, compress ratios 1, 4 and 128. The caches are plain rows (bf16 for
--kv-cache-dtype auto / bfloat16, per-tensor e4m3 at k_scale 1.0 for fp8 / fp8_e4m3: every dtype the backend takes
on SM100), written by attnfuzz's torch writer, unpacked or in vLLM's packed KV layout (each page longer than its rows:
the layout of vLLM issue 47783, `Dsv4.page_pad`). The window is the model's 128: FlashInfer's kernel takes the first
128 columns as the SWA segment.

FlashInfer's kernel is attnfuzz's stand-in (no attnfuzz host has an SM100 GPU or FlashInfer's cubins:
fuzzer/support/standins/flashinfer_dsv4_mla.py), named in every result with what its public contract leaves open
(`not_public`). vLLM's platform check (`supports_compute_capability`: major 10 or 12) would not choose the backend
here: the layer is built as an SM100 host builds it, and every result's shims say so. Judged by the V4 oracle
(oracles/dsv4.py: the same reference over the plain rows, oracles/plain_rows.py; a per-tensor fp8 cache's query in
e4m3 as the layer hands it over). A finding's repro.py is the V4 target's, making this layer.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from fuzzer.env import STATE_DIR
from fuzzer.repro_spec import Call
from fuzzer.support import dsv4_flashinfer_runtime as fi_runtime
from fuzzer.support import dsv41_runtime
from fuzzer.targets.base import WHOLE, RunPlan
from fuzzer.targets.dsv4_flashmla import Dsv4FlashMLA
from strategies.dsv4_batches import FLASHINFER_FEATURES, FLASHINFER_V41_FEATURES, dsv4_space
from strategies.dsv4_tensors import page_bytes

WRITER = ("cache writes: attnfuzz's torch writer of plain rows (bf16, or e4m3 of the value at k_scale 1.0) in place of "
          "the layer's fused insert (_C.fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_*_insert) and the compressor")


class Dsv4FlashInfer(Dsv4FlashMLA):
    name = "vllm.dsv4.flashinfer"
    summary = ("DeepSeek-V4 sparse attention (FLASHINFER_MLA_SPARSE_DSV4, SM100): SWA + compressed-KV builders and "
               "the layer's forward_mqa over plain bf16/fp8 rows, packed or not, compress ratios 1/4/128")
    bug_classes = "C H J K N"
    real_parts = ("DeepseekSparseSWAFlashInferMetadataBuilder", "DeepseekV4FlashInferSparseMLAMetadataBuilder",
                  "DeepseekV4FlashInferMLAAttention.forward_mqa",
                  "Triton: SWA indices/lens, compressed slot mapping, C128A top-k metadata, "
                  "build_flashinfer_mixed_sparse_indices")
    # The two row formats (Case.kv_cache_dtype; one gate campaign each); each draws both --kv-cache-dtype values
    # that give it (DTYPE_NAMES): every value the backend takes on SM100.
    kv_cache_dtypes = ("bfloat16", "fp8")
    DTYPE_NAMES = {"bfloat16": ("bfloat16", "auto"), "fp8": ("fp8", "fp8_e4m3")}
    version = "4"
    features = FLASHINFER_FEATURES
    writer = WRITER
    cpu_second_opinion = False  # vLLM's CPU layer reads the 584-byte record, not plain rows

    def unavailable(self) -> str | None:
        try:
            fi_runtime.layer_class(self.version)
        except Exception as e:
            return f"cannot import {fi_runtime.LAYER_MODULES[self.version]}: {type(e).__name__}: {e}"
        return super().unavailable()

    def prepare(self) -> None:
        self.shims, standins = fi_runtime.prepare_host(self.device, self.version)
        self.shims.append(f"{fi_runtime.LAYER_CLASS} ({self.model}) made without __init__ (it needs a TP group, "
                          "linears, CUDA events and DeepGEMM): the attributes forward_mqa reads set as __init__ sets "
                          "them; the RopeQuant output (128 local heads, fp8 cache, fp8 wo_a) not driven")
        self.emulated = (*standins, self.writer)
        self.real_parts = type(self).real_parts
        self.cfg = self.config(self.device, str(STATE_DIR))

    def cases(self, profile, plan: RunPlan = WHOLE):
        names = tuple(n for d in plan.kv_dtypes(self) for n in self.DTYPE_NAMES[d])
        return dsv4_space(profile, replace(self.features, cache_dtypes=names))

    def step(self, case, dev: str) -> SimpleNamespace:
        """The V4 target's step, q and the sink cut to the heads FlashInfer's layer pads to (8, 16, 32, 64, 128), and
        each block table as wide as the runner's (`fi_runtime.runner_table`: the layer's index kernel reads a
        CUDA-graph padding token's window from request 0's row, past the columns the request holds)."""
        s = super().step(case, dev)
        heads = fi_runtime.padded_heads(case.heads, self.version)
        d = case.dsv4
        max_model_len = d.max_model_len or self.runtime.MAX_MODEL_LEN
        comp = s.inputs.compressed_block_table
        s.inputs = replace(s.inputs, q=s.inputs.q[:, :heads].contiguous(),
                           attn_sink=s.inputs.attn_sink[:heads].contiguous(),
                           block_table=fi_runtime.runner_table(s.inputs.block_table, case.block_size, max_model_len),
                           compressed_block_table=None if comp is None else
                           fi_runtime.runner_table(comp, d.compressed_block_size, max_model_len))
        return s

    step_layer = staticmethod(fi_runtime.step_layer)
    forward_mqa = staticmethod(fi_runtime.forward_mqa)

    def layer_sizes(self, case) -> dict:
        d = case.dsv4
        return dict(compress_ratio=d.compress_ratio, window_size=d.window_size, swa_block_size=case.block_size)

    @staticmethod
    def config_fields(case) -> dict:
        return {**Dsv4FlashMLA.config_fields(case), "cache_dtype": case.dsv4.cache_dtype}

    def check_pages(self, case, swa_raw, comp_raw, swa_spec, spec) -> None:
        """Each raw page holds what its spec declares, then the packed page's other rows (`Dsv4.page_pad`)."""
        d = case.dsv4
        assert swa_spec.page_size_bytes == page_bytes(case.block_size, d.kv_record), swa_spec.page_size_bytes
        assert swa_raw.shape[1] == page_bytes(case.block_size, d.kv_record, d.page_pad), swa_raw.shape
        if comp_raw is not None:
            assert spec.page_size_bytes == page_bytes(d.entries_per_block, d.kv_record), spec.page_size_bytes
            assert comp_raw.shape[1] == page_bytes(d.entries_per_block, d.kv_record, d.page_pad), comp_raw.shape

    def call_notes(self) -> dict:
        found = fi_runtime.not_public()
        return {"not_public": [f"{what} (tokens {rows[:8]})" for what, rows in found]} if found else {}

    def prepare_call(self, layer_module: dict) -> Call:
        return Call(fi_runtime.prepare_host, dict(device="DEVICE", version=repr(self.version)),
                    assign="shims, emulated", note="FlashInfer's DeepSeek-V4 kernel stood in for (no SM100 here)")



class Dsv41FlashInfer(Dsv4FlashInfer):
    """`vllm.dsv41.flashinfer`: the same on DeepSeek-V4.1's FLASHINFER_MLA_SPARSE_DSV41 (SM100): V4.1's
    DeepseekV4FlashInferMLAAttention of vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py, its SWA builder
    (DeepseekSparseSWAFlashInferMetadataBuilder over V4.1's, with replay_start) and compressed builder, V4.1's own
    `build_flashinfer_mixed_sparse_indices`; compress ratios 0 (sliding window only), 1 and 2 (both through the
    indexer's top-k), the compressed K cache in the backend's 128-token kernel blocks on a kv-source layer, read by
    the layer itself or by a consumer (`kv_source`); SWA blocks of 32. Its objects come from dsv41_runtime, made
    with FlashInfer's layer class."""

    name = "vllm.dsv41.flashinfer"
    summary = ("DeepSeek-V4.1 sparse attention (FLASHINFER_MLA_SPARSE_DSV41, SM100): SWA + compressed-KV builders and "
               "the layer's forward_mqa over plain bf16/fp8 rows, packed or not, compress ratios 0/1/2, own or shared "
               "compressed cache")
    real_parts = ("DeepseekSparseSWAFlashInferMetadataBuilder (V4.1)", "DeepseekV4FlashInferSparseMLAMetadataBuilder (V4.1)",
                  "DeepseekV4FlashInferMLAAttention.forward_mqa (V4.1)",
                  "Triton: SWA indices/lens, compressed slot mapping, build_flashinfer_mixed_sparse_indices (V4.1)")
    version = "4.1"
    features = FLASHINFER_V41_FEATURES
    runtime = dsv41_runtime
    model = "DeepSeek-V4.1"
    config = staticmethod(dsv41_runtime.dsv41_config)
    step_config = staticmethod(dsv41_runtime.step_config)
    step_layer = staticmethod(fi_runtime.step_layer_v41)
    metadata_outputs = staticmethod(dsv41_runtime.metadata_outputs_v41)
    guard_compressed_builder = False

    def layer_sizes(self, case) -> dict:
        d = case.dsv4
        return dict(compress_ratio=d.compress_ratio, kv_source=d.kv_source, window_size=d.window_size,
                    swa_block_size=case.block_size, compressed_block_size=d.compressed_block_size,
                    num_heads=case.heads)
