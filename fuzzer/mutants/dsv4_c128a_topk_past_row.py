"""C128A top-k metadata written past its row (class N; the bug vLLM's sparse_mla.py comment records): the builder
no longer passes its active top-k width to `build_c128a_topk_metadata`, whose kernel then iterates to its default
of 8192 entries per token and, at the buffers' row stride, spills -1s and slot ids into the following rows of the
persistent C128A buffers (the wrapper's width assert, added with the fix, taken out as before it). Found by the
guard on the builder's buffers: elements outside the step's view written. Needs a C128A (compress ratio 128) step."""

import ast
import inspect
import textwrap

from fuzzer.mutants._kernel_patch import patch_method

BUG_CLASS = "N"
TARGETS = ("vllm.dsv4.flashmla",)


def apply():
    from vllm.models.deepseek_v4 import sparse_mla

    fn = sparse_mla.build_c128a_topk_metadata
    src = ast.unparse(ast.parse(textwrap.dedent(inspect.getsource(fn))))
    check = "    assert 0 < max_compressed_tokens <= min(global_decode_buffer.shape[1], prefill_buffer.shape[1])\n"
    if check not in src:
        raise RuntimeError("mutant dsv4-c128a-topk-past-row: the width assert is not in this vLLM's build_c128a_topk_metadata")
    exec(compile(src.replace(check, ""), "<attnfuzz mutant dsv4-c128a-topk-past-row>", "exec"), vars(sparse_mla))
    patch_method(sparse_mla.__name__, "DeepseekV4SparseMLAMetadataBuilder", "_build_c128a_metadata",
                 [(", max_compressed_tokens=active_topk_width)", ")")], "dsv4-c128a-topk-past-row")
