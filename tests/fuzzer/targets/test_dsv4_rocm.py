"""The `vllm.dsv4.rocm` and `vllm.dsv41.rocm` targets on CPU: vLLM's ROCm DeepSeek-V4 / V4.1 builders and the ROCm
layer's forward_mqa (its decode reduce with the inverse RoPE folded in, the prefill, the standalone inverse RoPE) on
an emulated gfx950, judged by oracles/dsv4.py; the same steps on the un-tuned archs whose decode takes the fallback
kernel (the open bug: repros/rocm-7f82ecda, rocm-295317bf); the platform emulation itself; a short clean
campaign through the CLI."""

import functools

import pytest

from strategies.case import Case, Dsv4, Request
from tests.fuzzer.targets.judged import clean_campaign, failures, run_judged

pytestmark = pytest.mark.vllm


@functools.cache
def target(name):
    from fuzzer.targets.dsv4_rocm import Dsv4Rocm, Dsv41Rocm

    t = {"vllm.dsv4.rocm": Dsv4Rocm, "vllm.dsv41.rocm": Dsv41Rocm}[name]("cpu")
    if t.unavailable():
        pytest.skip(t.unavailable())
    t.prepare()
    return t


def v4(requests, num_decodes, table, ratio, ctable=(), k=0, pad=0, heads=16, arch="gfx950", window=32):
    return Case(requests=tuple(requests), num_decodes=num_decodes, block_size=64, block_table=tuple(table),
                topk_width=128, topk=(), heads=heads, kv_cache_dtype="fp8_ds_mla", seed=9, padded_tokens=pad,
                dsv4=Dsv4(compress_ratio=ratio, window_size=window, compressed_block_table=tuple(ctable),
                          num_speculative_tokens=k, rocm_arch=arch)).validate()


def v41(requests, num_decodes, table, ratio, ctable=(), k=0, heads=16, source="own", block=64, arch="gfx950"):
    return Case(requests=tuple(requests), num_decodes=num_decodes, block_size=32, block_table=tuple(table),
                topk_width=128, topk=(), heads=heads, kv_cache_dtype="fp8_ds_mla", seed=9,
                dsv4=Dsv4(compress_ratio=ratio, window_size=32, compressed_block_table=tuple(ctable),
                          num_speculative_tokens=k, version="4.1", compressed_block_size=block, kv_source=source,
                          rocm_arch=arch)).validate()


CASES = {
    # C4A: MTP decodes of 2 tokens (positions 300-301: entries past the first compressed block of 64), a 4-token
    # prefill after 9 cached ones, 2 padding tokens
    "v4_c4_mixed": ("vllm.dsv4.rocm", dict(requests=[Request(2, 300), Request(4, 9)], num_decodes=1,
                                           table=[(1, 2, 3, 4, 5), (6, 0, 0, 0, 0)], ratio=4,
                                           ctable=[(1, 2), (3, 0)], k=1, pad=2, heads=64)),
    # C128A decodes (the ROCm builder's ragged C128A rows) at 3 and 2 complete states, and a prefill
    "v4_c128": ("vllm.dsv4.rocm", dict(requests=[Request(1, 400), Request(1, 260), Request(3, 0)], num_decodes=2,
                                       table=[(1, 2, 3, 4, 5, 6, 7), (8, 9, 10, 11, 12, 0, 0), (13, 0, 0, 0, 0, 0, 0)],
                                       ratio=128, ctable=[(1, 2), (3, 4), (5, 0)], heads=8)),
    # V4.1 C2A read through the kv source's cache: a decode at position 99 (50 entries, two blocks) and a prefill
    "v41_c2_shared": ("vllm.dsv41.rocm", dict(requests=[Request(1, 99), Request(5, 20)], num_decodes=1,
                                              table=[(1, 2, 3, 4), (5, 0, 0, 0)], ratio=2, ctable=[(1, 2), (3, 0)],
                                              source="shared")),
    # V4.1 SWA only, MTP decodes
    "v41_swa": ("vllm.dsv41.rocm", dict(requests=[Request(3, 70), Request(3, 5)], num_decodes=2,
                                        table=[(1, 2, 3), (4, 0, 0)], ratio=0, k=2, heads=128)),
}


def _case(name, **override):
    target_name, kw = CASES[name]
    return target_name, (v4 if target_name == "vllm.dsv4.rocm" else v41)(**{**kw, **override})


@pytest.mark.parametrize("name", CASES)
def test_a_step_matches_the_reference(name):
    target_name, case = _case(name)
    t = target(target_name)
    obs, _ = run_judged(t, case)
    assert obs.outputs["out"].shape[:2] == (case.num_actual_tokens, case.heads) and not obs.memory
    assert len(obs.emulated) == 1 and "torch writer" in obs.emulated[0]  # the caches' writer, no kernel stood in
    assert any("gfx950" in s for s in obs.notes["shims"])


