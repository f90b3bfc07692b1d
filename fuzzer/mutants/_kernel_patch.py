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
    return triton.jit(_rewritten(fn, edits, label, fn.__name__, namespace))


def _rewritten(fn, edits, label, where, namespace, keep_decorators=False):
    """`fn` defined anew in a copy of `namespace` from its source (its decorators dropped unless kept) with `edits`
    applied; `where` names it when an edit's text is not found. An edit is an (old, new) pair, or a tuple of such
    pairs where releases word the same code differently: the first whose old text this release has is applied."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    if not keep_decorators:
        tree.body[0].decorator_list = []
    src = ast.unparse(tree)
    for edit in edits:
        alternatives = edit if isinstance(edit[0], tuple) else (edit,)
        found = [(old, new) for old, new in alternatives if old in src]
        if not found:
            raise RuntimeError(f"mutant {label}: `{'` or `'.join(old for old, _ in alternatives)}` not found in this "
                               f"vLLM's {where}")
        src = src.replace(*found[0])
    # One file name per rewritten function: Triton's interpreter reads a kernel's source back by its file name, and a
    # mutant that rewrites a kernel and a method under one name would hand it the method's.
    filename = f"<attnfuzz mutant {label}: {where}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)  # Triton reads the source
    scope = dict(namespace)
    exec(compile(src, filename, "exec"), scope)
    return scope[fn.__name__]


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
    setattr(cls, method_name, _rewritten(getattr(cls, method_name), edits, label, f"{class_name}.{method_name}",
                                         vars(module), keep_decorators=True))


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


# The converter's call modes, each a specialisation of the remap kernel a call site selects: a test over the
# converter's own arguments that holds in that mode. "valid_counts" is counting on one tile (an in-register count;
# 0.33 compacts there too), "compaction" counting on the multi-tile path (the atomic slot allocator, widths past
# 4096 that are not powers of two); the others are the argument that switches them on, "plain" none of them.
CALL_MODES = {
    "plain": ("not return_valid_counts and not HAS_PREFILL_WORKSPACE and idx_mapping is None"
              " and BLOCK_STRIDE_ROWS in (None, BLOCK_SIZE)"),
    "valid_counts": "return_valid_counts and _remap_tiling(NUM_TOPK_TOKENS, BLOCK_N, True)[0]",
    "compaction": "return_valid_counts and not _remap_tiling(NUM_TOPK_TOKENS, BLOCK_N, True)[0]",
    "prefill_workspace": "HAS_PREFILL_WORKSPACE",
    "idx_mapping": "idx_mapping is not None",
    "block_stride": "BLOCK_STRIDE_ROWS not in (None, BLOCK_SIZE)",
}


def converter_without_row_check_in(mode, scope=None):
    """vLLM's index converter whose row check (req_id and token_indices cover the same tokens) is skipped in one
    call mode (CALL_MODES) and kept in every other, defined in `scope` (default: sparse_utils' own namespace, where
    its callers look it up); returns it."""
    from vllm.v1.attention.backends.mla import sparse_utils

    fn = sparse_utils.triton_convert_req_index_to_global_index
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    in_mode = ast.parse(CALL_MODES[mode], mode="eval").body
    names = {n.id for n in ast.walk(in_mode) if isinstance(n, ast.Name)}
    missing = sorted(names - set(inspect.signature(fn).parameters) - set(vars(sparse_utils)) - {"None"})
    if missing:
        raise RuntimeError(f"mutant call mode {mode}: {', '.join(missing)} not found in this vLLM's {fn.__name__}")
    found = []

    class SkipInMode(ast.NodeTransformer):
        def visit_Assert(self, node):
            if ast.unparse(node.test).replace(" ", "") == ROW_CHECKS[0]:
                found.append(node)
                node.test = ast.BoolOp(ast.Or(), [node.test, in_mode])
            return node

    tree = ast.fix_missing_locations(SkipInMode().visit(tree))
    if not found:
        raise RuntimeError(f"mutant call mode {mode}: the row check `{ROW_CHECKS[0]}` not found in this vLLM's "
                           f"{fn.__name__}")
    scope = vars(sparse_utils) if scope is None else scope
    exec(compile(tree, inspect.getsourcefile(fn), "exec"), scope)
    return scope[fn.__name__]


def patch_function(module_name, function_name, edits, label):
    """Rewrite one of vLLM's module-level functions in place: its source with `edits` applied, compiled in its
    module, and the new code set on the same function object, so that every name bound to it (other modules'
    imports, a torch custom op registered over it: the indexer's `sparse_attn_indexer`) runs the edit."""
    module = importlib.import_module(module_name)
    fn = getattr(module, function_name)
    fn = inspect.unwrap(fn)  # under vLLM's decorators (eager_break_during_capture) and attnfuzz's coverage probe
    # Its decorators dropped: the decorated object keeps calling the function object whose code changes.
    fn.__code__ = _rewritten(fn, edits, label, function_name, vars(module)).__code__
