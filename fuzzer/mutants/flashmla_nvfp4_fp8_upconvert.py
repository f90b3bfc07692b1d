"""An nvfp4_ds_mla cache upconverted as fp8_ds_mla (class E): FlashMLASparseImpl's separate prefill/decode path picks
the prefill's upconverting gather with `kv_cache_dtype in QUANTIZED_DS_MLA_CACHE_FORMATS` instead of `==
"fp8_ds_mla"`, so an SM100 nvfp4_ds_mla cache's 352-byte entries reach `cp_gather_and_upconvert_fp8_kv_cache`, which
reads 656-byte fp8_ds_mla entries. Found by the error (or, where the op reads on, the output) check; needs a prefill
at 32 heads or more (the separate path) on an nvfp4_ds_mla cache."""

from fuzzer.mutants._kernel_patch import patch_method

BUG_CLASS = "E"
TARGETS = ("vllm.flashmla_sparse.nvfp4",)


def apply():
    patch_method("vllm.v1.attention.backends.mla.flashmla_sparse", "FlashMLASparseImpl",
                 "_forward_fp8_kv_separate_prefill_decode",
                 [("elif self.kv_cache_dtype == 'fp8_ds_mla':",
                   "elif self.kv_cache_dtype in QUANTIZED_DS_MLA_CACHE_FORMATS:")],
                 "flashmla-nvfp4-fp8-upconvert")
