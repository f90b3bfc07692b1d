"""Top-k length not passed (class B; vLLM issue 36616's family): the index converter compacts each row's valid
entries to the front and, since the kernel is told how many there are, leaves the rest of the row as it found
it; FlashMLA's bf16 call then drops `topk_length`, so the kernel reads the stale entries past each row's valid
count as indices."""

import ast
import inspect
import textwrap

from fuzzer.mutants._kernel_patch import patch_method, patch_remap_kernel

BUG_CLASS = "B"
TARGETS = ("vllm.flashmla_sparse", "vllm.flashmla_sparse.layer")


def apply():
    from vllm.model_executor.layers.attention import sparse_mla_attention
    from vllm.v1.attention.backends.mla import flashmla_sparse, index_group, sparse_utils

    # The kernel no longer writes -1 past the valid count (the single-tile path pads its own row) ...
    patch_remap_kernel([("-1, mask=(indice_id >= tile_valid_count) & (indice_id < NUM_TOPK_TOKENS)",
                         "-1, mask=indice_id < 0")], "flashmla-topk-length-dropped")
    # ... nor does the wrapper pre-fill rows with -1 (the multi-tile path).
    fn = sparse_utils.triton_convert_req_index_to_global_index
    src = ast.unparse(ast.parse(textwrap.dedent(inspect.getsource(fn))))
    for old, new in (("torch.full_like(token_indices_c, -1)", "torch.empty_like(token_indices_c)"),
                     ("out.fill_(-1)", "pass")):
        if old not in src:
            raise RuntimeError(f"mutant flashmla-topk-length-dropped: `{old}` not in this vLLM's converter")
        src = src.replace(old, new)
    exec(compile(src, "<attnfuzz mutant flashmla-topk-length-dropped>", "exec"), vars(sparse_utils))
    for module in (index_group, sparse_mla_attention, flashmla_sparse):  # bound by name at their import
        module.triton_convert_req_index_to_global_index = sparse_utils.triton_convert_req_index_to_global_index
    # The bf16 call no longer passes the valid counts.
    patch_method(flashmla_sparse.__name__, "FlashMLASparseImpl", "_bf16_flash_mla_kernel",
                 [("topk_length=topk_length", "topk_length=None")], "flashmla-topk-length-dropped")
