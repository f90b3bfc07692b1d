"""The `vllm.dsv4.flashmla` target on CPU: vLLM's DeepSeek-V4 builders and DeepseekV4FlashMLAAttention.forward_mqa
(decode and prefill routes, compress ratios 1, 4, 128) with FlashMLA stand-ins, judged by oracles/dsv4.py; a short
clean campaign through the CLI; a finding's reproducer."""

import functools

import pytest

from strategies.case import Case, Dsv4, Request
from tests.conftest import python
from tests.fuzzer.targets.judged import TWICE  # noqa: F401  (test_dsv41_repro.py's and test_dsv4_flashinfer_repro.py's)
from tests.fuzzer.targets.judged import assert_reached, clean_campaign, run_fixed_and_saved, run_judged

pytestmark = pytest.mark.vllm


@functools.cache
def target():
    from fuzzer.targets.dsv4_flashmla import Dsv4FlashMLA

    t = Dsv4FlashMLA("cpu")
    if t.unavailable():
        pytest.skip(t.unavailable())
    t.prepare()
    return t


def step(requests, num_decodes, table, ratio, ctable=(), window=32, k=0, pad=0, heads=16, sink="finite"):
    return Case(requests=tuple(requests), num_decodes=num_decodes, block_size=64, block_table=tuple(table),
                topk_width=128, topk=(), heads=heads, kv_cache_dtype="fp8_ds_mla", seed=9, padded_tokens=pad,
                dsv4=Dsv4(compress_ratio=ratio, window_size=window, compressed_block_table=tuple(ctable),
                          num_speculative_tokens=k, attn_sink=sink)).validate()


CASES = {
    # C4: MTP decodes of 2 and 1 tokens (old SWA blocks freed; a window starting on a block boundary: position
    # 64 * 3 + 31), then a prefill of 4 after 9 cached tokens, then 2 padding tokens
    "c4_mixed": (step([Request(2, 222), Request(1, 40), Request(4, 9)], 2,
                      [(0, 0, 1, 2), (3, 0, 0, 0), (4, 0, 0, 0)], 4, [(1,), (2,), (3,)], k=1, pad=2, heads=64),
                 {"batch.mixed", "dsv4.decode.c4a", "dsv4.prefill.c4a", "dsv4.global_topk", "dsv4.combine",
                  "dsv4.dequant_gather.compressed", "dsv4.dequant_gather.swa", "dsv4.kernel.decode.extra",
                  "dsv4.kernel.prefill", "batch.multi_token_decodes"}),
    # C128: decodes only, one with two complete compressed entries, a padding row and its padded token
    "c128_decodes": (step([Request(1, 300), Request(1, 127), Request(0, 0)], 3,
                          [(1, 2, 3, 4, 5), (6, 7, 0, 0, 0), (0, 0, 0, 0, 0)], 128, [(1, 2), (3, 0), (0, 0)],
                          window=64, pad=1, heads=128, sink="large"),
                     {"batch.decode_only", "batch.padding_rows", "dsv4.decode.c128a", "dsv4.c128a_topk_metadata",
                      "dsv4.kernel.decode.extra"}),
    # SWA only: a prefill whose windows are clipped at positions < window
    "swa_prefill": (step([Request(6, 0)], 0, [(1,)], 1, k=2, sink="none"),
                    {"batch.prefill_only", "dsv4.prefill.swa_only", "dsv4.kernel.prefill"}),
}


def matches_the_reference(t, case, paths):
    """CASE on the V4 (or V4.1) layer T: judged clean, PATHS reached, FlashMLA's kernels the stand-ins, a row of output
    a token, no memory violation."""
    obs, _ = run_judged(t, case)
    assert_reached(obs, paths)
    assert {"flash_mla_with_kvcache", "flash_mla_sparse_fwd", "get_mla_metadata"} <= set(obs.emulated)
    assert obs.outputs["out"].shape[0] == case.num_actual_tokens and not obs.memory


@pytest.mark.parametrize("name", CASES)
def test_a_step_matches_the_reference(name):
    matches_the_reference(target(), *CASES[name])


