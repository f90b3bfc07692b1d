"""Seed bug, kernel level (class A; vLLM issue 48611, bug 1): the index converter launches its kernel
without the check vLLM added in the fix, so a call with the full-batch req_id_per_token and only the
MQA rows of topk_indices sizes the grid by req_id and writes past the output sized like topk_indices."""

import ast
import inspect
import textwrap

BUG_CLASS = "A"
TARGETS = ("vllm.index_remap",)


def apply():
    from vllm.v1.attention.backends.mla import sparse_utils

    fn = sparse_utils.triton_convert_req_index_to_global_index
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))

    class DropRowCheck(ast.NodeTransformer):
        def visit_Assert(self, node):
            src = ast.unparse(node.test).replace(" ", "")
            return None if src == "req_id.shape[0]==token_indices.shape[0]" else node

    tree = ast.fix_missing_locations(DropRowCheck().visit(tree))
    # Defined in the module's own namespace, so vLLM's callers pick it up as they would the original.
    exec(compile(tree, inspect.getsourcefile(fn), "exec"), vars(sparse_utils))
