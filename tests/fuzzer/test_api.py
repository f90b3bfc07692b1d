"""fuzzer/api.py, attnfuzz as a library: the strategies a test draws with, `check` and `judge` passing and failing
(the finding and its reproducer saved once Hypothesis has shrunk the case), what cannot test, and (nightly) the
guide's example test under plain pytest, green on the clean release and red with a mutant injected."""

import os
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given

from fuzzer import api
from fuzzer.errors import CouldNotTest, EmulatedWarning, FindingFailed
from fuzzer.records import read_finding
from tests.conftest import ROOT, python
from tests.fuzzer.test_pytest_plugin import PLUGIN

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.vllm

TARGET = "vllm.flashmla_sparse"
EXAMPLE = ROOT / "examples" / "test_flashmla_property.py"


def _case(valid: int = 40) -> api.Case:
    """A decode and a prefill with cached context, bf16 (the plain step)."""
    reqs = (api.Request(1, 70), api.Request(5, 30))
    return api.Case(requests=reqs, num_decodes=1, block_size=64, block_table=((1, 2), (3, 0)), topk_width=128,
                    topk=(api.TopkSpec(valid), api.TopkSpec(20, "scattered")), heads=16, kv_cache_dtype="bfloat16",
                    seed=5).validate()


def test_the_guide_shows_the_example_as_it_is():
    guide = (ROOT / "docs" / "library.md").read_text()
    code = EXAMPLE.read_text()
    code = code[code.index("from fuzzer import api"):]
    assert f"```python\n{code}```" in guide


def test_every_public_name_resolves():
    assert not [name for name in api.__all__ if not hasattr(api, name)]


def test_swarmed_draws_each_case_under_a_swarm_of_its_own():
    space = api.index_space(api.PROFILES["cpu"], api.IndexFeatures())
    seen = []

    @api.settings(max_examples=25, database=None)
    @given(api.swarmed(space))
    def draw(case):
        seen.append(case.validate())

    draw()
    assert len({c.num_decodes for c in seen}) > 1


CPU = api.PROFILES["cpu"]


@pytest.mark.parametrize("space, shows", [
    (api.attention_space(CPU, api.AttentionFeatures(dcp=True)), lambda c: c.dcp.size > 1),  # DCP splits
    (api.attention_space(CPU, api.AttentionFeatures(traces=True)), lambda c: bool(c.earlier)),  # traces
    (api.dsv4_space(CPU, api.Dsv4Features()), lambda c: c.dsv4 is not None),  # DeepSeek-V4 steps
    (api.dsv4_space(CPU, api.V41_FEATURES), lambda c: c.dsv4 is not None),  # DeepSeek-V4.1 steps
], ids=["dcp", "traces", "dsv4", "dsv41"])
def test_the_composable_strategies_draw_what_their_features_ask_for(space, shows):
    seen = []

    @api.settings(max_examples=30, database=None)
    @given(space.strategy())
    def draw(case):
        seen.append(case.validate())

    draw()
    assert any(shows(c) for c in seen) and set(space.knobs) <= set(api.KNOBS)


def test_cases_are_the_targets_own_as_a_run_narrows_them():
    @api.settings(max_examples=10, database=None)
    @given(api.cases(TARGET, kv_cache_dtypes=("fp8_ds_mla",), cudagraph_modes=("none",), max_steps=1))
    def draw(case):
        assert case.kv_cache_dtype == "fp8_ds_mla" and case.cudagraph == "none" and not case.earlier

    draw()
    with pytest.raises(ValueError, match="takes bfloat16, fp8_ds_mla"):
        api.case_space(TARGET, kv_cache_dtypes=("fp8",))


def test_check_runs_the_case_as_a_campaign_does_and_says_its_stand_ins(monkeypatch):
    monkeypatch.setattr(api, "_said", set())  # said once per process: this test wants to see it
    with pytest.warns(EmulatedWarning, match=f"{TARGET} ran on attnfuzz's stand-ins .*flash_mla_sparse_fwd"):
        obs, verdicts = api.check(TARGET, _case())
    assert all(v.ok for v in verdicts) and obs.outputs["out"].shape == (6, 16, 512)
    assert "flash_mla_sparse_fwd" in obs.emulated and "flash_mla_sparse_fwd" in api.EMULATED[TARGET]


