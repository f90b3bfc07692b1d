"""Reproducers: one skeleton rendered from a target's ReproSpec, the support code in one generated file."""

import ast
import inspect
import json
import pkgutil
import random
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

import fuzzer.support
from fuzzer.artifacts.repro import SUPPORT_FILE, compact_list, render, support_file
from fuzzer.artifacts.slicer import shown, slice_support
from fuzzer.repro_spec import Call, Judge, ReproSpec
from fuzzer.support.index_remap import remap_topk_indices
from fuzzer.support.sparse_mla_steps import topk_buffer
from tests.conftest import ROOT

ALL_SUPPORT = [m.name for m in pkgutil.walk_packages(fuzzer.support.__path__, "fuzzer.support.") if not m.ispkg]
ATTNFUZZ = ("fuzzer", "oracles", "strategies")
ALLOWED_IMPORTS = {"__future__", "contextlib", "dataclasses", "os", "sys", "tempfile", "traceback", "types", "torch", "safetensors",
                   "vllm", "attnfuzz_support"}


def test_compact_list_is_exact_and_short():
    rng = random.Random(0)
    for _ in range(200):
        xs = []
        for _ in range(rng.randint(0, 6)):
            kind = rng.choice(["run", "range", "noise"])
            n = rng.randint(1, 40)
            xs += [-1] * n if kind == "run" else list(range(n, 2 * n)) if kind == "range" else [rng.randint(-1, 99) for _ in range(n % 5)]
        assert eval(compact_list(xs)) == xs
    assert compact_list([-1] * 128) == "[-1] * 128"
    assert compact_list([3, 4, 5, 6, 7, -1, -1]) == "list(range(3, 8)) + [-1, -1]"