def test_the_emulated_arch_is_the_steps_only():
    from fuzzer.support import rocm_dsv4_runtime as rocm

    target("vllm.dsv4.rocm")
    import vllm.platforms.rocm as platform
    import vllm.v1.attention.backends.mla.sparse_swa as swa
    import vllm.v1.attention.ops.rocm_aiter_mla_sparse as ops

    before = (ops._ON_GFX950, swa.current_platform.is_rocm(), platform.on_gfx1250())
    with rocm.emulated_arch("gfx1250"):
        assert (ops._ON_GFX950, swa.current_platform.is_rocm(), platform.on_gfx1250()) == (False, True, True)
    assert (ops._ON_GFX950, swa.current_platform.is_rocm(), platform.on_gfx1250()) == before == (False, False, False)


# The open bug (docs/bug-reports/vllm-0.33.0-rocm-dsv4-fallback-decode-no-inverse-rope.md): its finding's signature
ROPE_KEPT = "output:output:rope_not_inverted"


@pytest.mark.parametrize("name, arch, fails", [("v4_c4_mixed", "gfx1201", True), ("v4_c4_mixed", "gfx1250", False),
                                               ("v41_swa", "gfx1201", True), ("v41_swa", "gfx1250", True)])
def test_the_fallback_decode_leaves_its_rows_in_rope_coordinates_the_open_bug(name, arch, fails):
    """On the un-tuned archs the decode takes the fallback kernel, which skips the inverse RoPE yet reports its rows
    rotated: the decode rows come back in RoPE coordinates (and only those). V4 passes the decode no positions on
    gfx1250 (the standalone pass rotates them); V4.1 reads no gfx1250 flag."""
    target_name, case = _case(name, arch=arch)
    obs, failed = failures(target(target_name), case)
    assert obs.error is None and [v.signature for v in failed] == ([ROPE_KEPT] if fails else []), failed
    if fails:
        assert f"tokens {list(range(case.num_decode_tokens))} match" in failed[0].detail


def test_the_open_bug_is_known_to_both_targets():
    """repros/' records make the bug known on each ROCm target (the gate's and the selftest's `run --known`)."""
    from pathlib import Path

    from fuzzer.commands.gate import find_repros, known_bugs

    known = known_bugs(find_repros(Path(__file__).resolve().parents[3] / "repros"), "0.33.0")
    assert known[("vllm.dsv4.rocm", ROPE_KEPT)] == "rocm-7f82ecda"
    assert known[("vllm.dsv41.rocm", ROPE_KEPT)] == "rocm-295317bf"


@pytest.mark.parametrize("version", ["4", "4.1"])
def test_every_kv_cache_dtype_the_backend_takes_is_the_584_byte_record(version):
    """auto, fp8 and fp8_ds_mla (the backend's supported_kv_cache_dtypes) all resolve, by vLLM's own resolver for the
    ROCm layer (use_fp8_ds_mla_layout), to fp8_ds_mla in uint8: the one layout the target draws."""
    import importlib

    from fuzzer.support import rocm_dsv4_runtime as rocm

    cls = rocm.layer_class(version)
    assert cls.use_fp8_ds_mla_layout
    resolve = importlib.import_module(cls.__mro__[1].__module__)._resolve_dsv4_kv_cache_dtype
    names = cls.backend_cls.supported_kv_cache_dtypes
    assert set(names) >= {"auto", "fp8", "fp8_ds_mla"}
    import torch

    assert {resolve(True, name, None) for name in names} == {("fp8_ds_mla", torch.uint8)}


@pytest.mark.parametrize("version, ratio", [("4", 1), ("4", 4), ("4.1", 0), ("4.1", 2)])
def test_the_layers_rope_is_the_oracles(version, ratio):
    """vLLM's cos_sin_cache of the layer's RoPE (build_deepseek_v4_rope) against the oracle's definition, to fp32's
    precision at the positions a case reaches."""
    import torch

    from fuzzer.support import rocm_dsv4_runtime as rocm
    from oracles.dsv4 import ROPE_DIM, gptj_rope, rope_theta

    t = target("vllm.dsv4.rocm" if version == "4" else "vllm.dsv41.rocm")
    case = (v4 if version == "4" else v41)([Request(1, 10)], 1, [(1,)], ratio,
                                           [(1,)] if ratio > (0 if version == "4.1" else 1) else [])
    cache = rocm.rotary_emb(t.cfg, ratio, version).cos_sin_cache[:20000].double()
    positions = torch.arange(cache.shape[0])
    ones = torch.zeros(len(positions), 1, ROPE_DIM, dtype=torch.float64)
    ones[..., 0::2] = 1.0  # the pair (1, 0): its inverse rotation is (cos, -sin)
    got = gptj_rope(ones, positions, rope_theta(case), inverse=True)[:, 0]
    assert torch.allclose(got[:, 0::2], cache[:, : ROPE_DIM // 2], atol=2e-3)
    assert torch.allclose(-got[:, 1::2], cache[:, ROPE_DIM // 2:], atol=2e-3)


# V4's campaign is nightly (28 s on the CI host); V4.1's keeps the plumbing of the shared target class in CI.
@pytest.mark.parametrize("name", [pytest.param("vllm.dsv4.rocm", marks=pytest.mark.nightly), "vllm.dsv41.rocm"])
def test_a_short_clean_campaign(tmp_path, name):
    clean_campaign(tmp_path, name, 4, "--seed", "3", "--known", ROPE_KEPT)  # gfx1201 cases meet the open bug
