"""A `vllm.dsv41.flashmla` finding's reproducer: the V4 target's repro.py making V4.1's objects (a consumer layer
reading its kv source's compressed cache of 528-byte records) shows the injected bug and passes without it."""

import pytest

from strategies.case import Case, Dsv4, Request
from tests.conftest import python
from tests.fuzzer.targets.test_dsv4_flashmla import TWICE

pytestmark = pytest.mark.vllm


def test_a_mutant_finding_gets_a_reproducer_that_shows_it_and_passes_without_it(tmp_path):
    """dsv41-combine-topk-len-off-by-one on a C2A prefill (built here, not searched): repro.py (torch + vLLM only,
    the support code beside it) exits 1 naming the output, and 0 with the injected bug left out."""

    from fuzzer.artifacts.repro import SUPPORT_FILE, write_repro
    from fuzzer.env import host_info
    from fuzzer.observation import Observation
    from fuzzer.records import Finding
    from fuzzer.targets.dsv41_flashmla import Dsv41FlashMLA
    from oracles.verdict import Verdict

    t = Dsv41FlashMLA("cpu")
    if t.unavailable():
        pytest.skip(t.unavailable())
    case = Case(requests=(Request(4, 0),), num_decodes=0, block_size=32, block_table=((1,),), topk_width=128, topk=(),
                kv_cache_dtype="fp8_ds_mla", seed=4,
                dsv4=Dsv4(compress_ratio=2, window_size=32, compressed_block_table=((1,),), version="4.1",
                          compressed_block_size=64, kv_source="shared", kv_record=528)).validate()
    verdict = Verdict("output", False, "output off by 3x the tolerance", "N", where="output")
    finding = Finding(t.name, verdict.signature, case, [verdict], Observation(t.name, "cpu"), host_info("cpu"),
                      "dsv41-combine-topk-len-off-by-one", 1, 1.0)
    d = write_repro(finding, t, tmp_path / "repros")
    script = (d / "repro.py").read_text()
    assert (d / SUPPORT_FILE).is_file() and "def apply(" in script and "deepseek_v41" in script
    # V4.1's objects (dsv41_runtime.step_layer, shown) through V4's builders and forward_mqa (dsv4_runtime's, shown)
    assert "def step_layer(" in script and "attention_layers(" in script and "kv_record=528" in script
    assert "def build_metadata(" in script and "layer.forward_mqa(" in script and "guard_compressed=False" in script
    (d / "fixed.py").write_text(script.replace("apply()  # the injected bug", "pass  # no injected bug"))
    run = python("-c", TWICE, str(d), cwd=d, timeout=600)
    assert run.returncode == 0 and "EXIT [0, 1]" in run.stdout, run.stdout + run.stderr[-3000:]
    assert "no bug: fixed" in run.stdout and "BUG:" in run.stdout, run.stdout


def test_a_sliding_window_finding_gets_a_reproducer(tmp_path):
    """A ratio-0 step (no compressed cache; 0 entries a compressed block) renders too."""
    from fuzzer.artifacts.repro import write_repro
    from fuzzer.env import host_info
    from fuzzer.observation import Observation
    from fuzzer.records import Finding
    from fuzzer.targets.dsv41_flashmla import Dsv41FlashMLA
    from oracles.verdict import Verdict

    t = Dsv41FlashMLA("cpu")
    case = Case(requests=(Request(3, 0),), num_decodes=0, block_size=32, block_table=((1,),), topk_width=128, topk=(),
                kv_cache_dtype="fp8_ds_mla", seed=4,
                dsv4=Dsv4(compress_ratio=0, window_size=32, version="4.1", compressed_block_size=64,
                          kv_record=528)).validate()
    verdict = Verdict("nan", False, "3 non-finite outputs", "N", where="nan")
    finding = Finding(t.name, verdict.signature, case, [verdict], Observation(t.name, "cpu"), host_info("cpu"),
                      "dsv41-mxfp8-scales-not-interleaved", 1, 1.0)
    script = (write_repro(finding, t, tmp_path / "repros") / "repro.py").read_text()
    assert "kv_cache = None" in script and "compress_ratio=0" in script
    compile(script, "repro.py", "exec")