def _imports(source: str) -> set[str]:
    """Top-level names of every module `source` imports, in-function imports included."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add("." if node.level else node.module.split(".")[0])
    return found


def _support_sources(text: str) -> dict[str, str]:
    tree = ast.parse(text)
    (node,) = [n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "SUPPORT"]
    return ast.literal_eval(node.value)


def test_a_slice_carries_what_its_roots_reach_and_imports_nothing_else_of_attnfuzz():
    """Every support module sliced whole stays inside fuzzer.support; a slice of one name holds only what that
    name needs (its support imports cut to the names used)."""
    whole = slice_support([(m, "*") for m in ALL_SUPPORT])
    assert set(whole) == set(ALL_SUPPORT)
    for name, source in whole.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ATTNFUZZ:
                assert node.module in whole or all(f"{node.module}.{a.name}" in whole for a in node.names), name
    assert set(slice_support([("fuzzer.support.interp.sanitizer", "SANITIZER")])) == {
        "fuzzer.support.interp.sanitizer", "fuzzer.support.errors"}  # CheckerBroke
    one = slice_support([("fuzzer.support.vllm_setup", "guard_index_group")])
    assert set(one) == {"fuzzer.support.vllm_setup"}
    assert "def guard_index_group(" in one["fuzzer.support.vllm_setup"]
    assert "def vllm_runtime(" not in one["fuzzer.support.vllm_setup"]
    # A backend's loader reaches that backend's stand-ins only, and of a stand-in module only the ops it binds.
    flashmla = slice_support([("fuzzer.support.flashmla_runtime", "flashmla_sparse_backend")])
    assert not {"fuzzer.support.dcp_group", "fuzzer.support.standins.flash_attn_ops",
                "fuzzer.support.standins.cache_ops"} & set(flashmla)
    assert "def flash_mla_sparse_fwd(" in flashmla["fuzzer.support.standins.flashmla_ops"]
    assert "def quantize_fp8_ds_mla(" not in flashmla["fuzzer.support.standins.flashmla_ops"]
    flash_attn = slice_support([("fuzzer.support.flashmla_runtime", "flash_attn_sparse_backend")])
    assert "fuzzer.support.standins.flash_attn_ops" in flash_attn
    assert "fuzzer.support.standins.flashmla_ops" not in flash_attn
    # FlashInfer's host set-up: no FlashMLA initcheck prefill (FlashMLA's kernels are not on its path).
    sm90 = slice_support([("fuzzer.support.flashinfer_runtime", "prepare_sm90_host")])
    assert "fuzzer.support.flashmla_runtime" not in sm90
    for name, source in whole.items():  # without docstrings and comment lines, the heading naming the file
        tree = ast.parse(source)
        assert source.startswith(f"# {name.replace('.', '/')}.py: "), name
        assert not any(ast.get_docstring(n, clean=False) and len(n.body) > 1 for n in ast.walk(tree)
                       if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))), name
        assert not any(ln.lstrip().startswith("#") for ln in source.splitlines()[1:]), name
    compile(support_file(whole), SUPPORT_FILE, "exec")
    assert _imports(support_file(whole).split("SUPPORT = {")[0]) <= {"contextlib", "importlib", "linecache", "sys",
                                                                    "traceback"}


def test_a_shown_function_using_a_support_module_by_its_name_carries_the_members_it_uses():
    """`dsv4_runtime.build_metadata(...)` in a shown function roots that member, not the whole module (whose other
    functions, and the stand-ins they bind, the path never reaches)."""
    from fuzzer.support.rocm_dsv4_runtime import build_metadata

    roots = shown(build_metadata, set()).roots
    assert ("fuzzer.support.dsv4_runtime", "build_metadata") in roots
    assert not any(name == "*" for _, name in roots), roots
    assert "def bind_standins(" not in slice_support(roots)["fuzzer.support.dsv4_runtime"]


def test_the_support_file_imports_its_modules_under_their_own_names_without_attnfuzz(tmp_path):
    """Imported from a directory of its own, it serves every module from itself, and attnfuzz stays unreachable
    (even where attnfuzz is installed: the venvs install it editable)."""
    (tmp_path / SUPPORT_FILE).write_text(support_file(slice_support([(m, "*") for m in ALL_SUPPORT])))
    probe = (
        "import sys, importlib\n"
        "import attnfuzz_support\n"
        "from fuzzer.support import flashmla_runtime, dcp_group\n"
        "from fuzzer.support.interp import sanitizer\n"
        "from fuzzer.support.standins import flashmla_ops\n"
        "mods = [m for n, m in sys.modules.items() if n.split('.')[0] in ('fuzzer', 'oracles', 'strategies')]\n"
        "assert all(type(m.__spec__.loader).__name__ == '_SupportFinder' for m in mods), mods\n"
        "assert flashmla_ops.VIOLATIONS is sanitizer.VIOLATIONS  # one module, shared by its importers\n"
        "for name in ('fuzzer.cli', 'fuzzer.targets.base'):  # attnfuzz's own fuzzer package is out of reach\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError:\n"
        "        continue\n"
        "    raise SystemExit(f'{name} imported: the reproducer could reach attnfuzz')\n"
        "print('ok')\n")
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ""})
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr[-3000:]


def _finding(device="cpu", inject=None):
    host = SimpleNamespace(device=device, device_name="x86_64", vllm="0.33.0")
    verdict = SimpleNamespace(check="output", detail="output off by 2x the tolerance")
    return SimpleNamespace(id="t-00000000", title=verdict.detail, target="vllm.test", inject=inject, host=host,
                           verdicts=[verdict], observation=SimpleNamespace(notes={}))


def _script_imports(script: str) -> set[str]:
    return _imports(script.split("\n# ---- the injected bug")[0])


_REMAP = Call(remap_topk_indices, dict(entry_point="'triton_convert_req_index_to_global_index'",
                                       req_id_per_token="r", block_table="b", topk_indices="t", BLOCK_SIZE="64"),
              assign="out, valid_counts")


def test_the_skeleton_shows_the_vllm_calls_and_imports_the_rest():
    """The call's functions are copied into repro.py (the very source run() calls); prepare and setup
    functions come from the support file; a judge is called with the spec's expressions."""
    spec = ReproSpec(about="Shrunk case: one token.", call=(_REMAP,),
                     judge=Judge("index_contract", dict(req_id_per_token="r", topk_indices="t")),
                     setup=(Call(topk_buffer, dict(rows="9", topk_width="128", device="DEVICE"), assign="r"),),
                     constants={"ATOL": 0.01}, bounds_checked=True)
    files = render(_finding(), spec)
    assert set(files) == {"repro.py", SUPPORT_FILE}
    script = files["repro.py"]
    compile(script, "repro.py", "exec")
    assert _script_imports(script) <= ALLOWED_IMPORTS | {"fuzzer", "importlib"}
    assert inspect.getsource(remap_topk_indices) in script  # shown verbatim
    assert "def topk_buffer(" not in script and "from fuzzer.support.sparse_mla_steps import topk_buffer" in script
    assert "out, valid_counts = remap_topk_indices(entry_point=" in script and "BLOCK_SIZE=64)" in script
    assert 'os.environ["TRITON_INTERPRET"] = "1"' in script and "with vllm_call(SANITIZER) as call:" in script
    assert "problems += judge_index_contract(error=call.error, req_id_per_token=r, topk_indices=t)" in script
    assert "def judge_index_contract(" in files[SUPPORT_FILE] and "def judge_attention(" not in files[SUPPORT_FILE]
    assert "def vllms_answer(" in files[SUPPORT_FILE] and "def vllms_answer(" not in script  # the harness
    assert "def topk_buffer(" in files[SUPPORT_FILE] and "def mla_layer(" not in files[SUPPORT_FILE]
    # Imports sit inside the guard that maps their failure to exit 2.
    assert script.index('with stage("the imports")') < script.index("    import torch")
    # On a GPU: no interpreter, no bounds checker.
    gpu = render(_finding("cuda"), ReproSpec(about="", call=(_REMAP,), judge=Judge("index_contract", dict(
        req_id_per_token="r", topk_indices="t"))))
    assert "TRITON_INTERPRET" not in gpu["repro.py"] and "with vllm_call() as call:" in gpu["repro.py"]


