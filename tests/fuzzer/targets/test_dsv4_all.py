"""`vllm.dsv4.all` and `vllm.dsv41.all` on CPU: one DeepSeek-V4 (V4.1) step through each of its backends (FlashMLA's,
FlashInfer's SM100 one, the mega layer, ROCm's), each in its own form of the step, judged against the reference and
pairwise; which backend takes which step; a bug in one backend found as the one out of line, with that backend's own
reproducer."""

import dataclasses
import functools
import json

import pytest

from strategies.case import Case, Dsv4, Request
from tests.conftest import attnfuzz, run_repro

V4 = ("FLASHMLA_SPARSE_DSV4", "FLASHINFER_MLA_SPARSE_DSV4", "ROCM_FLASHMLA_SPARSE_DSV4")
V41 = ("FLASHMLA_SPARSE_DSV41", "FLASHINFER_MLA_SPARSE_DSV41", "FLASHMLA_MEGA_ATTN_DSV41", "ROCM_FLASHMLA_SPARSE_DSV41")


def v4(requests, num_decodes, table, ratio=4, ctable=((1,),), heads=16, arch="gfx950") -> Case:
    return Case(requests=tuple(requests), num_decodes=num_decodes, block_size=64, block_table=tuple(table),
                topk_width=128, topk=(), heads=heads, kv_cache_dtype="fp8_ds_mla", seed=7,
                dsv4=Dsv4(compress_ratio=ratio, window_size=128, compressed_block_table=tuple(ctable),
                          rocm_arch=arch, latent_grid=584)).validate()


def v41(requests, num_decodes, table, ratio=2, ctable=((1, 2),), heads=64, record=528) -> Case:
    return Case(requests=tuple(requests), num_decodes=num_decodes, block_size=32, block_table=tuple(table),
                topk_width=128, topk=(), heads=heads, kv_cache_dtype="fp8_ds_mla", seed=7,
                dsv4=Dsv4(compress_ratio=ratio, window_size=128, compressed_block_table=tuple(ctable), version="4.1",
                          compressed_block_size=128, kv_record=record, latent_grid=record,
                          rocm_arch="gfx950" if record == 584 else "")).validate()


def unprepared(name):
    """The target, its backends as on a CPU host, without preparing any (no vLLM import)."""
    from fuzzer.targets.dsv4_all import Dsv4All, Dsv41All

    t = {"vllm.dsv4.all": Dsv4All, "vllm.dsv41.all": Dsv41All}[name]("cpu")
    t.backends = tuple(t.BACKENDS)
    return t


def test_each_backend_runs_its_own_form_and_what_it_does_not_take_is_left_out():
    """V4: every backend takes every step, FlashInfer as plain bf16 rows, ROCm on the drawn arch, FlashMLA without
    it. V4.1: ROCm only on the 584-byte record, the mega layer only on the 528-byte one at 64 heads (its q unroped)."""
    t = unprepared("vllm.dsv4.all")
    c = v4([Request(1, 40)], 1, [(1,)])
    assert t.left_out(c) == {}
    assert t.form(c, "FLASHMLA_SPARSE_DSV4") == {"rocm_arch": ""} and t.form(c, "ROCM_FLASHMLA_SPARSE_DSV4") == {}
    assert t.form(c, "FLASHINFER_MLA_SPARSE_DSV4")["kv_record"] == 1024

    t = unprepared("vllm.dsv41.all")
    mxfp8 = v41([Request(1, 40)], 1, [(1, 2)])
    assert set(t.left_out(mxfp8)) == {"ROCM_FLASHMLA_SPARSE_DSV41"} and "584-byte" in t.left_out(mxfp8)[V41[3]]
    assert t.form(mxfp8, "FLASHMLA_MEGA_ATTN_DSV41") == {"mega_attn": True, "q_rope_removed": True}
    assert set(t.left_out(dataclasses.replace(mxfp8, heads=16).validate())) == {V41[2], V41[3]}
    assert set(t.left_out(v41([Request(1, 40)], 1, [(1, 2)], record=584))) == {"FLASHMLA_MEGA_ATTN_DSV41"}


def test_the_gate_knows_each_members_bugs_under_its_backends_name():
    """`attnfuzz gate` and `selftest` meet a member target's known open bug here under the backend's name: ROCm's
    fallback decode that keeps the RoPE (repros/rocm-7f82ecda) is known, not a finding, on `vllm.dsv4.all`."""
    from fuzzer.commands.gate import SIDE_BY_SIDE, known_signature

    for name in ("vllm.dsv4.all", "vllm.dsv41.all"):
        t = unprepared(name)
        assert SIDE_BY_SIDE[name] == {cls.name: backend for backend, (cls, _) in t.BACKENDS.items()}
    assert known_signature("vllm.dsv4.rocm", "output:output:rope_not_inverted", "vllm.dsv4.all") == \
        "output:ROCM_FLASHMLA_SPARSE_DSV4:output:rope_not_inverted"


