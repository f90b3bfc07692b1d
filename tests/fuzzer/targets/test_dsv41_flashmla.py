"""The `vllm.dsv41.flashmla` target on CPU: vLLM's DeepSeek-V4.1 builders and V4.1's
DeepseekV4FlashMLAAttention.forward_mqa (decode and prefill routes, compress ratios 0, 1, 2, the layer owning its
compressed cache or reading its kv source's; V4's 584-byte record and SM100's 528-byte one) with FlashMLA stand-ins, judged by oracles/dsv4.py; a short clean
campaign through the CLI."""

import functools

import pytest

from strategies.case import Case, Dsv4, Request
from tests.fuzzer.targets.judged import clean_campaign
from tests.fuzzer.targets.test_dsv4_flashmla import matches_the_reference

pytestmark = pytest.mark.vllm


@functools.cache
def target():
    from fuzzer.targets.dsv41_flashmla import Dsv41FlashMLA

    t = Dsv41FlashMLA("cpu")
    if t.unavailable():
        pytest.skip(t.unavailable())
    t.prepare()
    return t


def step(requests, num_decodes, table, ratio, ctable=(), window=32, k=0, pad=0, heads=16, sink="finite", block=64,
         source="own", record=584):
    return Case(requests=tuple(requests), num_decodes=num_decodes, block_size=32, block_table=tuple(table),
                topk_width=128, topk=(), heads=heads, kv_cache_dtype="fp8_ds_mla", seed=9, padded_tokens=pad,
                dsv4=Dsv4(compress_ratio=ratio, window_size=window, compressed_block_table=tuple(ctable),
                          num_speculative_tokens=k, attn_sink=sink, version="4.1", compressed_block_size=block,
                          kv_source=source, kv_record=record)).validate()


CASES = {
    # C1A (a full-length compressed cache): MTP decodes of 2 and 1 tokens (old SWA blocks freed; position 101's
    # window 70..101 crosses the 32-token block edge at 96), a prefill of 4 after 9 cached tokens, 2 padding tokens
    "c1_mixed": (step([Request(2, 100), Request(1, 40), Request(4, 9)], 2,
                      [(0, 1, 2, 3), (4, 5, 0, 0), (6, 0, 0, 0)], 1, [(1, 2), (3, 0), (4, 0)], k=1, pad=2, heads=64),
                 {"batch.mixed", "dsv41.decode.c1a", "dsv41.prefill.c1a", "dsv41.global_topk", "dsv41.combine",
                  "dsv41.dequant_gather.compressed", "dsv41.dequant_gather.swa", "dsv41.kernel.decode.extra",
                  "dsv41.kernel.prefill", "batch.multi_token_decodes"}),
    # C2A read through the kv-source layer's cache: decodes only, one with a partly filled last state (151 tokens),
    # a padding row and its padded token
    "c2_shared_decodes": (step([Request(1, 150), Request(1, 63), Request(0, 0)], 3,
                               [(1, 2, 3, 4, 5), (6, 7, 0, 0, 0), (0, 0, 0, 0, 0)], 2, [(1, 2, 3), (4, 0, 0), (0, 0, 0)],
                               window=64, pad=1, heads=128, sink="large", source="shared"),
                          {"batch.decode_only", "batch.padding_rows", "dsv41.decode.c2a.shared",
                           "dsv4.compressed_slot_mapping", "dsv41.kernel.decode.extra"}),
    # C2A prefill, 128-token compressed blocks, kv source shared
    "c2_shared_prefill": (step([Request(5, 20)], 0, [(1,)], 2, [(1,)], block=128, source="shared"),
                          {"batch.prefill_only", "dsv41.prefill.c2a.shared", "dsv41.dequant_gather.compressed"}),
    # SM100's interleaved 528-byte MXFP8 record in both caches: a C1A prefill after 30 cached tokens (its window
    # crosses the SWA block edge at 32) and a decode
    "c1_mxfp8": (step([Request(1, 70), Request(3, 30)], 1, [(1, 2, 3), (4, 5, 0)], 1, [(1, 2), (3, 0)], record=528),
                 {"batch.mixed", "dsv41.decode.c1a", "dsv41.prefill.c1a", "dsv41.dequant_gather.mxfp8",
                  "dsv41.kernel.decode.extra"}),
    # SWA only (ratio 0): a prefill whose windows are clipped at positions < window
    "swa_prefill": (step([Request(6, 0)], 0, [(1,)], 0, k=2, sink="none"),
                    {"batch.prefill_only", "dsv41.prefill.swa_only", "dsv41.kernel.prefill"}),
}


@pytest.mark.parametrize("name", CASES)
def test_a_step_matches_the_reference(name):
    matches_the_reference(target(), *CASES[name])


def test_v41_cases_are_not_v4_cases():
    """V4.1's ratios, blocks and shared kv source are checked against its version."""
    from strategies.case import CaseError

    case, _ = CASES["c1_mixed"]
    with pytest.raises(CaseError, match="dsv4.compress_ratio"):
        Case.from_dict({**case.to_dict(), "dsv4": {**case.to_dict()["dsv4"], "compress_ratio": 4}})
    shared, _ = CASES["c2_shared_decodes"]
    with pytest.raises(CaseError, match="dsv4.kv_source"):  # only V4.1 shares a kv source's compressed cache
        Case.from_dict({**shared.to_dict(), "dsv4": {**shared.to_dict()["dsv4"], "version": "4", "compress_ratio": 4,
                                                     "compressed_block_size": 256}})


def test_a_short_clean_campaign(tmp_path):
    clean_campaign(tmp_path, "vllm.dsv41.flashmla", 4, "--seed", "3")
