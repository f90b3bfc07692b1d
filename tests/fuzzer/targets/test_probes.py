"""Path coverage (fuzzer/targets/probes.py): probes wrap vLLM's functions where vLLM looks them up, record the
paths of one case, survive a mutant replacing a function, and name the paths vLLM really took."""

import inspect
import linecache
import sys
import types

import pytest
import torch

from fuzzer.targets import probes as coverage
from fuzzer.targets.probes import KNOWN_PATHS, PROBES, Probe, install, observe_paths, rarity, recording


@pytest.fixture
def module():
    """A module of attnfuzz's own (not vLLM): the wrapping mechanics only."""
    m = types.ModuleType("attnfuzz_test_probe_module")
    src = "def convert(x, *, MODE=False):\n    return x + 1\n\nclass Impl:\n    def forward(self, q):\n        return q * 2\n"
    linecache.cache["<probe-test>"] = (len(src), None, src.splitlines(True), "<probe-test>")  # for inspect.getsource
    exec(compile(src, "<probe-test>", "exec"), vars(m))
    sys.modules[m.__name__] = m
    yield m
    del sys.modules[m.__name__]


def probes(m):
    return (Probe(m.__name__, "convert", "convert", before=lambda a, k: ["convert.mode"] if k.get("MODE") else []),
            Probe(m.__name__, "Impl.forward", "forward", after=lambda a, k, r: ["forward.big"] if r > 10 else []),
            Probe(m.__name__, "missing_in_this_release", "never"))


def test_records_only_inside_recording_and_by_arguments_and_result(module):
    assert install(probes(module)) == (f"{module.__name__}.convert", f"{module.__name__}.Impl.forward")
    assert module.convert(1) == 2  # outside recording(): the original behaviour, nothing recorded
    with recording() as paths:
        module.convert(1, MODE=True)
        module.Impl().forward(6)
    assert paths == {"convert", "convert.mode", "forward", "forward.big"}
    with recording() as paths:
        module.Impl().forward(1)
    assert paths == {"forward"}


def test_install_is_idempotent_and_rewraps_a_replaced_function(module):
    install(probes(module))
    wrapped = module.convert
    install(probes(module))
    assert module.convert is wrapped  # not wrapped twice
    # A mutant rebuilds the function from its source (inspect follows __wrapped__ to the original) ...
    assert "return x + 1" in inspect.getsource(module.convert)
    module.convert = lambda x, **k: x - 1
    install(probes(module))  # ... and the next case's install wraps the replacement
    with recording() as paths:
        assert module.convert(1) == 0
    assert paths == {"convert"}


def test_a_path_that_raises_is_still_recorded(module):
    install(probes(module))
    with recording() as paths, pytest.raises(TypeError):
        module.convert("not a number")
    assert "convert" in paths


def test_remap_modes_read_the_call_sites_keywords():
    kw = dict(BLOCK_SIZE=64, BLOCK_STRIDE_ROWS=128, HAS_PREFILL_WORKSPACE=True, return_valid_counts=True,
              idx_mapping=torch.zeros(1), out=None)
    assert set(coverage._remap_modes((), kw)) == {"remap", "remap.workspace", "remap.valid_counts",
                                                  "remap.idx_mapping", "remap.block_stride"}
    assert set(coverage._remap_modes((), dict(BLOCK_SIZE=64, BLOCK_STRIDE_ROWS=64))) == {"remap"}


def test_split_result_names_the_batch_vllm_split():
    cam = types.SimpleNamespace(query_start_loc_cpu=torch.tensor([0, 2, 4, 4, 9]))  # 2 two-token decodes, a padding row
    assert set(coverage._split_result((cam,), {}, (3, 1, 4, 5))) == {"batch.mixed", "batch.multi_token_decodes",
                                                                    "batch.padding_rows"}
    one = types.SimpleNamespace(query_start_loc_cpu=torch.tensor([0, 1, 2]))
    assert set(coverage._split_result((one,), {}, (2, 0, 2, 0))) == {"batch.decode_only"}
    assert set(coverage._split_result((one,), {}, (0, 2, 0, 2))) == {"batch.prefill_only"}


def test_every_fixed_path_is_known_and_rarity_rewards_rare_paths():
    assert {p.path for p in PROBES if p.path} <= set(KNOWN_PATHS)
    counts = {"mqa": 100, "fp8.mixed_batch": 1}
    assert rarity(["mqa", "fp8.mixed_batch"], counts) > rarity(["mqa"], counts) + 0.9


# -- on vLLM's real code ----------------------------------------------------------------------------------------

@pytest.mark.vllm
def test_index_remap_target_records_workspace_mode():
    from fuzzer.targets.index_remap import IndexRemap
    from strategies.case import Case, IndexCall, Request, TopkSpec

    t = IndexRemap("cpu")
    t.prepare()
    case = Case(requests=(Request(1, 10), Request(4, 20)), num_decodes=1, block_size=64, block_table=((1,), (2,)),
                topk_width=128, topk=(TopkSpec(5), TopkSpec(20)), call=IndexCall(True, True, "all", "match")).validate()
    obs = t.run(case)
    assert {"remap", "remap.workspace", "remap.valid_counts"} <= set(obs.notes["paths"]), obs.notes["paths"]
    assert all(v.ok for v in t.oracle(case, obs))


@pytest.mark.vllm
@pytest.mark.parametrize("kv_cache_dtype,heads,expected", [
    ("bfloat16", 16, {"bf16", "batch.mixed", "mqa", "remap.valid_counts"}),
    ("fp8_ds_mla", 16, {"fp8.mixed_batch", "kernel.fp8_decode", "kernel.fp8_decode.padded_heads"}),  # < 32 heads
    ("fp8_ds_mla", 64, {"fp8.separate_prefill_decode", "remap.workspace", "kernel.bf16_sparse"}),  # >= 32 heads
])
def test_flashmla_target_records_the_path_vllm_took(kv_cache_dtype, heads, expected):
    from tests.fuzzer.targets.test_flashmla_sparse import mixed_batch, target

    t = target()
    case = mixed_batch(kv_cache_dtype, heads, 64)
    obs = t.run(case)
    paths = set(obs.notes["paths"])
    assert expected <= paths, paths
    # one FlashMLA path per call, never another's
    assert len(paths & {"bf16", "fp8.mixed_batch", "fp8.separate_prefill_decode"}) == 1, paths


def test_observe_paths_puts_the_paths_in_the_observation(module):
    from fuzzer.observation import Observation

    install(probes(module))

    def observe(call):  # as Target.observe: runs the call, returns the Observation
        call()
        return Observation("t", "cpu")

    assert observe_paths(observe, lambda: module.convert(1)).notes["paths"] == ["convert"]
