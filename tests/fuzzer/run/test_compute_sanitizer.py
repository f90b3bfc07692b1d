"""compute-sanitizer reports as data: the real memcheck log of the seed bug (../shared/fixtures), and logs in
the formats of the other tools; the sanitized worker's environment; guard regions; `--sanitizer auto`."""


import torch

from fuzzer.observation import Observation
from fuzzer.run.compute_sanitizer import (
    PRINT_LIMIT,
    SANITIZED_ENV,
    dedupe,
    kernel_name,
    limit_reached,
    parse_log,
    sanitized_env,
    sanitizer_command,
)
from fuzzer.targets.guards import Guards
from oracles.verdict import Verdict, passed
from strategies.case import Case, Request, TopkSpec
from tests.conftest import ROOT

FIXTURE = ROOT.parent / "shared" / "fixtures" / "memcheck-index-remap-oob.log"
FIXTURES = ROOT / "tests" / "fixtures"


def test_memcheck_fixture_of_the_seed_bug():
    reports = parse_log((FIXTURE if FIXTURE.exists() else FIXTURES / FIXTURE.name).read_text(), "memcheck")
    assert len(reports) == 2  # the log printed 2 of its 1,282 errors
    r = reports[0]
    assert (r.kind, r.access_size, r.kernel, r.file, r.line) == (
        "Invalid __global__ read", 4, "sparse_mla_index_remap_kernel", "sparse_utils.py", 152)
    assert r.thread == (0, 0, 0) and r.block == (8, 0, 0)
    assert r.distance.startswith("2,049 bytes after the nearest allocation") and r.address == "0x7f88fe801400"
    assert "Host Frame" not in r.text
    assert len(dedupe(reports)) == 1  # same kernel and line on another thread: one bug