@functools.cache
def prepared(name):
    from fuzzer.targets.registry import TARGETS

    t = TARGETS[name]("cpu")
    if t.unavailable():
        pytest.skip(t.unavailable())
    t.prepare()
    return t


def judged(t, case):
    obs = t.run(case)
    return obs, t.oracle(case, obs)


@pytest.mark.vllm
@pytest.mark.nightly
@pytest.mark.parametrize("name, case, backends", [
    # a C4 decode at position 300 (two compressed blocks), a 4-token prefill after 9 cached tokens
    ("vllm.dsv4.all", v4([Request(1, 300), Request(4, 9)], 1, [(1, 2, 3, 4, 5), (6, 0, 0, 0, 0)], ctable=[(1, 2), (3, 0)],
                         heads=64), V4),
    ("vllm.dsv41.all", v41([Request(1, 99), Request(5, 20)], 1, [(1, 2, 3, 4), (5, 0, 0, 0)], ctable=[(1, 2), (3, 0)]),
     V41[:3]),
])
def test_a_step_through_every_backend_agrees(name, case, backends):
    obs, verdicts = judged(prepared(name), case)
    assert tuple(obs.parts) == backends and not obs.notes.get("left_out", {}).keys() & set(backends)
    assert all(v.ok for v in verdicts), [v for v in verdicts if not v.ok]
    pair = next(v for v in verdicts if v.check == "backends")
    assert pair.margin < 1 and all(p.error is None for p in obs.parts.values())
    assert {e.split(":")[0] for e in obs.emulated} == set(backends)  # each backend's stand-ins under its name
    assert obs.parts[backends[1]].notes["case_fields"]["kv_record"] == 1024  # FlashInfer's plain bf16 rows


@pytest.mark.vllm
@pytest.mark.nightly
def test_the_rocm_fallback_decode_is_the_known_bug_under_rocms_name():
    case = v4([Request(1, 300)], 1, [(1, 2, 3, 4, 5)], ctable=[(1, 2)], arch="gfx1201")
    _, verdicts = judged(prepared("vllm.dsv4.all"), case)
    failed = [v for v in verdicts if not v.ok]
    assert failed[0].signature == "output:ROCM_FLASHMLA_SPARSE_DSV4:output:rope_not_inverted", failed
    assert [v.where for v in failed] == ["ROCM_FLASHMLA_SPARSE_DSV4:output:rope_not_inverted",
                                         "ROCM_FLASHMLA_SPARSE_DSV4"]  # the others agree


@pytest.mark.vllm
@pytest.mark.nightly
def test_a_bug_in_one_backend_is_found_as_the_one_out_of_line_and_reproduced_alone(tmp_path):
    """ROCm's standalone inverse RoPE at the batch's first positions (dsv4-rocm-inverse-rope-positions-unshifted)
    breaks ROCM_FLASHMLA_SPARSE_DSV4 alone: the finding names it, FlashMLA and FlashInfer agree, and its reproducer
    is the ROCm target's."""
    r = attnfuzz("run", "--target", "vllm.dsv4.all", "--inject", "dsv4-rocm-inverse-rope-positions-unshifted",
                 "--seed", "1", "--max-examples", "60", "--max-findings", "1", "--reruns", "0", "--no-shrink",
                 "--known", "output:ROCM_FLASHMLA_SPARSE_DSV4:output:rope_not_inverted",
                 "--json", str(tmp_path / "s.json"), "--repros", str(tmp_path / "repros"), state=tmp_path / "state")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    (finding,) = json.loads((tmp_path / "s.json").read_text())["findings"]
    assert finding["signature"] == "output:ROCM_FLASHMLA_SPARSE_DSV4:output", finding["verdicts"]
    backends = [v for v in finding["verdicts"] if v["check"] == "backends"]
    assert backends and backends[0]["where"] == "ROCM_FLASHMLA_SPARSE_DSV4", finding["verdicts"]
    assert "FLASHINFER_MLA_SPARSE_DSV4, FLASHMLA_SPARSE_DSV4, which agree" in backends[0]["detail"]
    repro = run_repro(tmp_path / "repros" / finding["id"])
    assert repro.returncode == 1 and "BUG:" in repro.stdout, repro.stdout[-3000:] + repro.stderr[-3000:]