def test_judge_fails_a_wrong_observation_with_its_finding_and_reproducer():
    case = _case()
    obs = api.observe(TARGET, lambda: {"out": torch.zeros(6, 16, 512), "lse": torch.zeros(6, 16)})
    with pytest.raises(FindingFailed) as caught:
        api.judge(TARGET, case, obs)
    failure = caught.value
    assert failure.path is not None and (failure.path / "repro.py").is_file()  # outside Hypothesis: saved at once
    assert read_finding(failure.path).target == TARGET and failure.finding.signature == "output:output"
    assert str(failure).startswith(f"FOUND {failure.path}  class ")
    assert f"reproducer: cd {failure.path} && python repro.py" in str(failure)


def test_what_cannot_run_here_fails_as_could_not_test(monkeypatch):
    with pytest.raises(CouldNotTest, match="unknown target 'vllm.nope'"):
        api.target("vllm.nope")
    monkeypatch.setenv("ATTNFUZZ_FAULT", "nothing:1")  # the self-test target refuses a plan it cannot follow
    with pytest.raises(CouldNotTest, match="not available here: ATTNFUZZ_FAULT item"):
        api.target("selftest.fault")


PROPERTY = f'''
import torch
from hypothesis import given

from fuzzer import api


@api.settings(max_examples=30, database=None)
@given(case=api.cases("{TARGET}", kv_cache_dtypes=("bfloat16",), cudagraph_modes=("none",), max_steps=1))
def test_an_output_of_zeros_is_caught(case):
    out = torch.zeros(case.num_tokens, case.heads, 512)  # right only where a row selects nothing
    obs = api.observe("{TARGET}", lambda: {{"out": out}})
    api.judge("{TARGET}", case, obs)
'''


def test_a_failing_property_is_shrunk_and_prints_its_finding_and_reproducer(pytester):
    pytester.makepyfile(test_zeros=PROPERTY)
    # A pytest process of its own, forked with vLLM imported: a run in this one would drop the vLLM modules it
    # imports when pytester restores sys.modules, and vLLM registers its custom ops again on the next import.
    run = python("-m", "pytest", "test_zeros.py", "-p", "no:cacheprovider", "-q", cwd=pytester.path,
                 env=dict(os.environ, ATTNFUZZ_STATE=str(pytester.path / ".attnfuzz")))
    assert run.returncode == pytest.ExitCode.TESTS_FAILED, run.stdout + run.stderr
    out = run.stdout
    found = re.search(r"FindingFailed: FOUND (\S+)  class (\S+) on vllm.flashmla_sparse, after \d+ cases", out)
    assert found, out
    path = Path(found.group(1))
    assert path.is_relative_to(pytester.path / ".attnfuzz" / "findings") and (path / "repro.py").is_file()
    assert read_finding(path).raw["shrunk"] is True
    # shrunk to one request whose row selects one valid entry: the smallest case a zero output is wrong on
    assert re.search(r"shrunk case: \[[DP]\(q=1,ctx=0,valid=1\)\]", out), out
    assert f"reproducer: cd {path} && python repro.py" in out
    pytest.LineMatcher(out.splitlines()).fnmatch_lines(["*1 failed*"])


# -- nightly: the guide's example under plain pytest ------------------------------------------------------------

@pytest.fixture
def plain_env(pytester, monkeypatch):
    """A pytest process of its own, as a user's: this checkout importable, its own state directory."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("ATTNFUZZ_STATE", str(pytester.path / ".attnfuzz"))
    monkeypatch.delenv("ATTNFUZZ_INJECT", raising=False)
    return pytester.path / ".attnfuzz"


@pytest.mark.nightly
def test_the_guides_example_passes_under_plain_pytest(pytester, plain_env):
    result = pytester.runpytest_subprocess(str(EXAMPLE), "-p", "no:cacheprovider", timeout=900)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*EmulatedWarning: vllm.flashmla_sparse ran on attnfuzz's stand-ins*"])


@pytest.mark.nightly
def test_the_guides_example_fails_with_a_mutant_and_saves_its_reproducer(pytester, plain_env):
    result = pytester.runpytest_subprocess(str(EXAMPLE), *PLUGIN, "--attnfuzz-inject", "flashmla-topk-length-dropped",
                                           "-p", "no:cacheprovider", timeout=900)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    out = result.stdout.str()
    paths = re.findall(r"FOUND (\S+)  class \S+ on vllm.flashmla_sparse, injected bug flashmla-topk-length-dropped", out)
    assert paths, out
    assert all(Path(p).is_relative_to(plain_env / "findings") and (Path(p) / "repro.py").is_file() for p in paths)