INITCHECK = """========= COMPUTE-SANITIZER
========= Uninitialized __global__ memory read of size 4 bytes
=========     at _bf16_mla_sparse_kernel+0x2a0 in xpu_mla_sparse.py:97
=========     by thread (3,0,0) in block (0,5,0)
=========     Address 0x7f1234560010
=========
========= ERROR SUMMARY: 1 error
"""
RACECHECK = """========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at reduce_kernel+0x90 in kernels.py:41
=========     and Read access at reduce_kernel+0xc0 in kernels.py:44 [128 hazards]
=========
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""
SYNCCHECK = """========= COMPUTE-SANITIZER
========= Barrier error detected. Divergent thread(s) in warp
=========     at tile_kernel+0x3d0 in tile.py:88
=========     by thread (37,0,0) in block (2,0,0)
=========
========= ERROR SUMMARY: 1 error
"""


def test_other_tools_log_formats():
    (i,) = parse_log(INITCHECK, "initcheck")
    assert (i.kind, i.kernel, i.line, i.access_size, i.block) == (
        "Uninitialized __global__ memory read", "_bf16_mla_sparse_kernel", 97, 4, (0, 5, 0))
    (r,) = parse_log(RACECHECK, "racecheck")
    assert r.kind.startswith("Error: Race reported between Write access") and r.tool == "racecheck"
    (s,) = parse_log(SYNCCHECK, "synccheck")
    assert (s.kind, s.kernel, s.line) == ("Barrier error detected. Divergent thread(s) in warp", "tile_kernel", 88)
    assert parse_log("plain program output\n========= ERROR SUMMARY: 0 errors\n") == []


def test_real_initcheck_log_host_api_errors_and_dropped_records():
    """A real initcheck worker log (H200): a host API (cudaMemcpy) reading uninitialized device memory, one
    report per 32 bytes; and a later case whose errors overflowed the device's error buffer unprinted."""
    text = (FIXTURES / "initcheck-h200-flashmla.log").read_text()
    case1 = text[text.index("CASE-BEGIN 1"):text.index("CASE-END 1")]
    reports = parse_log(case1, "initcheck")
    assert len(reports) == 2 and len(dedupe(reports)) == 1  # the same bug at two addresses
    r = reports[0]
    assert (r.kind, r.access_size, r.kernel) == ("Host API memory access error", 16384, "cudaMemcpy source")
    assert r.describe() == "initcheck: Host API memory access error of 16384 bytes in cudaMemcpy source"
    case5 = text[text.index("CASE-BEGIN 5"):text.index("CASE-END 5")]
    (dropped,) = parse_log(case5, "initcheck")
    assert dropped.kind.startswith("error records dropped") and dropped.signature != r.signature
    cmd = sanitizer_command("initcheck", "cs")
    assert int(cmd[cmd.index("--print-limit") + 1]) == PRINT_LIMIT and limit_reached(PRINT_LIMIT // 2)


def test_extra_sanitizer_options_replace_ours(monkeypatch):
    """compute-sanitizer refuses an option given twice (seen on the H200): a diagnosis's options replace ours."""
    monkeypatch.setenv("ATTNFUZZ_SANITIZER_OPTIONS", "--show-backtrace host --check-api-memory-access no --demangle full")
    cmd = sanitizer_command("initcheck", "cs")
    assert cmd.count("--show-backtrace") == 1 and cmd[cmd.index("--show-backtrace") + 1] == "host"
    assert cmd[-4:] == ["--check-api-memory-access", "no", "--demangle", "full"]
    monkeypatch.setenv("ATTNFUZZ_SANITIZER_OPTIONS", "--print-limit 3000")  # a worker retires at half of this one
    assert not limit_reached(1499) and limit_reached(1500)


def test_sanitized_workers_never_run_with_the_caching_allocator():
    env = sanitized_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PATH": "/bin"})
    assert env["PYTORCH_NO_CUDA_MEMORY_CACHING"] == "1" and "PYTORCH_CUDA_ALLOC_CONF" not in env
    assert SANITIZED_ENV == {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    cmd = sanitizer_command("memcheck", binary="/x/compute-sanitizer")
    assert cmd[:3] == ["/x/compute-sanitizer", "--tool", "memcheck"] and "--leak-check" in cmd


def test_guard_regions_catch_a_write_just_past_a_buffer():
    g = Guards()
    buf = g.empty("kv_cache", 100, torch.bfloat16, "cpu")
    buf.fill_(1.0)
    assert g.check() == []
    raw = buf.view(torch.uint8)
    torch.as_strided(raw, (4,), (1,), raw.storage_offset() + 200 + 6).fill_(0)  # 6 bytes past the end
    (msg,) = g.check()
    assert "after `kv_cache`" in msg and "the first 6 bytes after its end" in msg


class _Fake:
    def __init__(self, verdicts):
        self.verdicts, self.calls, self.started = verdicts, 0, 1

    def check(self, case):
        self.calls += 1
        return Observation("t", "cuda", notes={"sanitizer": "memcheck"} if self.verdicts else {}), list(self.verdicts)

    def close(self):
        pass


def test_auto_sanitizer_reruns_failures_new_paths_and_a_sample():
    from fuzzer.run.executors import AutoSanitizedExecutor

    case = Case(requests=(Request(1, 3),), num_decodes=1, block_size=64, block_table=((1,),), topk_width=128,
                topk=(TopkSpec(4),))
    oob = Verdict("memory", False, "memcheck: Invalid __global__ write", "C", where="memcheck:k:1")
    native, memcheck = _Fake([passed("output", "ok")]), _Fake([oob])
    auto = AutoSanitizedExecutor(native, memcheck, sample=0.0)
    obs, verdicts = auto.check(case)  # a new path: re-run under memcheck, whose report joins the verdicts
    assert memcheck.calls == 1 and verdicts == [oob] and obs.notes["memcheck_rerun"] == "new path"
    auto.check(case)  # same path, nothing failed, no sample: native only
    assert memcheck.calls == 1 and native.calls == 2


def test_kernels_without_line_info_keep_their_name():
    """FlashMLA's kernels carry no line info: the report names the kernel (one signature for all its template
    instantiations, the whole symbol kept), and the closing count of skipped errors reads as dropped records."""
    text = (FIXTURES / "initcheck-h200-flashmla-kernels.log").read_text()
    reports = parse_log(text, "initcheck")
    kernels = [r.kernel for r in reports]
    assert kernels[:2] == ["smxx::decode::flash_fwd_mla_combine_kernel"] * 2
    assert reports[0].symbol.startswith("void smxx::decode::flash_fwd_mla_combine_kernel<cutlass::bfloat16_t")
    assert reports[0].access_size == 16 and reports[0].block == (2, 0, 5)
    assert "at::native::elementwise_kernel" in kernels
    assert kernel_name("void (anonymous namespace)::fill<float>(float *)") == "(anonymous namespace)::fill"
    assert [r.signature for r in dedupe(reports)] == [
        "initcheck:Uninitialized __global__ memory read:smxx::decode::flash_fwd_mla_combine_kernel::0",
        "initcheck:error records dropped (the device's error buffer overflowed):?::0",
        "initcheck:Uninitialized __global__ memory read:at::native::elementwise_kernel::0"]
    assert reports[-1].kind.startswith("error records dropped")
    memcheck = parse_log((FIXTURES / "memcheck-index-remap-oob.log").read_text())
    assert (memcheck[0].kernel, memcheck[0].file, memcheck[0].line, memcheck[0].symbol) == (
        "sparse_mla_index_remap_kernel", "sparse_utils.py", 152, "")


def test_allocator_poisoning_is_opt_in_and_cuda_only(monkeypatch):
    """Poisoning the caching allocator's free memory: only on CUDA, only when asked, never under a sanitizer
    (the allocator is off there and initcheck sees unwritten memory itself)."""
    from fuzzer.targets.guards import allocator_poisoning, poison_free_memory

    monkeypatch.delenv("PYTORCH_NO_CUDA_MEMORY_CACHING", raising=False)
    monkeypatch.delenv("ATTNFUZZ_POISON_ALLOCATOR", raising=False)
    assert not allocator_poisoning("cuda") and not poison_free_memory("cpu")
    monkeypatch.setenv("ATTNFUZZ_POISON_ALLOCATOR", "1")
    assert allocator_poisoning("cuda") and allocator_poisoning("cuda:0") and not allocator_poisoning("cpu")
    monkeypatch.setenv("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    assert not allocator_poisoning("cuda")


def test_initcheck_skips_flashmlas_combine_kernel_where_the_tool_takes_the_filter(tmp_path):
    """FlashMLA's combine kernel reads only split accumulators its split kernel wrote through TMA (invisible to
    initcheck): it is excluded, where this compute-sanitizer accepts the filter (it is run once to see)."""
    new, old = tmp_path / "cs-new", tmp_path / "cs-old"
    new.write_text("#!/bin/sh\nexit 0\n")
    old.write_text("#!/bin/sh\necho 'unrecognised option' >&2; exit 1\n")
    for f in (new, old):
        f.chmod(0o755)
    assert sanitizer_command("initcheck", str(new))[-2:] == ["--kernel-name-exclude", "kns=flash_fwd_mla_combine_kernel"]
    assert "--kernel-name-exclude" not in sanitizer_command("initcheck", str(old))
    assert "--kernel-name-exclude" not in sanitizer_command("memcheck", str(new))


def test_flashmla_outputs_are_prefilled_with_nan_under_initcheck():
    """What FlashMLA writes through TMA is invisible to initcheck: under it, the harness fills `out` first (a
    write initcheck sees), whether vLLM passes a buffer or FlashMLA allocates one; unwritten stays NaN."""
    from fuzzer.support.flashmla_runtime import prefill_outputs_under_initcheck, prefilled_out

    seen = []

    def kernel(q, kv, d_v=512, out=None):
        seen.append(out.clone())
        out[:1] = 1.0  # writes only its first row
        return out

    wrapped = prefilled_out(kernel, lambda a: (*a["q"].shape[:2], a["d_v"]))
    out = wrapped(torch.zeros(3, 2, 8, dtype=torch.bfloat16), None, d_v=4)
    assert out.shape == (3, 2, 4) and out.dtype == torch.bfloat16 and seen[0].isnan().all()
    assert (out[0] == 1).all() and out[1:].isnan().all()
    mine = torch.zeros(3, 2, 4, dtype=torch.bfloat16)
    assert wrapped(torch.zeros(3, 2, 8, dtype=torch.bfloat16), None, d_v=4, out=mine) is mine and mine[2].isnan().all()
    assert prefill_outputs_under_initcheck("cpu") == ()  # natively and on CPU, vLLM's calls are untouched


def test_sanitized_runs_draw_eager_engines_only():
    """A sanitized worker has no caching allocator, so a CUDA-graph capture fails in attnfuzz's set-up (the H100's
    initcheck and memcheck campaigns of 9711931 reported it as a crash): the run narrows to eager engines, says why
    where `--cudagraph full` asks for graphs, and `--sanitizer auto` keeps its memcheck re-runs off graph cases."""
    import pytest

    from fuzzer.cli import parser
    from fuzzer.commands.run import run_plan, validate
    from fuzzer.errors import UsageError
    from fuzzer.run.executors import AutoSanitizedExecutor

    def args(*argv):
        return parser().parse_args(["run", "--target", "vllm.flashmla_sparse", *argv])

    assert run_plan(args("--sanitizer", "initcheck")).cudagraph_modes == ("none",)
    assert run_plan(args("--sanitizer", "auto")).cudagraph_modes is None
    assert run_plan(args("--cudagraph", "full")).cudagraph_modes == ("full",)
    with pytest.raises(UsageError, match="caching allocator"):
        validate(args("--sanitizer", "memcheck", "--cudagraph", "full"), "cuda")

    case = Case(requests=(Request(1, 3), Request(0, 0)), num_decodes=2, block_size=64, block_table=((1,), (0,)),
                topk_width=128, topk=(TopkSpec(4), TopkSpec(0)), padded_tokens=1, cudagraph="full")
    native, memcheck = _Fake([Verdict("output", False, "off", "B")]), _Fake([])
    obs, verdicts = AutoSanitizedExecutor(native, memcheck, sample=0.0).check(case.validate())
    assert memcheck.calls == 0 and [v.check for v in verdicts] == ["output"]
    assert obs.notes["memcheck_rerun"].startswith("skipped (failed, a full-graph case")
