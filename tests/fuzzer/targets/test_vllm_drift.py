"""vLLM moved under attnfuzz (issue 38 item 4): a call whose keyword, name or return shape moved in the installed
release is exit 2, COULD NOT TEST naming the call; never a finding (exit 1), never clean (exit 0). That holds where
Python fails at attnfuzz's call (a keyword renamed, a method gone), where it would fail inside vLLM (a keyword renamed
behind **kwargs), and where it would not fail at all (a method renamed behind a base class's fallback, a return of
another shape): each told by a feature of the call (vllm_calls.py: signatures, where a method is defined). Each drift is one
edit of vLLM 0.33.0's own source (tests/fuzzer/targets/vllm_drift.py): applied to the live module of a process that
has imported vLLM (fast, here), and to a copy of vLLM's package first on sys.path of a fresh interpreter whose
campaign runs in a worker process (nightly)."""

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, python
from tests.fuzzer.targets.vllm_drift import DRIFTS, copy_with

APPLY_AND_RUN = '''import sys
from tests.fuzzer.targets.vllm_drift import apply
apply(sys.argv[1])
from fuzzer.cli import main
sys.exit(main(sys.argv[2:]))
'''

# What the message names: the call, and what of it moved.
NAMED = {
    "kwarg": "triton_convert_req_index_to_global_index() got an unexpected keyword argument 'NUM_TOPK_TOKENS'",
    "method": "FlashMLASparseBackend.get_builder_cls is only declared (abstract) in this release",
    "return": "FlashMLASparseImpl.forward_mqa returned a 3-tuple, where attnfuzz takes a 2-tuple apart",
    "return-one": "FlashMLASparseImpl.forward_mqa returned one Tensor, where attnfuzz takes a 2-tuple apart",
    "kwarg-through": "FlashMLASparseImpl: no parameter named q_lora_rank in this release "
                     "(FlashMLASparseImpl.__init__(**mla_args) takes it in)",
    "fallback": "FlashInferMLASparseTRTLLMBackend.customize_spec is vllm.v1.attention.backend.AttentionBackend's "
                "fallback in this release, not FlashInferMLASparseTRTLLMBackend's own",
    "device-query": "vLLM asked this CPU host for a device and attnfuzz has no CPU answer for it (a shim in the "
                    "backend's runtime): torch.accelerator.current_device_index() at",
}


def _could_not_test(r: subprocess.CompletedProcess, drift: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert "COULD NOT TEST" in r.stderr and NAMED[drift] in r.stderr, r.stderr[-3000:]
    assert "FOUND" not in r.stdout and "finding" not in r.stderr, r.stdout[-2000:]


@pytest.mark.vllm
@pytest.mark.parametrize("drift", list(DRIFTS))
def test_a_call_that_moved_is_could_not_test_naming_the_call(drift, tmp_path):
    d = DRIFTS[drift]
    env = dict(os.environ, ATTNFUZZ_STATE=str(tmp_path / "state"))
    r = python("-c", APPLY_AND_RUN, drift, "run", "--target", d.target, "--max-examples", "2", "--isolation", "none",
               env=env, timeout=600)
    _could_not_test(r, drift)


@pytest.mark.vllm
@pytest.mark.nightly
@pytest.mark.parametrize("drift", list(DRIFTS))
def test_a_copy_of_vllm_with_a_call_moved_is_could_not_test_in_a_worker(drift, tmp_path):
    """The same on a copy of vLLM's package, its campaign's cases in a worker process (the default isolation): the
    worker says which call moved, and the campaign exits 2."""
    site = copy_with(drift, tmp_path)
    env = dict(os.environ, ATTNFUZZ_STATE=str(tmp_path / "state"),
               PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    r = subprocess.run([sys.executable, "-m", "fuzzer.cli", "run", "--target", DRIFTS[drift].target, "--max-examples",
                        "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    _could_not_test(r, drift)