def test_a_support_function_passed_as_an_argument_is_imported_by_name_and_carried():
    """A Call's argument may be a support function itself (a target's choice of path): repro.py names it and
    imports it from the support file, which carries it (and only the path it chose)."""
    from fuzzer.support.flashmla_runtime import flashmla_sparse_backend
    from fuzzer.support.sparse_mla_steps import prepare_host

    spec = ReproSpec(about="", call=(_REMAP,), judge=Judge("index_contract", dict(req_id_per_token="r", topk_indices="t")),
                     prepare=(Call(prepare_host, dict(load_backend=flashmla_sparse_backend, device="DEVICE"),
                                   assign="backend, emulated, shims"),))
    files = render(_finding(), spec)
    script, support = files["repro.py"], _support_sources(files[SUPPORT_FILE])
    compile(script, "repro.py", "exec")
    assert "backend, emulated, shims = prepare_host(load_backend=flashmla_sparse_backend, device=DEVICE)" in script
    assert "from fuzzer.support.flashmla_runtime import flashmla_sparse_backend" in script
    assert "def flashmla_sparse_backend(" in support["fuzzer.support.flashmla_runtime"]
    assert "def flash_attn_sparse_backend(" not in support["fuzzer.support.flashmla_runtime"]
    assert "fuzzer.support.standins.flash_attn_ops" not in support


def test_unchecked_a_cpu_reproducer_carries_no_bounds_checker_but_collects_its_stand_ins_reports():
    """bounds_checked off (a target's call for a finding that is not a memory one): neither file has the
    interpreter's bounds checker; a stand-in on the path (FlashInfer's, through the engine) reports into
    VIOLATIONS, which main() collects; without one, nothing is collected. On: the checker, installed."""
    from fuzzer.support.flashinfer_runtime import engine

    setup = (Call(engine, {p: p for p in inspect.signature(engine).parameters}, assign="impl, layer, builder"),)
    judge = Judge("index_contract", dict(req_id_per_token="r", topk_indices="t"))
    for checked in (False, True):
        files = render(_finding(), ReproSpec(about="", call=(_REMAP,), setup=setup, judge=judge,
                                             bounds_checked=checked))
        script, support = files["repro.py"], files[SUPPORT_FILE]
        compile(script, "repro.py", "exec")
        assert ("class InterpreterSanitizer" in support) is checked and ("SANITIZER.install()" in script) is checked
        assert f"with vllm_call({'SANITIZER' if checked else 'VIOLATIONS'}) as call:" in script
    bare = render(_finding(), ReproSpec(about="", call=(_REMAP,), judge=judge))
    assert "with vllm_call() as call:" in bare["repro.py"]
    assert "fuzzer.support.interp.sanitizer" not in _support_sources(bare[SUPPORT_FILE])


