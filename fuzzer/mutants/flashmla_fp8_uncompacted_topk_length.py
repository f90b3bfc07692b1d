"""Top-k length over uncompacted indices on the fp8 path (class B; vLLM 0.26.0's topk_length bug in
docs/bug-reports/vllm-0.26.0-flashmla-sparse-topk-length-in-place.md, issue 36616's family): where a KV
block spans several of the fp8 kernel's 64-token pages and other layers' pages sit between a layer's blocks
(`_fp8_kv_pages` returns a block stride above the block size), FlashMLA's fp8 separate prefill/decode path
converts a batch with prefills in place (uncompacted, -1s where the indexer put them) and hands the bf16
prefill kernel each row's count of valid entries as topk_length. The kernel reads only the first topk_length
entries, so a prefill row with a -1 before a valid entry loses valid entries (decode rows, which the fp8
decode kernel reads without a length, are unaffected, as are the bf16 and fp8 mixed-batch paths, 64-token
blocks and packed caches). Needs all of: kv_cache_dtype fp8_ds_mla; >= 32 heads per rank (the separate path);
block_size 128; block_stride_rows above the block size; a prefill in the batch; and a prefill row with
0 < valid < topk_width whose -1s are not all at its tail (invalid_at head / scattered / leading_tiles)."""

import ast
import inspect
import textwrap

from fuzzer.mutants._kernel_patch import patch_method

BUG_CLASS = "B"
TARGETS = ("vllm.flashmla_sparse",)


def apply():
    from vllm.v1.attention.backends.mla import flashmla_sparse

    method = flashmla_sparse.FlashMLASparseImpl._forward_fp8_kv_separate_prefill_decode
    src = ast.unparse(ast.parse(textwrap.dedent(inspect.getsource(method))))
    head = "topk_indices, topk_length = triton_convert_req_index_to_global_index("
    calls = [ln.strip() for ln in src.splitlines() if ln.strip().startswith(head) and "HAS_PREFILL_WORKSPACE" in ln]
    if len(calls) != 1 or not calls[0].endswith("return_valid_counts=True)"):
        raise RuntimeError("mutant flashmla-fp8-uncompacted-topk-length: the separate path's prefill conversion "
                           "not found in this vLLM's FlashMLASparseImpl._forward_fp8_kv_separate_prefill_decode")
    compacted = calls[0]
    in_place = compacted.replace(head, "topk_indices = triton_convert_req_index_to_global_index(").replace(
        "return_valid_counts=True)", "return_valid_counts=False)")
    patch_method(flashmla_sparse.__name__, "FlashMLASparseImpl", "_forward_fp8_kv_separate_prefill_decode",
                 [(compacted, "if block_stride_rows is None or block_stride_rows <= attn_metadata.block_size:\n"
                              f"            {compacted}\n"
                              "        else:\n"
                              f"            {in_place}\n"
                              "            topk_length = (topk_indices >= 0).sum(dim=-1, dtype=torch.int32)")],
                 "flashmla-fp8-uncompacted-topk-length")
