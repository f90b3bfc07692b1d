"""A newcomer's first minutes (issue 35): `attnfuzz list` and an argument error answer without importing vLLM or
torch (seconds, where vLLM's import alone takes 20-40 s on a 2-core host), with the right exit code. Each runs in a
new interpreter that reports, as it exits, which of them it imported."""

import json

import pytest

from fuzzer.commands.list import NOT_CHECKED, declared_unavailable
from fuzzer.targets.registry import declared
from tests.conftest import python

# The CLI as `attnfuzz` runs it, then one line on stderr: the heavy modules the process imported.
PROBE = """import json, sys
from fuzzer.cli import main
try:
    code = main(sys.argv[1:])
finally:
    print("IMPORTED " + json.dumps(sorted(m for m in ("vllm", "torch", "triton") if m in sys.modules)), file=sys.stderr)
sys.exit(code)
"""


def cli(*args: str):
    r = python("-c", PROBE, *args, fresh=True, timeout=120)  # fresh: not forked from a process that imported vLLM
    imported = json.loads(next(line for line in r.stderr.splitlines() if line.startswith("IMPORTED "))[9:])
    return r, imported


def test_list_imports_neither_vllm_nor_torch_and_says_what_it_did_not_check():
    r, imported = cli("list")
    assert r.returncode == 0, r.stdout + r.stderr
    assert imported == [], imported
    assert "vllm.index_remap" in r.stdout and "remap-no-length-check" in r.stdout
    assert NOT_CHECKED in r.stdout and "attnfuzz list --check" in r.stdout.replace("\n", "")
    assert "selftest.fault" in r.stdout


@pytest.mark.parametrize("db, words", [
    ("afile", "exists and is not a directory"),
    ("afile/examples", "cannot write there (") ,
    ("ftp://host/db", "not a directory or redis://host:port/n"),
])
def test_a_bad_db_is_refused_before_vllm_or_torch_loads(tmp_path, db, words):
    (tmp_path / "afile").write_text("")
    where = db if "://" in db else str(tmp_path / db)
    r, imported = cli("run", "--target", "vllm.index_remap", "--db", where, "--repros", str(tmp_path / "r"))
    assert r.returncode == 2 and f"--db {where}: " in r.stderr and words in r.stderr, r.stderr
    assert imported == [], imported
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("argv, words", [
    (("run", "--target", "no.such.target"), "unknown target 'no.such.target'"),
    (("run", "--target", "vllm.triton_sparse", "--kv-cache-dtype", "fp8_ds_mla"), "vllm.triton_sparse takes bfloat16"),
    (("run", "--target", "vllm.flashmla_sparse.dcp.ranks", "--inject", "softmax-masked-tile-nan"),
     "on vllm.flashmla_sparse.dcp.ranks it would change nothing"),
    (("replay", "/no/such/finding"), "no such file"),
])
def test_other_argument_errors_are_refused_before_vllm_or_torch_loads(argv, words):
    r, imported = cli(*argv)
    assert r.returncode == 2 and words in r.stderr, r.stderr
    assert imported == [], imported


def test_an_inject_meant_for_a_base_target_passes_the_checks_on_a_target_built_on_it():
    # The DCP ranks target derives from the emulated DCP one: its mutants change what the ranks run (read from the
    # declarations, as issubclass would answer).
    assert declared("vllm.flashmla_sparse.dcp.ranks").derives_from(declared("vllm.flashmla_sparse.dcp"))
    assert not declared("vllm.flashmla_sparse.dcp").derives_from(declared("vllm.flashmla_sparse.dcp.ranks"))


def test_runs_here_from_declarations(monkeypatch):
    from fuzzer.commands import list as list_command

    monkeypatch.setattr(list_command, "visible_gpus", lambda: 1)
    ranks, remap, fault = (declared(n) for n in ("vllm.flashmla_sparse.dcp.ranks", "vllm.index_remap", "selftest.fault"))
    assert declared_unavailable(ranks, "cuda") == "needs 2 GPUs; this host has 1"
    assert declared_unavailable(ranks, "cpu") == NOT_CHECKED  # a CPU host emulates its two ranks
    assert declared_unavailable(remap, "cuda") == NOT_CHECKED
    assert declared_unavailable(fault, "cpu") is None  # it runs no vLLM: nothing left to check
    monkeypatch.setattr(list_command, "find_spec", lambda name: None)
    assert declared_unavailable(remap, "cpu") == "vLLM is not installed (see README's set-up)"