def test_a_judge_and_a_call_are_given_exactly_their_parameters():
    with pytest.raises(ValueError, match="no expression for"):
        render(_finding(), ReproSpec(about="", call=(), judge=Judge("index", {"out": "out"})))
    with pytest.raises(ValueError, match="no parameter"):
        render(_finding(), ReproSpec(about="", call=(), judge=Judge("index_contract", {"nope": "1"})))
    with pytest.raises(ValueError, match="no expression for"):
        render(_finding(), ReproSpec(about="", call=(Call(topk_buffer, {"rows": "1"}),),
                                     judge=Judge("index_contract", dict(req_id_per_token="r", topk_indices="t"))))
    with pytest.raises(ValueError, match="judge"):
        Judge("exact")


def test_the_standalone_form_inlines_the_support_file():
    spec = ReproSpec(about="", call=(_REMAP,), judge=Judge("index_contract", dict(req_id_per_token="r", topk_indices="t")),
                     bounds_checked=True)
    script = render(_finding(), spec, standalone=True)["repro.py"]
    assert "import attnfuzz_support" not in script and "from attnfuzz_support" not in script
    assert script.index("def vllms_answer(") < script.index('with stage("the imports")')
    assert script.index("SUPPORT = {") < script.index("from fuzzer.support.interp.sanitizer import SANITIZER")


