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
No standalone reproducer yet (findings keep case.json).
"""

from __future__ import annotations

import torch

from fuzzer.env import STATE_DIR
from fuzzer.support import dsv4_runtime as runtime
from fuzzer.support.flashmla_runtime import _try_import, define_missing_c_queries
from fuzzer.support.interp.corrections import CORRECTIONS, install_corrections
from fuzzer.support.standins.cpu_shims import install_cpu_shims
from fuzzer.targets.base import Target
from fuzzer.targets.probes import observe_paths
from oracles.dsv4 import judge_dsv4
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
# The builders' persistent buffers whose rows a step owns only through the views its metadata holds: a write
# outside them is a metadata kernel running past its rows (the C128A fix in sparse_mla.py, class N).
GUARDED = {"swa": (("decode_swa_indices", "decode_swa_indices"), ("prefill_swa_indices", "prefill_swa_indices"),
                   ("prefill_swa_lens", "prefill_swa_lens")),
           "compressed": (("c128a_global_decode_buffer", "c128a_global_decode_topk_indices"),
                          ("c128a_decode_lens_buffer", "c128a_decode_topk_lens"),
                          ("c128a_prefill_buffer", "c128a_prefill_topk_indices"))}
BUFFER_POISON = 2**30 - 1


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

    def unavailable(self) -> str | None:
        for module in (runtime.FLASHMLA_LAYER_MODULE, runtime.SPARSE_MLA_MODULE, runtime.SWA_MODULE):
            try:
                if _try_import(module) is None:
                    return f"this vLLM has no {module} (DeepSeek-V4 attention)"
            except Exception as e:  # a module that is there but cannot import here
                return f"cannot import {module}: {type(e).__name__}: {e}"
        return None

    def prepare(self) -> None:
        self.shims: list[str] = list(define_missing_c_queries())
        if self.device == "cpu":
            install_corrections()
            self.shims += [*install_cpu_shims(), *runtime.cpu_shims(),
                           *(f"interpreter correction: {c}" for c in CORRECTIONS)]
        self.shims.append("DeepseekV4FlashMLAAttention made without __init__ (it needs a TP group, linears, CUDA "
                          "events and DeepGEMM): the attributes forward_mqa reads set as __init__ sets them")
        self.emulated = (*runtime.install_standins(self.device), WRITER)
        self.real_parts = type(self).real_parts + (("FlashMLA's CUDA kernels (vllm._flashmla_C)",)
                                                   if "flash_mla_with_kvcache" not in self.emulated else ())
        self.cfg = runtime.dsv4_config(self.device, str(STATE_DIR))

    def cases(self, profile):
        return dsv4_space(profile, Dsv4Features())

    def run(self, case):
        from vllm.config import set_current_vllm_config  # deferred: vLLM loads after fuzzer.env prepares the process
        from vllm.forward_context import set_forward_context

        dev, d = self.device, case.dsv4
        inputs = materialize_dsv4_inputs(case, dev)
        cfg = runtime.configure(self.cfg, window_size=d.window_size, index_topk=case.topk_width,
                                num_speculative_tokens=d.num_speculative_tokens,
                                max_num_batched_tokens=case.num_actual_tokens + 16, max_model_len=d.max_model_len)
        layer_cls = _try_import(runtime.FLASHMLA_LAYER_MODULE).DeepseekV4FlashMLAAttention
        swa_raw = swa_pages(case, inputs, num_blocks(case.block_table), dev)
        comp_raw = None
        if d.compress_ratio > 1:
            comp_raw = compressed_pages(case, inputs, num_blocks(d.compressed_block_table), dev)
        topk_buffer = torch.full((cfg.scheduler_config.max_num_batched_tokens, case.topk_width), TOPK_POISON,
                                 dtype=torch.int32, device=dev)
        topk_buffer[: case.num_actual_tokens] = inputs.topk_indices
        notes: dict = {"shims": tuple(self.shims)}

        def call():
            outputs: dict = {}
            # vLLM's objects are made inside the observed call: what they raise is an observation, not ours.
            swa_layer = runtime.swa_cache_layer(cfg, d.window_size, case.block_size)
            swa_spec = swa_layer.get_kv_cache_spec(cfg)
            assert swa_raw.shape[1] == swa_spec.page_size_bytes, (swa_raw.shape, swa_spec.page_size_bytes)
            swa_layer.kv_cache = runtime.paged(swa_raw, case.block_size)
            kv_cache = None
            if comp_raw is not None:
                spec = runtime.compressed_spec(d.compress_ratio)
                assert comp_raw.shape[1] == spec.page_size_bytes, (comp_raw.shape, spec.page_size_bytes)
                kv_cache = runtime.paged(comp_raw, d.entries_per_block)
            heads = layer_cls.get_padded_num_q_heads(case.heads)  # vLLM's padding of the layer's q heads
            assert heads == inputs.q.shape[1], (heads, inputs.q.shape)
            layer = runtime.attention_layer(cfg, d.compress_ratio, swa_layer, kv_cache, topk_buffer,
                                            inputs.attn_sink.clone())
            with set_current_vllm_config(cfg), torch.inference_mode():
                swa_builder = layer_cls.swa_backend_cls.get_builder_cls()(swa_spec, [swa_layer.prefix], cfg,
                                                                          torch.device(dev))
                builders = {"swa": swa_builder}
                metadata = {swa_layer.prefix: None}
                if d.compress_ratio > 1:
                    builders["compressed"] = layer_cls.backend_cls.get_builder_cls()(spec, [runtime.LAYER], cfg,
                                                                                     torch.device(dev))
                poisoned = {k: _poison(b, GUARDED[k]) for k, b in builders.items()}
                metadata[swa_layer.prefix] = swa_md = swa_builder.build(0, _common_metadata(case, inputs, "swa", dev))
                if "compressed" in builders:
                    metadata[runtime.LAYER] = builders["compressed"].build(0, _common_metadata(case, inputs,
                                                                                               "compressed", dev))
                overruns = [m for k, b in builders.items()
                            for m in _overruns(b, metadata[runtime.LAYER if k == "compressed" else swa_layer.prefix],
                                               GUARDED[k], poisoned[k])]
                if overruns:
                    notes["buffer_overrun"] = overruns
                outputs.update(_metadata_outputs(swa_md, metadata.get(runtime.LAYER)))
                before = [swa_raw.clone(), None if comp_raw is None else comp_raw.clone()]
                out = torch.full_like(inputs.q, float("nan"))
                with set_forward_context({k: v for k, v in metadata.items() if v is not None}, cfg):
                    layer.forward_mqa(inputs.q, None, inputs.positions, out)
            changed = [f"{name} cache: {int((after != was).any(dim=1).sum())} of {len(was)} pages"
                       for name, after, was in (("SWA", swa_raw, before[0]), ("compressed", comp_raw, before[1]))
                       if was is not None and not torch.equal(after, was)]
            if changed:
                notes["cache_changed"] = "; ".join(changed)
            outputs.update(out=out, swa_pages=swa_raw, compressed_pages=comp_raw)
            return outputs

        obs = observe_paths(self.observe, call)
        obs.notes.update(notes)
        obs.emulated = self.emulated
        return obs

    def repro_spec(self, finding):
        return None  # not yet: a finding keeps its case.json, which `attnfuzz replay` re-runs


def _common_metadata(case, inputs, group: str, dev: str):
    """The runner's CommonAttentionMetadata for one KV-cache group of the step: the SWA cache's (its block table and
    slots) or the compressed K cache's (its table of 256-token blocks and the tokens' slots in it)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata  # deferred: vLLM loads after fuzzer.env

    if group == "swa":
        table, slots = inputs.block_table, inputs.slot_mapping
    else:
        table = inputs.compressed_block_table
        real = inputs.token_request >= 0
        rows = table[inputs.token_request.clamp(min=0)].long()
        pos = inputs.positions
        blocks = rows.gather(1, (pos // runtime.BLOCK_SIZE)[:, None].clamp(max=table.shape[1] - 1)).flatten()
        slots = torch.where(real, blocks * runtime.BLOCK_SIZE + pos % runtime.BLOCK_SIZE, -1)
    seq_lens = inputs.seq_lens
    return CommonAttentionMetadata(
        query_start_loc=inputs.query_start_loc.clone(), query_start_loc_cpu=inputs.query_start_loc.cpu(),
        seq_lens=seq_lens.clone(), num_reqs=len(case.requests), num_actual_tokens=case.num_actual_tokens,
        max_query_len=max(r.query_len for r in case.requests), max_seq_len=max(r.seq_len for r in case.requests),
        block_table_tensor=table.clone(), slot_mapping=slots.to(dev), positions=inputs.positions.clone(),
        seq_lens_cpu_upper_bound=seq_lens.cpu())


def _metadata_outputs(swa_md, md) -> dict:
    """What the builders made that the oracle checks against its definition (outputs "md.<name>")."""
    out = {"md.split": torch.tensor([swa_md.num_decodes, swa_md.num_prefills, swa_md.num_decode_tokens,
                                     swa_md.num_prefill_tokens]),
           "md.token_to_req_indices": swa_md.token_to_req_indices, "md.is_valid_token": swa_md.is_valid_token,
           "md.decode_swa_indices": swa_md.decode_swa_indices if swa_md.num_decode_tokens else None,
           "md.decode_swa_lens": swa_md.decode_swa_lens if swa_md.num_decode_tokens else None,
           "md.prefill_swa_indices": swa_md.prefill_swa_indices, "md.prefill_swa_lens": swa_md.prefill_swa_lens,
           "md.prefill_gather_lens": swa_md.prefill_gather_lens}
    if md is not None:
        out.update({"md.compressed_slot_mapping": md.slot_mapping,
                    "md.c128a_decode_indices": md.c128a_global_decode_topk_indices,
                    "md.c128a_decode_lens": md.c128a_decode_topk_lens,
                    "md.c128a_prefill_indices": md.c128a_prefill_topk_indices})
    return {k: v.clone() for k, v in out.items() if v is not None}


def _poison(builder, guarded) -> dict:
    """Fill the builder's guarded buffers (those it has) with BUFFER_POISON; returns them by name."""
    buffers = {name: getattr(builder, name) for name, _ in guarded if getattr(builder, name, None) is not None}
    for buffer in buffers.values():
        buffer.fill_(BUFFER_POISON)
    return buffers


def _overruns(builder, metadata, guarded, buffers) -> list[str]:
    """Elements of each guarded buffer written outside the view the step's metadata holds of it."""
    found = []
    for name, field in guarded:
        buffer = buffers.get(name)
        if buffer is None:
            continue
        allowed = torch.zeros(buffer.numel(), dtype=torch.bool, device=buffer.device)
        view = getattr(metadata, field, None)
        if view is not None and view.numel() and view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
            index = torch.arange(buffer.numel(), device=buffer.device)
            allowed[torch.as_strided(index, view.shape, view.stride(),
                                     view.storage_offset() - buffer.storage_offset()).flatten()] = True
        written = (buffer.flatten() != BUFFER_POISON) & ~allowed
        if written.any():
            where = written.nonzero().flatten()
            row = buffer.stride(0) if buffer.dim() > 1 else 1
            found.append(f"{name}: {int(written.sum())} elements outside the step's view "
                         f"{tuple(view.shape) if view is not None else '(none)'} written (rows "
                         f"{int(where[0]) // row}..{int(where[-1]) // row} of {buffer.shape[0]})")
    return found
