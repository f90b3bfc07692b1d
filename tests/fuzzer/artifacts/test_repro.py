"""Reproducers: one skeleton rendered from a target's ReproSpec, the support code in one generated file."""

import ast
import json
import pkgutil
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest

import fuzzer.support
from fuzzer.artifacts.repro import SUPPORT_FILE, compact_list, render, support_file, support_modules
from fuzzer.repro_spec import Judge, ReproSpec
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


def test_support_modules_import_nothing_of_attnfuzz_but_each_other():
    """Every support module's closure stays inside fuzzer.support, and the file holds exactly that closure."""
    text = support_file(support_modules(ALL_SUPPORT))
    sources = _support_sources(text)
    assert set(sources) == set(ALL_SUPPORT)
    assert _imports(text) <= {"importlib", "linecache", "sys"}  # the loader itself: the standard library
    for name, source in sources.items():
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ATTNFUZZ:
                assert node.level == 0
                assert node.module in sources or all(f"{node.module}.{a.name}" in sources for a in node.names), (
                    f"{name} imports {node.module} ({[a.name for a in node.names]}), which the support file lacks")
            elif isinstance(node, ast.Import):
                assert not [a.name for a in node.names if a.name.split(".")[0] in ATTNFUZZ and a.name not in sources], name
    # The closure of one module is what it needs, not everything.
    assert support_modules(["fuzzer.support.interp.sanitizer"]) == ["fuzzer.support.interp.sanitizer"]
    assert "fuzzer.support.dcp_group" not in support_modules(["fuzzer.support.flashmla_runtime"])


def test_the_support_file_imports_its_modules_under_their_own_names_without_attnfuzz(tmp_path):
    """Imported from a directory of its own, it serves every module from itself, and attnfuzz stays unreachable
    (even where attnfuzz is installed: the venvs install it editable)."""
    (tmp_path / SUPPORT_FILE).write_text(support_file(support_modules(ALL_SUPPORT)))
    probe = (
        "import sys, importlib\n"
        "import attnfuzz_support\n"
        "from attnfuzz_support import flashmla_runtime, sanitizer, flashmla_ops, dcp_group\n"
        "mods = [m for n, m in sys.modules.items() if n.split('.')[0] in ('fuzzer', 'oracles', 'strategies')]\n"
        "assert all(type(m.__spec__.loader).__name__ == '_SupportFinder' for m in mods), mods\n"
        "assert flashmla_ops.SANITIZER is sanitizer.SANITIZER  # one module, shared by its importers\n"
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


def test_the_skeleton_renders_a_spec_into_a_script_and_its_support_file():
    spec = ReproSpec(about="Shrunk case: one token.", call="out = torch.zeros(1, 1, 1)\n",
                     judge=Judge("attention", dict(out="out", expected='T["expected_out"]', cache="cache",
                                                   before="cache", atol="ATOL", rtol="RTOL")),
                     setup="cache = torch.zeros(2)\n", constants={"ATOL": 0.01, "RTOL": 0.01},
                     tensors={"expected_out": None}, support={"runtime": "fuzzer.support.flashmla_runtime"},
                     bounds_checked=True)
    files = render(_finding(), spec)
    assert set(files) == {"repro.py", SUPPORT_FILE}
    script = files["repro.py"]
    compile(script, "repro.py", "exec")
    assert _script_imports(script) <= ALLOWED_IMPORTS
    assert "from attnfuzz_support import flashmla_runtime as runtime, sanitizer" in script
    assert 'os.environ["TRITON_INTERPRET"] = "1"' in script and "sanitizer.SANITIZER.collect()" in script
    assert "def judge_attention(" in script and "def compare_to_reference(" in script and "def judge_dcp(" not in script
    assert "problems += judge_attention(out, expected=T[\"expected_out\"], cache=cache, before=cache" in script
    assert "'fuzzer.support.standins.flashmla_ops'" in files[SUPPORT_FILE]  # flashmla_runtime imports it
    # On a GPU: no interpreter, no bounds checker; with no support modules, no support file.
    gpu = render(_finding("cuda"), ReproSpec(about="", call="out = 1\n", judge=Judge("index_contract", dict(
        req_id_per_token="r", topk_indices="t"))))
    assert set(gpu) == {"repro.py"} and "TRITON_INTERPRET" not in gpu["repro.py"]
    assert "contextlib.nullcontext([])" in gpu["repro.py"] and "attnfuzz_support" not in gpu["repro.py"]


def test_a_judge_is_called_with_exactly_its_parameters():
    with pytest.raises(ValueError, match="no expression for"):
        render(_finding(), ReproSpec(about="", call="", judge=Judge("index", {"out": "out"})))
    with pytest.raises(ValueError, match="no parameter"):
        render(_finding(), ReproSpec(about="", call="", judge=Judge("index_contract", {"nope": "1"})))
    with pytest.raises(ValueError, match="judge"):
        Judge("exact")


def test_the_standalone_form_inlines_the_support_file(tmp_path):
    spec = ReproSpec(about="", call="out = sanitizer.MAX_VIOLATIONS\n",
                     judge=Judge("index_contract", dict(req_id_per_token="out", topk_indices="out")), bounds_checked=True)
    files = render(_finding(), spec, standalone=True)
    assert set(files) == {"repro.py"}
    script = files["repro.py"]
    assert 'sys.modules["attnfuzz_support"] = sys.modules[__name__]' in script
    assert script.index("SUPPORT = {") > script.index("def main():")  # the calls first, the support at the end


@pytest.mark.vllm
def test_a_one_token_flashmla_reproducer_is_short_and_reads_as_vllm_calls():
    """The committed one-token FlashMLA case, rendered: <= 150 lines, imports nothing of attnfuzz, and its
    support file holds only the modules its path uses (no DCP group)."""
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
    assert spec.tensors["q"].shape[0] == 1 and spec.judge.name == "attention"
    files = render(finding, spec)
    script = files["repro.py"]
    assert len(script.splitlines()) <= 150, len(script.splitlines())
    assert _script_imports(script) <= ALLOWED_IMPORTS
    assert "impl.forward_mqa(" in script and "Backend.get_builder_cls()" in script
    assert "'fuzzer.support.dcp_group'" not in files[SUPPORT_FILE]
    # The committed reproducer is this rendering (but for the id it was saved under).
    assert (d / "repro.py").read_text() == script.replace(finding.id, meta["id"])


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