def test_no_code_in_strings_in_the_targets():
    """A vLLM call is written once, as a function in fuzzer/support/: no string literal in fuzzer/targets/
    compiles as more than one statement (a reproducer's code used to live there twice)."""
    found = []
    for path in sorted((ROOT / "fuzzer" / "targets").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "\n" in node.value.strip():
                try:
                    body = ast.parse(textwrap.dedent(node.value)).body
                except SyntaxError:
                    continue
                if len(body) > 1 or body and not isinstance(body[0], ast.Expr):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


@pytest.mark.vllm
def test_a_one_token_flashmla_reproducer_is_short_and_reads_as_vllm_calls():
    """The committed one-token FlashMLA case, rendered: <= 150 lines, the vLLM calls shown, imports nothing of
    attnfuzz but its support file, which holds only the modules its path uses (no DCP group)."""
    from fuzzer.observation import Observation
    from fuzzer.records import Finding
    from fuzzer.targets.flashmla_sparse import FlashMLASparse
    from oracles.verdict import Verdict
    from strategies.case import Case

    d = ROOT / "repros" / "flashmla-sparse-80e429b9"
    meta = json.loads((d / "finding.json").read_text())
    case = Case.from_json((d / "case.json").read_text())
    host = SimpleNamespace(device="cpu", device_name="x86_64", vllm="0.26.0")
    finding = Finding(meta["target"], meta["signature"], case, [Verdict(**v) for v in meta["verdicts"]],
                      Observation(meta["target"], "cpu"), host, None, 3, 5.76)
    spec = FlashMLASparse("cpu").repro_spec(finding)
    assert spec.tensors["s1.q"].shape[0] == 1 and spec.judge.name == "attention"
    files = render(finding, spec)
    script = files["repro.py"]
    assert len(script.splitlines()) <= 150, len(script.splitlines())
    assert _script_imports(script) <= ALLOWED_IMPORTS | {"fuzzer"}
    assert "impl.forward_mqa(" in script or "forward_mqa(impl" in script
    assert "'fuzzer.support.dcp_group'" not in files[SUPPORT_FILE]
    # The committed reproducer is this rendering (but for the id it was saved under).
    assert (d / "repro.py").read_text() == script.replace(finding.id, meta["id"])


@pytest.mark.vllm
def test_a_flashinfer_sm90_reproducer_carries_only_what_its_path_reaches():
    """The committed one-token fp8 FLASHINFER_MLA_SPARSE_SM90 case, rendered: repro.py <= 150 lines, its support
    file within its budget (the FlashInfer stand-in is most of it: FlashInfer's checks of the form vLLM calls, the
    planner, the kernel and its merge stage); none of FlashMLA's path (initcheck prefill, its stand-in ops), no
    interpreter corrections (its Triton kernels are integer ones), none of the wrapper's forms vLLM never calls (an
    LSE, per-token scales). The committed files are this rendering (but for the id they were saved under)."""
    from fuzzer.observation import Observation
    from fuzzer.records import Finding, read_finding
    from fuzzer.targets.flashinfer_sparse_sm90 import FlashInferMLASparseSM90
    from strategies.case import Case

    d = ROOT / "repros" / "flashinfer-sparse-sm90-040dcd28"
    record = read_finding(d)
    finding = Finding.from_record(record, Case.from_json((d / "case.json").read_text()))
    finding.observation = Observation(record.target, "cpu")
    files = render(finding, FlashInferMLASparseSM90("cpu").repro_spec(finding))
    script, support = files["repro.py"], files[SUPPORT_FILE]
    assert len(script.splitlines()) <= 150, len(script.splitlines())
    # The path reaches 1,173 lines: the stand-in 490, its violation record 41, vLLM-side set-up and CPU emulation
    # ~470, harness, loader, judges and errors ~150 (bench/support_coverage.py: what its run executes). An output
    # finding: no interpreter bounds checker (a memory finding's reproducer carries it).
    assert len(support.splitlines()) <= 1200, len(support.splitlines())
    assert "class InterpreterSanitizer" not in support and "SANITIZER.install()" not in script
    assert "with vllm_call(VIOLATIONS) as call:" in script  # the stand-in's own checks still report
    modules = _support_sources(support)
    assert not {"fuzzer.support.interp.corrections", "fuzzer.support.standins.flashmla_ops",
                "fuzzer.support.dcp_group", "fuzzer.support.flashmla_runtime"} & set(modules)  # FlashMLA's: not its path
    standin = modules["fuzzer.support.standins.flashinfer_mla"]
    assert "def mla_plan(" in standin and "def _merge(" in standin
    assert "lse_base_e" not in standin and "ckv_scale_arr[" not in standin
    assert (d / "repro.py").read_text() == script.replace(finding.id, record.id)
    assert (d / SUPPORT_FILE).read_text() == support.replace(finding.id, record.id)


@pytest.mark.vllm
def test_a_flashmla_reproducer_carries_the_stand_ins_of_its_case_path_only():
    """The committed bf16 FLASHMLA_SPARSE output finding, rendered: the stand-ins of its path (the query concatenation,
    the bf16 sparse kernel) and none of the fp8 decode, the upconverting gathers or the NVFP4/V4 record forms; every
    other op bound to refuse (off_path); no interpreter bounds checker (not a memory finding). The committed files are
    this rendering (but for the id they were saved under)."""
    from fuzzer.observation import Observation
    from fuzzer.records import Finding, read_finding
    from fuzzer.support.flashmla_runtime import bf16_kernel, q_concat
    from fuzzer.targets.flashmla_sparse import FlashMLASparse
    from strategies.case import Case

    d = ROOT / "repros" / "flashmla-sparse-80e429b9"
    record = read_finding(d)
    finding = Finding.from_record(record, Case.from_json((d / "case.json").read_text()))
    finding.observation = Observation(record.target, "cpu")
    spec = FlashMLASparse("cpu").repro_spec(finding)
    assert spec.prepare[0].args["paths"] == (q_concat, bf16_kernel) and not spec.bounds_checked
    files = render(finding, spec)
    script, support = files["repro.py"], files[SUPPORT_FILE]
    assert "paths=(q_concat, bf16_kernel))" in script and "with vllm_call(VIOLATIONS) as call:" in script
    assert len(support.splitlines()) <= 865, len(support.splitlines())
    modules = _support_sources(support)
    ops = modules["fuzzer.support.standins.flashmla_ops"]
    assert "def flash_mla_sparse_fwd(" in ops and "def concat_mla_q(" in ops
    for absent in ("def flash_mla_with_kvcache(", "def cp_gather_and_upconvert", "def dequantize_", "_records(",
                   "def get_mla_metadata("):
        assert absent not in ops, absent
    assert "def off_path(" in modules["fuzzer.support.flashmla_runtime"]
    assert "class InterpreterSanitizer" not in support
    assert (d / "repro.py").read_text() == script.replace(finding.id, record.id)
    assert (d / SUPPORT_FILE).read_text() == support.replace(finding.id, record.id)


def test_an_op_off_the_reproducers_path_refuses_so_the_reproducer_cannot_pass():
    """A path decided from the case too narrowly never reaches vLLM's compiled op: the op refuses, and the harness
    reads that as attnfuzz's failure (exit 2), never vLLM's answer."""
    from fuzzer.artifacts.repro_harness import vllms_answer
    from fuzzer.support.flashmla_runtime import bf16_kernel, off_path, q_concat

    with pytest.raises(NotImplementedError, match="not in this reproducer's path .q_concat, bf16_kernel.") as e:
        off_path("flash_mla_with_kvcache", (q_concat, bf16_kernel))(None, k_cache=None)
    assert not vllms_answer(e.value)


def test_binding_every_path_again_after_a_narrow_binding_lifts_its_refusals():
    """One process that bound a reproducer's narrow path and then every path (a campaign) gets every stand-in back."""
    import importlib

    from fuzzer.support.flashmla_runtime import BACKEND_MODULE, bf16_kernel, flashmla_sparse_backend, install_standins, q_concat

    flashmla_sparse_backend("cpu")
    mod = importlib.import_module(BACKEND_MODULE)
    install_standins("cpu", (q_concat, bf16_kernel))
    assert mod.flash_mla_with_kvcache.__name__ == "refuse"
    flashmla_sparse_backend("cpu")
    assert mod.flash_mla_with_kvcache.__name__ == "flash_mla_with_kvcache"


def test_a_flashmla_case_path_follows_its_cache_and_its_prefills():
    from fuzzer.support.flashmla_runtime import bf16_kernel, fp8_decode, fp8_prefill, q_concat
    from fuzzer.targets.flashmla_sparse import standin_paths

    def case(dtype, *query_lens):
        return SimpleNamespace(kv_cache_dtype=dtype, steps=[SimpleNamespace(
            requests=[SimpleNamespace(query_len=q) for q in query_lens])])

    assert standin_paths(case("bfloat16", 1, 5)) == (q_concat, bf16_kernel)
    assert standin_paths(case("fp8_ds_mla", 1, 1, 0)) == (q_concat, fp8_decode)
    assert standin_paths(case("fp8_ds_mla", 1, 3)) == (q_concat, fp8_decode, fp8_prefill)


def test_the_dsv4_judge_takes_c128a_rows_at_the_width_vllm_chose_and_names_what_differs():
    import torch

    from fuzzer.artifacts.repro_judges import judge_dsv4

    rows = torch.tensor([[[5, -1]], [[5, 6]]])  # the definition at its least width
    want = {"split": torch.tensor([2, 0, 2, 0]), "c128a_decode_indices": rows}
    got = {"split": want["split"].clone(), "c128a_decode_indices": torch.nn.functional.pad(rows, (0, 126), value=-1)}
    expected, cache = torch.zeros(2, 3, 4), torch.zeros(2, 5, dtype=torch.uint8)
    out = torch.full((3, 16, 4), float("nan"))  # a padding token's row, padded heads: left as they were
    out[:2, :3] = 0
    assert judge_dsv4(out, expected, got, want, [cache, None], [cache.clone(), None], 0.01, 0.01) == []
    got["c128a_decode_indices"][1, 0, 1] = 7
    out[2, 0, 0], changed = 1.0, cache.clone()
    changed[1, 2] = 1
    problems = judge_dsv4(out, expected, got, want, [changed, None], [cache, None], 0.01, 0.01)
    assert [p.split(":")[0] for p in problems] == ["metadata c128a_decode_indices",
                                                   "padding token 2 (slot -1, no request) got output",
                                                   "the SWA cache changed during attention"], problems
    got["c128a_decode_indices"] = rows  # as narrow as the definition: not a width the kernels take
    assert "multiple of 128" in judge_dsv4(out[:2], expected, got, want, [cache], [cache], 0.01, 0.01)[0]