@pytest.mark.parametrize("name", ["c4_mixed", "c128_decodes"])
def test_vllm_s_cpu_layer_gives_a_second_opinion_on_every_token(name):
    """Where vLLM's CPU ops are at hand (scripts/vllm-cpu-ops.sh, which .ci/run runs), vLLM's CPU layer
    (DeepseekV4CPUAttention.forward_mqa and its kernel) attends the same step, every token, judged against the same
    reference."""
    from fuzzer.support import vllm_cpu_ops

    if not vllm_cpu_ops.load():
        pytest.skip("vLLM's CPU ops are not here: bash scripts/vllm-cpu-ops.sh")
    case, _ = CASES[name]
    t = target()
    obs = t.run(case)
    second = [v for v in t.oracle(case, obs) if v.check == "cpu_second_opinion"]
    assert len(second) == 1 and second[0].ok and second[0].margin < 0.5, second
    assert obs.outputs["cpu_layer_out"].shape[0] >= case.num_actual_tokens
    note = obs.notes["second_opinion"]
    assert "DeepseekV4CPUAttention" in note and "flash_mla_with_kvcache_cpu" in note


def test_a_short_clean_campaign(tmp_path):
    clean_campaign(tmp_path, "vllm.dsv4.flashmla", 4, "--seed", "3")


def test_a_mutant_finding_gets_a_reproducer_that_shows_it_and_passes_without_it(tmp_path):
    """The finding of dsv4-compressed-slot-partial-state on the step its test makes (built here, not searched): its
    repro.py (torch + vLLM only, the support code beside it) exits 1 naming the compressed slot mapping, and 0 with
    the injected bug left out; `replay --standalone`'s single file inlines the support code."""

    from fuzzer.artifacts.repro import SUPPORT_FILE, write_repro, write_standalone
    from fuzzer.env import host_info
    from fuzzer.observation import Observation
    from fuzzer.records import Finding
    from fuzzer.targets.dsv4_flashmla import Dsv4FlashMLA
    from oracles.verdict import Verdict

    t = Dsv4FlashMLA("cpu")
    if t.unavailable():
        pytest.skip(t.unavailable())
    case = Case(requests=(Request(3, 0),), num_decodes=0, block_size=64, block_table=((1,),), topk_width=128, topk=(),
                kv_cache_dtype="fp8_ds_mla", seed=4,
                dsv4=Dsv4(compress_ratio=4, window_size=32, compressed_block_table=((1,),))).validate()
    verdict = Verdict("metadata", False, "compressed_slot_mapping: 1 of 3 rows differ from the definition; row 2 [0] "
                                         "is 64, expected -1", "N", where="metadata:compressed_slot_mapping")
    finding = Finding(t.name, verdict.signature, case, [verdict], Observation(t.name, "cpu"), host_info("cpu"),
                      "dsv4-compressed-slot-partial-state", 1, 1.0)
    d = write_repro(finding, t, tmp_path / "repros")
    script = (d / "repro.py").read_text()
    assert (d / SUPPORT_FILE).is_file() and (d / "tensors.safetensors").is_file() and "def apply(" in script
    assert "swa_builder.build(0, " in script and "builder.build(0, " in script and "layer.forward_mqa(" in script
    run = run_fixed_and_saved(d)
    assert "no bug: fixed" in run.stdout and "BUG: metadata compressed_slot_mapping" in run.stdout, run.stdout
    assert "stand-ins for ops this host lacks: flash_mla_with_kvcache" in run.stdout
    standalone = write_standalone(finding, t, tmp_path / "standalone").read_text()
    assert "SUPPORT = {" in standalone and "def judge_dsv4(" in standalone and "def apply(" in standalone
    compile(standalone, "repro.py", "exec")


def test_the_cutedsl_check_s_cases_run_through_the_triton_gather():
    """bench/cutedsl_check.py (vLLM's CuTe-DSL dequantize-and-gather against its Triton one, on the GPU host) with the
    Triton kernel on both sides, interpreted: its cases are valid inputs for both records and gather something."""
    import re

    from tests.conftest import ROOT

    done = python("bench/cutedsl_check.py", "--cases", "3", "--against", "triton", cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = re.findall(r"\[(v4-584|v41-mxfp8-528)\]: 3 cases, 0 differ \(\d+ bf16 elements compared, (\d+) of them",
                      done.stdout)
    assert [r[0] for r in rows] == ["v4-584", "v41-mxfp8-528"] and all(int(r[1]) > 0 for r in rows), done.stdout
