"""The harness every reproducer runs its vLLM calls under: exit 2 where vLLM gave no answer (an import or the
set-up failed, a name or signature this vLLM lacks, attnfuzz's bounds checker broke, a stand-in refused a call form it
does not model, a CPU host's torch refused a device query vLLM made), else 1 while the bug is present and 0 once fixed. `fuzzer.artifacts.repro` copies this module
verbatim into the reproducer's attnfuzz_support.py (standard library only: it guards the imports of torch and vLLM).
"""

import contextlib
import sys
import traceback


def could_not_run(stage, e):  # exit 2: no answer from vLLM, so nothing about the bug
    traceback.print_exception(e, limit=-4)
    print(f"COULD NOT RUN ({stage}): {type(e).__name__}: {e} - this says nothing about the bug (exit 2)")
    return 2


def vllms_answer(e):  # judged, unless a name or signature this vLLM lacks (met in the script or in attnfuzz's
    # support code) or attnfuzz's bounds checker breaking (the error, or one it was raised from, passed through it)
    frames = [f.filename for f in traceback.extract_tb(e.__traceback__)  # (a layer's missing attribute: the frame
              if not (f.name == "__getattr__" and f.filename.endswith("torch/nn/modules/module.py"))]  # that asked)
    script = getattr(sys.modules["__main__"], "__file__", None)
    ours = frames[-1] in (script, __file__) or frames[-1].startswith("<attnfuzz_support")
    chain, cause = [], e
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    chain = [f.filename for c in chain for f in traceback.extract_tb(c.__traceback__)]
    torch = sys.modules.get("torch")  # a CPU host's torch refusing a device query vLLM made: the host's, not vLLM's
    asked_device = torch is not None and not torch.cuda.is_available() and not isinstance(
        e, getattr(torch, "AcceleratorError", ())) and any(f"/torch/{p}/" in frames[-1] for p in ("accelerator", "cuda"))
    return not (isinstance(e, (ImportError, NameError)) or isinstance(e, (TypeError, AttributeError)) and ours
                or any("fuzzer.support.interp.sanitizer" in f for f in chain) or asked_device
                or getattr(e, "attnfuzz_refused", False))  # an attnfuzz stand-in refused a form it does not model


@contextlib.contextmanager
def stage(name):  # `with stage("the set-up"):` a step before vLLM's answer; an exception in it exits 2
    try:
        yield
    except Exception as e:
        sys.exit(could_not_run(name, e))


class vllm_call:
    """`with vllm_call(checker) as call:` the vLLM calls. What they raise is vLLM's answer, kept in `call.error` for
    the script to judge, unless `vllms_answer` says otherwise (exit 2); `call.problems`: what the bounds checker
    (`checker`, None on a GPU) saw meanwhile."""

    def __init__(self, checker=None):
        self.collect = contextlib.nullcontext([]) if checker is None else checker.collect()
        self.error, self.problems = None, []

    def __enter__(self):
        self.seen = self.collect.__enter__()
        return self

    def __exit__(self, kind, e, tb):
        self.collect.__exit__(None, None, None)
        if isinstance(e, Exception) and not vllms_answer(e):
            sys.exit(could_not_run("the call", e))
        self.problems = [v.describe() for v in self.seen]
        self.error = e if isinstance(e, Exception) else None
        self.raised = f"raised {type(e).__name__}: {e}" if self.error is not None else None
        return self.error is not None


def verdict(problems):  # prints each problem; the exit code: 1 with the bug present, 0 fixed
    for p in problems:
        print("BUG:", p)
    version = getattr(sys.modules.get("vllm"), "__version__", "(not imported)")
    print("vLLM", version, "-", "bug present" if problems else "no bug: fixed")
    return 1 if problems else 0


def run(main):  # exits with main()'s code; 2 where the check itself failed
    try:
        code = main()
    except Exception as e:  # in the check itself
        code = could_not_run("the check", e)
    sys.exit(code)
