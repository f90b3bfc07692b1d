"""Seed bug 2 (class E; vLLM issue 48611, bug 2, from PR 47327): the dense-MHA path gathers an fp8_ds_mla
cache's context with the generic gather, which reads each 656-byte entry's first 576 bytes as flat e4m3
with one global scale, instead of `cp_gather_and_upconvert_fp8_kv_cache`, which knows the layout. Cached
context (a prefix-cache hit or chunked context) of a short prefill is silently corrupted."""

from fuzzer.mutants._kernel_patch import patch_method

BUG_CLASS = "E"
TARGETS = ("vllm.flashmla_sparse.layer",)


def apply():
    patch_method("vllm.model_executor.layers.attention.mla_attention", "MLACommonBaseImpl", "_compute_prefill_context",
                 [("if self.kv_cache_dtype == 'fp8_ds_mla':", "if False:")], "mha-context-flat-fp8-gather")
