"""The differential check of the cache-op stand-ins against vLLM's compiled ops (bench/cache_ops_check.py, run on
the GPU host) draws valid cases: here its cases run through the stand-ins on both sides, each in bounds; and
ATTNFUZZ_STANDIN_OPS=1 makes a host with the compiled ops report them missing, so the stand-ins take their place."""


from fuzzer.support import flashmla_runtime, vllm_setup
from tests.conftest import ROOT, python


def test_the_check_s_cases_run_in_bounds_through_the_standins():
    done = python("bench/cache_ops_check.py", "--cases", "25", "--against", "standins", cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if " cases " in line]
    assert len(rows) == 9 and all("   0 differ" in r for r in rows), done.stdout


def test_forcing_the_standins_hides_the_compiled_ops(monkeypatch):
    monkeypatch.setattr(vllm_setup, "has_op", lambda namespace, name: True)  # a host that has them all
    assert vllm_setup.has_cache_op("concat_mla_q")
    monkeypatch.setenv("ATTNFUZZ_STANDIN_OPS", "1")
    assert not vllm_setup.has_cache_op("concat_mla_q") and not flashmla_runtime._has_flashmla_kernels()


def test_the_per_tensor_fp8_write_is_e4m3_of_x_over_the_scale_saturated_for_both_parts():
    """concat_and_cache_mla with kv_cache_dtype "fp8": fp8::scaled_convert(x, *scale) for the latent and the RoPE part
    alike (e4m3, round to nearest even, saturated at +-448); skip_scale (vLLM's when the scale is 1.0) divides by none."""
    import torch

    from fuzzer.support.standins.cache_ops import concat_and_cache_mla

    kv_c, k_pe = torch.full((1, 512), 3.0).bfloat16(), torch.tensor([[0.5, -1000.0] + [0.0] * 62]).bfloat16()
    cache = torch.zeros(1, 2, 576, dtype=torch.uint8)
    concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([1]), "fp8", torch.tensor(0.25))
    got = cache[0, 1].view(torch.float8_e4m3fn).float()
    assert got[0] == 12.0 and got[512] == 2.0 and got[513] == -448.0 and cache[0, 0].eq(0).all()
    concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([0]), "fp8", torch.tensor(0.25), True)
    assert cache[0, 0].view(torch.float8_e4m3fn).float()[0] == 3.0


def test_a_write_of_no_tokens_fails_as_the_real_op_s_empty_launch_does():
    """vLLM's writer launches one block per token unchecked: 0 tokens leave "CUDA error: invalid argument" for the
    next launch (seen on the H200 for fp8_ds_mla); the stand-ins raise it at the call, for both cache layouts."""
    import pytest
    import torch

    from fuzzer.support.standins import flashmla_ops
    from fuzzer.support.standins.cache_ops import EmptyLaunch

    none = torch.zeros(0, 576).bfloat16()
    for dtype, cache in (("fp8_ds_mla", torch.zeros(1, 64, 656, dtype=torch.uint8)),
                         ("auto", torch.zeros(1, 64, 576).bfloat16())):
        with pytest.raises(EmptyLaunch, match="invalid argument"):
            flashmla_ops.concat_and_cache_mla(none[:, :512], none[:, 512:], cache, torch.zeros(0, dtype=torch.long),
                                              dtype, None)
