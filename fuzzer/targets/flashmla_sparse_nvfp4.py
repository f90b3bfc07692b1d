"""`vllm.flashmla_sparse.nvfp4`: vLLM's FlashMLA sparse-MLA backend (`FLASHMLA_SPARSE`) over the `nvfp4_ds_mla` cache,
as an SM100 host runs it, whole, on the MQA route.

The `vllm.flashmla_sparse` target's step (its builder, impl.forward_mqa on every token, traces and CUDA graphs) on
DeepSeek-V3.2's 352-byte NVFP4 entry (512 e2m1 NoPE, 64 e4m3 RoPE, 32 permuted e4m3 scales), which vLLM takes on
SM100 only: the builder is made as an SM100 host makes it (`fuzzer.support.flashmla_sm100_runtime`: decode threshold
and tile-scheduler buffer of the Blackwell family), kernel blocks of 64 (`get_supported_kernel_block_sizes`). Runs for
real: FlashMLASparseMetadataBuilder, FlashMLASparseImpl.forward_mqa's fp8 paths (mixed batch below 64 heads,
separate prefill/decode from 64: the upconverting gather into the bf16 workspace and the bf16 prefill kernel),
the index group and the index-remap Triton kernel. Stand-ins (no attnfuzz host has an SM100): FlashMLA's sparse
decode on the 352-byte entry, its bf16 prefill and planner, the cache writer (`concat_and_cache_mla` for
nvfp4_ds_mla, following vLLM's Triton writer of the entry) and `cp_gather_and_upconvert_nvfp4_kv_cache`, whose
contracts for this entry are not public (FlashMLA's public repository has no NVFP4 decode; vLLM's CUDA sources are
not in its wheel). The oracle reads the entries with its own decoder (oracles/nvfp4_ds_mla.py).
"""

from __future__ import annotations

import torch

from fuzzer.repro_spec import Call
from fuzzer.support.vllm_setup import has_cache_op
from fuzzer.support.flashmla_sm100_runtime import SM100_SHIM, flashmla_sparse_sm100_backend, sparse_mla_engine_sm100
from fuzzer.support.sparse_mla_steps import prepare_host
from fuzzer.support.standins.flashmla_ops import NVFP4_ENTRY_BYTES, concat_and_cache_mla
from fuzzer.targets.base import WHOLE, RunPlan
from fuzzer.targets.flashmla_sparse import FlashMLASparse
from fuzzer.targets.harness import paged_cache
from strategies.batches import AttentionFeatures, attention_space

NOT_PUBLIC = ("FlashMLA's SM100 sparse decode of the nvfp4_ds_mla entry and vLLM's compiled writer and upconverting "
              "gather of it are not public (FlashMLA's repository has no NVFP4 decode; vLLM's csrc is not in its "
              "wheel): the stand-ins follow vLLM's docstrings, its Triton writer of the entry and the fp8 ops beside "
              "them; the reciprocal of a scale is IEEE here, where Triton's fp32 division on a GPU is div.full")


class FlashMLASparseNvfp4(FlashMLASparse):
    name = "vllm.flashmla_sparse.nvfp4"
    summary = ("FlashMLA sparse-MLA backend (FLASHMLA_SPARSE) on SM100's nvfp4_ds_mla cache: builder + "
               "impl.forward_mqa, 352-byte NVFP4 entries")
    bug_classes = "B C D E G H I J K M"
    kv_cache_dtypes = ("nvfp4_ds_mla",)
    BLOCK_SIZES = (64,)  # FlashMLASparseBackend.get_supported_kernel_block_sizes: a quantized cache on SM100

    def unavailable(self) -> str | None:
        if self.device != "cpu" and torch.cuda.get_device_capability()[0] != 10:
            # FlashMLA's compiled kernels here are this GPU's, which refuse the NVFP4 entry (vLLM takes it on SM100
            # only); the stand-ins of SM100's kernels run on a CPU
            return (f"nvfp4_ds_mla is SM100's: this GPU (sm_{''.join(map(str, torch.cuda.get_device_capability()))}) "
                    "runs FlashMLA kernels that refuse it; run on a CPU (SM100's kernels emulated) or an SM100")
        try:
            flashmla_sparse_sm100_backend(self.device)
        except Exception as e:
            return f"cannot import vLLM's {self.vllm_backend} backend: {type(e).__name__}: {e}"
        return None

    def prepare(self) -> None:
        super().prepare()
        self.backend, self.emulated, _ = prepare_host(flashmla_sparse_sm100_backend, self.device)
        self.shims = [*self.shims, SM100_SHIM]

    def cases(self, profile, plan: RunPlan = WHOLE):
        return attention_space(profile, AttentionFeatures(kv_cache_dtypes=plan.kv_dtypes(self),
                                                          block_sizes=self.BLOCK_SIZES,
                                                          block_stride_rows=self.has_block_stride_rows(),
                                                          cudagraph_padding=True, traces=True,
                                                          cudagraph_modes=plan.graph_modes(self), mtp_draft=False))

    @staticmethod
    def cache(case, device, guards=None, name: str = "kv_cache"):
        """The paged cache of 352-byte entries, every byte 0xFF (e4m3 NaN scales and RoPE, e2m1 -6 NoPE)."""
        return paged_cache(case, device, dtype=torch.uint8, width=NVFP4_ENTRY_BYTES, poison=255, guards=guards,
                           name=name)

    def writer(self, case):
        """(write(kv_c, k_pe, cache, slots), emulated op name or None): vLLM's compiled writer where the host has it
        for an SM100, else the stand-in (`concat_and_cache_mla` for nvfp4_ds_mla)."""
        if self.device != "cpu" and has_cache_op("concat_and_cache_mla") and torch.cuda.get_device_capability()[0] == 10:
            op = torch.ops._C_cache_ops.concat_and_cache_mla
            return (lambda kv_c, k_pe, cache, slots: op(kv_c, k_pe, cache, slots, "nvfp4_ds_mla",
                                                        torch.ones((), device=cache.device))), None
        return (lambda kv_c, k_pe, cache, slots: concat_and_cache_mla(kv_c, k_pe, cache, slots, "nvfp4_ds_mla",
                                                                      None)), "concat_and_cache_mla"

    def new_engine(self, ctx, step) -> None:
        engine = ctx.engine
        engine["builder"], engine["impl"] = sparse_mla_engine_sm100(self.backend, ctx.spec, ctx.cfg, step.heads,
                                                                    step.kv_cache_dtype, ctx.topk_buffer, self.device)
        engine["layer"] = None

    def finish(self, obs, case, slots, cache, before, write_emulated, overruns, guards):
        obs = super().finish(obs, case, slots, cache, before, write_emulated, overruns, guards)
        obs.notes["not_public"] = NOT_PUBLIC
        return obs

    def repro_prepare(self, layer: bool, case=None) -> tuple[Call, ...]:
        return (Call(prepare_host, dict(load_backend=flashmla_sparse_sm100_backend, device="DEVICE"),
                     assign="backend, emulated, shims"),)

    def repro_engine(self, case, layer: bool) -> Call:
        return Call(sparse_mla_engine_sm100, dict(backend="backend", spec="spec", cfg="cfg", heads="HEADS",
                                                  kv_cache_dtype="KV_CACHE_DTYPE",
                                                  topk_indices_buffer="topk_indices_buffer", device="DEVICE"),
                    assign="builder, impl")



