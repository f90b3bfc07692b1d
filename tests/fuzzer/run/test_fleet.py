"""Nightly runs (`attnfuzz run --workers N|auto --db ...`): worker planning, the shared example database, the
signature index and the merge, and end to end on CPU: two workers on one database, findings deduplicated, a
SIGTERM that still saves them, and a second run (other seeds) that replays the stored failure first."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from hypothesis.database import InMemoryExampleDatabase

from fuzzer.cli import parser
from fuzzer.errors import UsageError
from fuzzer.run import fleet, mps
from fuzzer.search import database
from strategies.case import Case, Request, TopkSpec
from tests.conftest import ROOT, python


def _case(*query_lens: int) -> Case:
    n = len(query_lens)
    return Case(requests=tuple(Request(q, 0) for q in query_lens), num_decodes=0, block_size=64,
                block_table=tuple((i + 1,) for i in range(n)), topk_width=128, topk=(TopkSpec(1),) * n)


def _worker_finding(plan: fleet.WorkerPlan, case: Case, signature: str, *, pending: bool = False,
                    target: str = "vllm.index_remap") -> str:
    """What a worker leaves: repros/<id>/ once saved, repros/.pending/<hash>/ while (or if killed) running."""
    fid = f"{target.split('.')[-1]}-{abs(hash((signature, case.to_json(None)))) % 10**8:08d}"
    d = (plan.pending / target if pending else plan.repros) / fid
    d.mkdir(parents=True)
    (d / "case.json").write_text(case.to_json())
    (d / "finding.json").write_text(json.dumps({"id": fid, "target": target, "signature": signature,
                                                "inject": None, "examples_to_find": 3, "summary": case.summary(),
                                                "verdicts": [{"check": signature.split(":")[0], "ok": False,
                                                              "detail": signature}]}))
    (d / "repro.py").write_text("raise SystemExit(1)\n")
    return fid


def _args(*argv: str):
    run_argv = ["--target", "vllm.index_remap", *argv]
    args = parser().parse_args(["--device", "cpu", "run", *run_argv])
    args.run_argv = run_argv  # as fuzzer.cli.main keeps them
    return args


# -- planning ------------------------------------------------------------------------------------------------

def test_workers_option():
    assert _args("--workers", "auto").workers == "auto" and _args("--workers", "3").workers == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            _args("--workers", bad)


def test_plan_gives_distinct_seeds_gpus_and_state(tmp_path, monkeypatch):
    assert len(fleet.plan_workers("auto", "cpu", 0, tmp_path)) == 1  # a CPU host: one unless N is given
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    plans = fleet.plan_workers("auto", "cuda", 10, tmp_path)
    assert [(p.seed, p.gpu) for p in plans] == [(10, "3"), (11, "5")]
    plans = fleet.plan_workers(3, "cuda", 0, tmp_path)  # more workers than GPUs: round-robin
    assert [p.gpu for p in plans] == ["3", "5", "3"] and len({p.dir for p in plans}) == 3


def test_worker_command_passes_options_through_and_sets_its_own(tmp_path):
    args = _args("--workers", "2", "--seed", "5", "--inject", "remap-no-length-check", "--time-budget", "8h",
                 "--no-shrink", "--json", "/x/merged.json", "--quiet", "--mps")
    plan = fleet.plan_workers(args.workers, "cpu", args.seed, tmp_path)[1]
    cmd = fleet.worker_command(args, "cpu", plan, "/shared/db")
    assert cmd[cmd.index("--seed") + 1] == "6" and cmd[cmd.index("--db") + 1] == "/shared/db"
    assert cmd[cmd.index("--json") + 1] == str(plan.summary) and cmd[cmd.index("--repros") + 1] == str(plan.repros)
    assert cmd[cmd.index("--inject") + 1] == "remap-no-length-check" and "--no-shrink" in cmd
    assert cmd[cmd.index("--time-budget") + 1] == "8h"  # as given
    assert "--workers" not in cmd and "--quiet" not in cmd and "/x/merged.json" not in cmd and "--mps" not in cmd
    assert parser().parse_args(cmd[3:]).workers is None  # the worker is a plain campaign


# -- MPS: the fleet's own control daemon, through a stand-in for nvidia-cuda-mps-control (the real one: GPU host) --

_CONTROL = """#!/bin/sh
# nvidia-cuda-mps-control as the fleet uses it: -d starts the daemon (its control pipe appears in
# CUDA_MPS_PIPE_DIRECTORY); "quit" on stdin ends it (the pipe goes).
[ -n "$REFUSE" ] && { echo "$REFUSE" >&2; exit 1; }
if [ "$1" = -d ]; then
  echo "$CUDA_VISIBLE_DEVICES $CUDA_MPS_LOG_DIRECTORY" > "$CUDA_MPS_PIPE_DIRECTORY/started-for"
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0
fi
read -r cmd; [ "$cmd" = quit ] && rm "$CUDA_MPS_PIPE_DIRECTORY/control"
"""


@pytest.fixture
def control(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / mps.CONTROL).write_text(_CONTROL)
    (bin_dir / mps.CONTROL).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr(mps, "DEFAULT_PIPE_DIRECTORY", str(tmp_path / "nvidia-mps"))  # none serves by default
    return tmp_path


def test_mps_daemon_of_the_fleet_s_own_serves_its_workers_and_is_quit(control):
    daemon = mps.start(["0", "1"])
    pipe = daemon.pipe_directory
    assert daemon.started and (control / "nvidia-mps").exists() is False
    assert open(f"{pipe}/started-for").read().split() == ["0,1", daemon.log_directory]
    plan = fleet.plan_workers(2, "cpu", 0, control / "w")[0]
    env = fleet._worker_env(plan, daemon)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == pipe and env["CUDA_MPS_LOG_DIRECTORY"] == daemon.log_directory
    assert len(f"{pipe}/control") < 108  # a Unix socket's path
    mps.stop(daemon)
    assert not os.path.exists(pipe)


def test_mps_daemon_already_serving_is_used_and_left_running(control):
    serving = control / "nvidia-mps"
    serving.mkdir()
    (serving / "control").touch()
    daemon = mps.start(["0"])
    assert not daemon.started and daemon.pipe_directory == str(serving) and mps.serving() == str(serving)
    mps.stop(daemon)
    assert (serving / "control").exists()


def test_mps_daemon_that_cannot_start_is_a_usage_error_naming_why(control, monkeypatch):
    monkeypatch.setenv("REFUSE", "An instance of this daemon is already running")
    with pytest.raises(UsageError, match="did not start a daemon.*already running"):
        mps.start(["0"])
    monkeypatch.setenv("PATH", str(control / "nowhere"))
    with pytest.raises(UsageError, match="not on PATH"):
        mps.start(["0"])


def test_mps_is_for_workers_on_a_gpu(tmp_path):
    from fuzzer.commands import run

    for argv, device in ((("--mps",), "cuda"), (("--mps", "--workers", "2"), "cpu")):
        args = _args(*argv, "--repros", str(tmp_path))
        with pytest.raises(UsageError, match="--mps: for --workers on a GPU"):
            run.validate(args, device)


# -- the database and the signature index --------------------------------------------------------------------

def test_db_spec_errors_name_the_option(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    for spec, words in ((str(tmp_path / "file"), "not a directory"), ("http://host/db", "redis://host:port/n")):
        with pytest.raises(UsageError, match=words):
            database.example_database(spec)
    monkeypatch.setitem(sys.modules, "redis", None)  # the package is not installed
    with pytest.raises(UsageError, match="needs the `redis` package"):
        database.example_database("redis://localhost:6379/0")


def test_settled_bugs_keep_their_stored_examples():
    db = InMemoryExampleDatabase()
    kept = database.KeepStoredFailures(db)
    kept.save(b"k", b"a")
    kept.save(b"k", b"b")
    kept.delete(b"k", b"a")  # what Hypothesis does to a stored failure that no longer raises
    kept.move(b"k", b"k.secondary", b"b")  # a shrink's downgrade still goes through
    assert set(db.fetch(b"k")) == {b"a"} and set(db.fetch(b"k.secondary")) == {b"b"}
    kept.save(b"k.pareto", b"p")
    kept.delete(b"k.pareto", b"p")  # the pareto front's evictions too: it stays bounded in a long run
    assert set(db.fetch(b"k.pareto")) == set()


def test_directory_index_claims_each_signature_once(tmp_path):
    index = database.signature_index(str(tmp_path))
    assert index.claim("t|-|sig", {"id": "first"}) is None
    assert index.claim("t|-|sig", {"id": "second"})["id"] == "first"
    assert index.claim("t|-|other", {"id": "x"}) is None
    assert len(list((tmp_path / database.SIGNATURES_DIR).glob("*.json"))) == 2


def _redis_url() -> str | None:
    url = os.environ.get("ATTNFUZZ_TEST_REDIS", "redis://127.0.0.1:6379/15")
    host, port = url.split("//")[1].split("/")[0].split(":")
    try:
        socket.create_connection((host, int(port)), timeout=0.5).close()
        import redis  # noqa: F401
    except (OSError, ImportError):
        return None
    return url


def test_redis_database_and_index():
    url = _redis_url()
    if url is None:
        pytest.skip("no Redis server reachable (ATTNFUZZ_TEST_REDIS) or no `redis` package")
    db = database.example_database(url)
    index = database.signature_index(url)
    index.client.delete(fleet.SIGNATURES_HASH)
    db.save(b"attnfuzz-test", b"choices")
    assert b"choices" in set(database.example_database(url).fetch(b"attnfuzz-test"))
    db.delete(b"attnfuzz-test", b"choices")
    assert index.claim("t|-|sig", {"id": "first"}) is None and index.claim("t|-|sig", {})["id"] == "first"
    index.client.delete(fleet.SIGNATURES_HASH)


# -- merging -------------------------------------------------------------------------------------------------

def test_merge_keeps_the_smallest_case_and_counts_duplicates(tmp_path):
    w0, w1 = fleet.plan_workers(2, "cpu", 0, tmp_path / "fleet")
    big = _worker_finding(w0, _case(9, 4), "memory:k")
    small = _worker_finding(w1, _case(2), "memory:k")
    other = _worker_finding(w1, _case(3), "nan:nan")
    left = _worker_finding(w0, _case(1), "crash:killed-by-SIGSEGV", pending=True)  # a killed worker's
    index, repros = database.signature_index(str(tmp_path / "db")), tmp_path / "repros"
    merged = fleet.merge([w0, w1], index, repros, {"vllm": "0.33.0", "device": "cpu"})
    assert sorted(p.name for p in repros.iterdir()) == sorted([small, other])
    by_sig = {f["signature"]: f for f in merged.saved}
    assert by_sig["memory:k"]["workers"] == [0, 1] and by_sig["memory:k"]["found_by"] == 1
    assert merged.duplicates == 1 and not (w0.repros / big).exists()  # the duplicate is gone
    assert [f["id"] for f in merged.pending] == [left] and (w0.pending / "vllm.index_remap" / left).exists()

    # A later run (or another host) finds the same bug again: counted, not saved again.
    again = _worker_finding(w0, _case(1, 1), "memory:k")
    merged = fleet.merge([w0, w1], index, repros, {})
    assert merged.saved == [] and merged.known[0]["saved_as"]["id"] == small
    assert not (repros / again).exists() and not (w0.repros / again).exists()


# -- end to end (CPU, vLLM's real code; each worker imports vLLM once) -----------------------------------------

def _fleet(tmp_path, *argv: str, wait: bool = True):
    env = dict(os.environ, ATTNFUZZ_STATE=str(tmp_path / "state"))
    cmd = [sys.executable, "-m", "fuzzer.cli", "--device", "cpu", "run", "--target", "vllm.flashmla_sparse",
           "--inject", "flashmla-topk-length-dropped", "--db", str(tmp_path / "db"), "--repros",
           str(tmp_path / "repros"), "--isolation", "none", "--no-shrink", "--reruns", "1", *argv]
    if not wait:  # a fresh interpreter: the test signals it
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return python(*cmd[1:], env=env, timeout=600)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.nightly  # 58 s; CI keeps the merge, the directory index and the report's sums as unit tests
def test_two_workers_dedup_and_a_second_run_replays_first(tmp_path):
    # Run 1: two workers on one database until both have found the bug, then SIGTERM: they still save it.
    proc = _fleet(tmp_path, "--workers", "2", "--time-budget", "10m", "--json", str(tmp_path / "s1.json"),
                  wait=False)
    workers = tmp_path / "state" / "fleet" / "vllm.flashmla_sparse"
    deadline = time.time() + 300
    while time.time() < deadline and not all(any((workers / w / "pending").glob("*/*/finding.json"))
                                             for w in ("w0", "w1")):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, out + err[-3000:]
    s1 = json.loads((tmp_path / "s1.json").read_text())
    assert s1["interrupted"] and [w["seed"] for w in s1["workers"]] == [0, 1]
    assert s1["findings"] and s1["pending"] == [] and s1["duplicates_merged"] >= 1
    assert any(f["workers"] == [0, 1] and f["duplicates"] == 1 for f in s1["findings"])
    saved = {f["id"] for f in s1["findings"]}
    assert {p.name for p in (tmp_path / "repros").iterdir()} == saved  # one repro per signature
    assert all((tmp_path / "repros" / i / "repro.py").exists() for i in saved)

    # Run 2: other seeds, the same database: a stored failure is replayed on the first case and counted as
    # already saved. The database holds both workers' failing cases, so the replay may be the duplicate run 1
    # merged away (another id, the same signature): it is known as the saved one either way. One case only: the
    # mutant has more signatures than run 1 may have reached before its SIGTERM, and a second replay can hit one.
    r = _fleet(tmp_path, "--workers", "1", "--seed", "7", "--max-examples", "1", "--json", str(tmp_path / "s2.json"))
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]
    s2 = json.loads((tmp_path / "s2.json").read_text())
    assert s2["findings"] == [] and s2["known"]
    # Stand-ins are named in the fleet's summary too (a CPU: FlashMLA's kernels are attnfuzz's).
    assert "flash_mla_sparse_fwd" in s2["emulated"] and "flash_mla_sparse_fwd" in s2["host"]["emulated_ops"]
    assert s2["allocator_poisoned"] == 0
    assert {"pairs", "triples", "paths"} <= set(s2["workers"][0]["coverage"])  # each worker's coverage, as run's
    first = min(s2["known"], key=lambda f: f["examples_to_find"])
    assert first["examples_to_find"] == 1 and first["saved_as"]["id"] in saved
    assert {p.name for p in (tmp_path / "repros").iterdir()} == saved


def test_report_sums_each_known_bug_s_hits_over_the_workers(tmp_path):
    # `run --known SIG --workers N`: each worker counts the known bug's hits; the fleet's summary adds them up.
    from types import SimpleNamespace

    from fuzzer.records import RunSummary

    plans = [fleet.WorkerPlan(i, i, None, tmp_path / f"w{i}") for i in range(2)]
    for plan, hits in zip(plans, (3, 4)):
        plan.dir.mkdir()
        RunSummary(target="vllm.flashinfer_sparse_sm90", seed=plan.seed, examples=10, seconds=1.0, findings=[],
                   checks={"padded_rows:FAIL": hits}, known_hits={"padded_rows:padded_rows": hits}).write(plan.summary)
    args = SimpleNamespace(target="vllm.flashinfer_sparse_sm90", seed=0, json=tmp_path / "fleet.json")
    procs = [SimpleNamespace(returncode=0) for _ in plans]
    assert fleet._report(args, plans, procs, fleet.Merged(), "db", 2.0, False) == 0
    summary = json.loads((tmp_path / "fleet.json").read_text())
    assert summary["known_hits"] == {"padded_rows:padded_rows": 7} and summary["checks"] == {"padded_rows:FAIL": 7}
