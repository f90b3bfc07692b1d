"""Rebuild vLLM's index-remap Triton kernel with source edits (shared by the kernel-level mutants)."""

import ast
import inspect
import linecache
import textwrap


def patch_remap_kernel(edits, label):
    """Replace the remap kernel by its source with `edits` ((old, new) pairs) applied."""
    import triton
    from vllm.v1.attention.backends.mla import sparse_utils as su

    holder = getattr(su, "ConvertReqIndexToGlobalIndexKernel", None)  # 0.27+: a warmup-aware wrapper
    jit = holder.kernel if holder is not None else su._convert_req_index_to_global_index_kernel
    fn = getattr(jit, "fn", jit)
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    tree.body[0].decorator_list = []
    src = ast.unparse(tree)
    for old, new in edits:
        if old not in src:
            raise RuntimeError(f"mutant {label}: `{old}` not found in this vLLM's {fn.__name__}")
        src = src.replace(old, new)
    filename = f"<attnfuzz mutant {label}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)  # Triton reads the source
    namespace = dict(vars(su))
    exec(compile(src, filename, "exec"), namespace)
    mutated = triton.jit(namespace[fn.__name__])
    if holder is not None:
        holder.kernel = mutated
    else:
        su._convert_req_index_to_global_index_kernel = mutated
    return mutated
