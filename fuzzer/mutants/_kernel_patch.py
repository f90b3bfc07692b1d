"""Rebuild one of vLLM's Triton kernels from its source with edits (shared by the kernel-level mutants)."""

import ast
import importlib
import inspect
import linecache
import textwrap


def mutate_jit(jit, namespace, edits, label):
    """A new Triton kernel: `jit`'s source with `edits` ((old, new) pairs) applied, defined in `namespace`."""
    import triton

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
    scope = dict(namespace)
    exec(compile(src, filename, "exec"), scope)
    return triton.jit(scope[fn.__name__])


def patch_kernel(module_name, kernel_name, edits, label):
    """Replace the module-level kernel `kernel_name`, which its callers look up at call time."""
    module = importlib.import_module(module_name)
    setattr(module, kernel_name, mutate_jit(getattr(module, kernel_name), vars(module), edits, label))


def patch_kernel_class(module_name, class_name, edits, label):
    """Replace the kernel a VllmTritonJitKernel class holds (`Class.kernel`, which its instances launch)."""
    module = importlib.import_module(module_name)
    holder = getattr(module, class_name)
    holder.kernel = mutate_jit(holder.kernel, vars(module), edits, label)


def patch_remap_kernel(edits, label):
    """Replace the sparse-MLA index-remap kernel, wherever the installed release keeps it."""
    from vllm.v1.attention.backends.mla import sparse_utils as su

    holder = getattr(su, "ConvertReqIndexToGlobalIndexKernel", None)  # 0.27+: a warmup-aware wrapper class
    if holder is None:
        patch_kernel(su.__name__, "_convert_req_index_to_global_index_kernel", edits, label)
    else:
        holder.kernel = mutate_jit(holder.kernel, vars(su), edits, label)


def patch_method(module_name, class_name, method_name, edits, label):
    """Replace a method of one of vLLM's classes by its source with `edits` applied."""
    module = importlib.import_module(module_name)
    cls = getattr(module, class_name)
    fn = getattr(cls, method_name)
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    src = ast.unparse(tree)
    for old, new in edits:
        if old not in src:
            raise RuntimeError(f"mutant {label}: `{old}` not found in this vLLM's {class_name}.{method_name}")
        src = src.replace(old, new)
    scope = dict(vars(module))
    exec(compile(src, f"<attnfuzz mutant {label}>", "exec"), scope)
    setattr(cls, method_name, scope[method_name])


ROW_CHECKS = ("req_id.shape[0]==token_indices.shape[0]", "valid_counts_out.shape==(num_tokens,)")


def converter_without_checks(checks=ROW_CHECKS, scope=None):
    """vLLM's index converter with the asserts whose tests are `checks` (spaces removed) taken out, defined in
    `scope` (default: sparse_utils' own namespace, where its callers look it up); returns it."""
    from vllm.v1.attention.backends.mla import sparse_utils

    fn = sparse_utils.triton_convert_req_index_to_global_index
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))

    class DropChecks(ast.NodeTransformer):
        def visit_Assert(self, node):
            return None if ast.unparse(node.test).replace(" ", "") in checks else node

    scope = vars(sparse_utils) if scope is None else scope
    exec(compile(ast.fix_missing_locations(DropChecks().visit(tree)), inspect.getsourcefile(fn), "exec"), scope)
    return scope[fn.__name__]
