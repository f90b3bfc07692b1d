"""The errors of attnfuzz's support code (fuzzer/support/). Reproducers ship these modules without the rest of
attnfuzz, so they cannot raise from fuzzer/errors.py: every exception class of fuzzer/support/ is defined here."""

from __future__ import annotations

import torch

# What PyTorch raises for a CUDA error (torch >= 2.8); a reproducer may meet an older torch, which raised RuntimeError.
CUDA_ERROR = getattr(torch, "AcceleratorError", RuntimeError)


class RankFailed(RuntimeError):
    """Another rank raised, so this one's collective can never complete (fuzzer/support/dcp_group.py)."""


class EmptyLaunch(CUDA_ERROR):
    """A stand-in asked for what its CUDA op launches with an empty grid: the launch fails (cudaErrorInvalidValue)
    and, unchecked, PyTorch raises it (an AcceleratorError) at the next kernel launch; the stand-in raises at the call
    instead (fuzzer/support/standins/cache_ops.py)."""


class _BackendPlanUnsupportedError(ValueError):
    """FlashInfer's typed preflight rejection (`_backends/_capabilities.py`): raised to the caller of an explicitly
    requested backend (the stand-in fuzzer/support/standins/flashinfer_mla.py keeps FlashInfer's name for it)."""


class CheckerBroke(TypeError):
    """Triton's interpreter called a bounds-checked entry point in a way it cannot take (a Triton release that passes
    other arguments): attnfuzz's failure, never the kernel's (fuzzer/support/interp/sanitizer.py)."""


class CallMoved(TypeError):
    """A vLLM call attnfuzz makes does not fit the installed release where Python would not say so at the call: what
    it returned has another shape, or the method it calls is only declared (abstract) in this release's class
    (fuzzer/support/vllm_calls.py). A TypeError raised in attnfuzz's own frame, as a renamed keyword's is: a
    campaign (fuzzer/targets/vllm_api.py `moved_call`) and a reproducer (its harness) both say they could not test,
    naming the call, and never judge it."""


class StandInRefused(NotImplementedError):
    """A stand-in was called in a form it does not model (a call form the backends it stands in for never make): the
    case could not be tested, which says nothing about vLLM. Targets report it as could-not-test (exit 2), and a
    reproducer's harness as "could not run" (`attnfuzz_refused`)."""

    attnfuzz_refused = True


class OffPath(StandInRefused):
    """vLLM called a compiled op its case's path never calls: a reproducer binds the stand-ins of the path it was
    rendered for (decided from the case), and each other op refuses with this. attnfuzz's failure (exit 2), never
    vLLM's answer (fuzzer/support/flashmla_runtime.py)."""
