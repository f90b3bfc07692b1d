"""A `vllm.dsv4.flashinfer` / `vllm.dsv41.flashinfer` finding's reproducer: the V4 target's repro.py making
FlashInfer's SM100 layer (its objects, FlashInfer's kernel stood in for by the host preparation the script shows)
shows the injected bug and passes without it."""

import pytest

from strategies.case import Case, Dsv4, Request
from tests.conftest import python
from tests.fuzzer.targets.test_dsv4_flashmla import TWICE

pytestmark = pytest.mark.vllm

CASES = {
    # a bf16 decode whose window crosses into block 2 of a packed SWA cache (8 rows of other components a page)
    "vllm.dsv4.flashinfer": ("dsv4-flashinfer-packed-span-ignored", Case(
        requests=(Request(1, 99),), num_decodes=1, block_size=64, block_table=((1, 2),), topk_width=128, topk=(),
        kv_cache_dtype="bfloat16", seed=4,
        dsv4=Dsv4(compress_ratio=1, window_size=128, cache_dtype="bfloat16", kv_record=1024, page_pad=8))),
    # an fp8 decode, then a C2A prefill reading a kv source's compressed cache
    "vllm.dsv41.flashinfer": ("dsv41-flashinfer-prefill-cu-not-rebased", Case(
        requests=(Request(1, 40), Request(5, 0)), num_decodes=1, block_size=32, block_table=((1, 2), (3, 0)),
        topk_width=128, topk=(), kv_cache_dtype="fp8", seed=4,
        dsv4=Dsv4(compress_ratio=2, window_size=128, compressed_block_table=((1,), (2,)), version="4.1",
                  compressed_block_size=128, kv_source="shared", cache_dtype="fp8_e4m3", kv_record=512))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_mutant_finding_gets_a_reproducer_that_shows_it_and_passes_without_it(tmp_path, name):
    from fuzzer.artifacts.repro import SUPPORT_FILE, write_repro
    from fuzzer.env import host_info
    from fuzzer.observation import Observation
    from fuzzer.records import Finding
    from fuzzer.targets.registry import get_target
    from oracles.verdict import Verdict

    t = get_target(name)("cpu")
    if t.unavailable():
        pytest.skip(t.unavailable())
    mutant, case = CASES[name]
    case = case.validate()
    verdict = Verdict("output", False, "output off by 3x the tolerance", "N", where="output")
    finding = Finding(t.name, verdict.signature, case, [verdict], Observation(t.name, "cpu"), host_info("cpu"),
                      mutant, 1, 1.0)
    d = write_repro(finding, t, tmp_path / "repros")
    script = (d / "repro.py").read_text()
    assert (d / SUPPORT_FILE).is_file() and "def apply(" in script and "flashinfer_sparse" in script
    assert "DeepseekV4FlashInferMLAAttention" in (d / SUPPORT_FILE).read_text() + script
    (d / "fixed.py").write_text(script.replace("apply()  # the injected bug", "pass  # no injected bug"))
    run = python("-c", TWICE, str(d), cwd=d, timeout=600)
    assert run.returncode == 0 and "EXIT [0, 1]" in run.stdout, run.stdout + run.stderr[-3000:]
    assert "no bug: fixed" in run.stdout and "BUG:" in run.stdout, run.stdout
