"""fuzzer/mutants/_kernel_patch.py: each function a mutant rewrites keeps a source of its own that inspect (and so
Triton's interpreter, which reads a kernel's source back to run it) finds, however many one mutant rewrites."""

import inspect
import sys

from fuzzer.mutants._kernel_patch import _rewritten


def kernel(x):
    return x + 1


def method(x):
    return x * 2


def test_two_functions_rewritten_by_one_mutant_keep_their_own_sources():
    scope = vars(sys.modules[__name__])
    new_kernel = _rewritten(kernel, [("x + 1", "x + 10")], "one-mutant", "kernel", scope)
    new_method = _rewritten(method, [("x * 2", "x * 20")], "one-mutant", "method", scope)
    assert (new_kernel(1), new_method(1)) == (11, 20)
    assert "def kernel" in inspect.getsource(new_kernel) and "x + 10" in inspect.getsource(new_kernel)
    assert "def method" in inspect.getsource(new_method)
