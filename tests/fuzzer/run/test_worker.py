"""Crash isolation on CPU: a worker that segfaults, aborts or hangs is replaced, the case it was running
becomes a finding and the campaign runs on; a SIGKILLed campaign resumes without losing a finding."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, python

pytestmark = pytest.mark.vllm  # the CLI imports vLLM once (the self-test target itself runs none of it)


def campaign(tmp_path, fault: str, *extra: str, max_examples: int = 20, wait: bool = True):
    state = tmp_path / "state"
    env = dict(os.environ, ATTNFUZZ_STATE=str(state), ATTNFUZZ_FAULT=fault)
    cmd = [sys.executable, "-m", "fuzzer.cli", "--device", "cpu", "run", "--target", "selftest.fault",
           "--max-examples", str(max_examples), "--repros", str(tmp_path / "repros"), "--json",
           str(tmp_path / "summary.json"), "--quiet", *extra]
    if not wait:  # a fresh interpreter in a session of its own: the test SIGKILLs it
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    return python(*cmd[1:], env=env, timeout=600)


# SIGABRT takes the same path as SIGSEGV in the worker's supervisor: CI runs one, the nightly job both
@pytest.mark.parametrize("fault,signature", [("segfault", "crash:killed-by-SIGSEGV"),
                                             pytest.param("abort", "crash:killed-by-SIGABRT",
                                                          marks=pytest.mark.nightly)])
def test_a_crash_on_the_third_case_does_not_stop_the_campaign(tmp_path, fault, signature):
    r = campaign(tmp_path, f"{fault}:3", "--reruns", "2")
    assert r.returncode == 1, r.stderr[-2000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["examples"] >= 20 and s["workers_started"] >= 2
    (finding,) = s["findings"]
    assert finding["signature"] == signature
    assert finding["reruns"] == {"reproduced": 0, "of": 2, "flaky": True}  # the fault followed the count
    assert (tmp_path / "repros" / finding["id"] / "case.json").exists()


def test_a_hang_is_confirmed_on_a_fresh_worker_before_it_is_a_hang(tmp_path, monkeypatch):
    """The watchdog at a second's scale (a campaign's --case-timeout is at least 5 s: the nightly test below runs it
    end to end, finding and report): the case that hangs is killed, runs again on a fresh worker with HANG_CONFIRM
    times the deadline, and hangs there too: a hang."""
    from fuzzer.run.worker import HANG_CONFIRM, WorkerExecutor, WorkerSpec
    from strategies.case import Case, Request, TopkSpec

    for name, value in (("ATTNFUZZ_STATE", tmp_path / "state"), ("ATTNFUZZ_FAULT", "hang:1,hang:2"),
                        ("ATTNFUZZ_FAULT_COUNTER", tmp_path / "count")):
        monkeypatch.setenv(name, str(value))
    executor = WorkerExecutor(WorkerSpec("selftest.fault", "cpu", case_timeout=1.0), tmp_path / "logs")
    try:
        obs, verdicts = executor.check(Case((Request(1, 0),), 1, 64, ((1,),), 128, (TopkSpec(0),)))
    finally:
        executor.close()
    title = f"no result within 1 s, nor within {HANG_CONFIRM} s on a fresh worker (watchdog): worker killed"
    assert [(v.check, v.detail) for v in verdicts] == [("hang", title)] and executor.started == 2
    assert obs.notes["watchdog"] == {"deadline_s": 1.0, "confirm_s": float(HANG_CONFIRM)}


@pytest.mark.nightly  # two watchdog deadlines of 5 and 20 s in a campaign: ~50 s (the test above: the same at 1 s)
def test_a_hang_is_killed_by_the_watchdog_and_confirmed_on_a_fresh_worker(tmp_path):
    # The 2nd case hangs, and so does its re-run on a fresh worker (the fault counter's 3rd case).
    r = campaign(tmp_path, "hang:2,hang:3", "--case-timeout", "5s", "--reruns", "0", max_examples=6)
    assert r.returncode == 1, r.stderr[-2000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    (finding,) = s["findings"]
    assert finding["signature"] == "hang:hang" and s["examples"] >= 6
    title = "no result within 5 s, nor within 20 s on a fresh worker (watchdog): worker killed"
    assert [v["detail"] for v in finding["verdicts"]] == [title] and title in r.stdout.replace("\n", "")
    report = (tmp_path / "repros" / finding["id"] / "report.md").read_text()
    assert "- seen by: the watchdog: no result within 5 s, nor within 20 s on a fresh worker\n" in report


@pytest.mark.nightly  # 29 s; CI keeps the watchdog's path in the two hang tests above
def test_a_case_past_the_deadline_once_is_no_hang(tmp_path):
    """Once: `--case-timeout 5s` on a loaded 2-core host saved a working case as a hang (0 of 3 re-runs, after 5
    minutes of shrinking, exit 1). A case past the watchdog's deadline runs again on a fresh worker with a longer
    one, and the answer it gives there is its verdict: here it passes (the fault counter's 3rd case hangs not)."""
    r = campaign(tmp_path, "hang:2", "--case-timeout", "5s", "--reruns", "0", max_examples=6)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["findings"] == [] and s["examples"] >= 6 and s["workers_started"] == 2
    assert "0 finding(s)" in " ".join(r.stdout.split()) and "hang" not in r.stdout  # rich wraps the summary
    assert not (tmp_path / "repros").exists() or not any((tmp_path / "repros").iterdir())


def test_the_watchdogs_deadline_learns_from_the_cases_own_times(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from fuzzer.run import worker
    from fuzzer.run.worker import HANG_FACTOR, RECENT_CASES, WorkerExecutor, WorkerSpec

    executor = WorkerExecutor(WorkerSpec("selftest.fault", "cpu", case_timeout=5.0), tmp_path / "logs")
    assert executor.deadline() == 5.0  # no case yet: --case-timeout
    executor.recent.extend([0.1, 0.2])
    assert executor.deadline() == 5.0  # fast cases: --case-timeout is the floor
    executor.recent.append(3.0)
    assert executor.deadline() == 3.0 * HANG_FACTOR  # a multiple of the slowest recent case
    executor.recent.extend([0.1] * RECENT_CASES)
    assert executor.deadline() == 5.0  # the slow case is no longer recent
    assert worker._run_delays(os.getpid())  # this kernel tells each thread's wait for a CPU
    # A case's own time: the wall clock's less the longest wait for a CPU of one of the worker's threads.
    executor.proc = SimpleNamespace(pid=1)
    executor._starved_from = {(1, 1): 1.0, (1, 2): 0.5}
    monkeypatch.setattr(worker, "_run_delays", lambda pid: {(1, 1): 4.0, (1, 2): 1.0, (1, 3): 0.5})
    assert 6.9 < executor._own_seconds(time.perf_counter() - 10.0) < 7.5  # 10 s, 3 of them queued for a CPU
    executor.proc = None


def test_sigkill_of_the_campaign_loses_no_finding(tmp_path):
    # A segfault on case 3 (a finding, saved at once), then a hang on case 6: kill the campaign there.
    proc = campaign(tmp_path, "segfault:3,hang:6", "--case-timeout", "600s", max_examples=30, wait=False)
    journal = tmp_path / "state" / "journal" / "selftest.fault.json"
    counter = tmp_path / "state" / "selftest-fault-count"
    deadline = time.time() + 300
    while time.time() < deadline and not (counter.exists() and counter.read_text() == "6" and journal.exists()):
        time.sleep(0.5)
    assert journal.exists(), "the campaign never reached the hanging case"
    pending = list((tmp_path / "state" / "pending" / "selftest.fault").glob("*/finding.json"))
    assert len(pending) == 1  # the segfault finding is already on disk
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(1)  # the worker follows its parent (PR_SET_PDEATHSIG)
    # Resume with no more faults: the saved finding comes back, the journaled case is checked again.
    r = campaign(tmp_path, "segfault:0", "--reruns", "0", max_examples=10)
    assert r.returncode == 1, r.stderr[-2000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert [f["signature"] for f in s["findings"]] == ["crash:killed-by-SIGSEGV"]
    assert not journal.exists()
    assert not list((tmp_path / "state" / "pending" / "selftest.fault").glob("*/finding.json"))


@pytest.mark.nightly  # ~70 s (three workers start); CI keeps the replace-a-dead-worker path in the crash tests above
def test_a_lost_device_replaces_the_worker_and_a_recycled_worker_is_replaced_too(tmp_path, monkeypatch):
    from fuzzer.run.worker import WorkerExecutor, WorkerSpec
    from strategies.case import Case

    monkeypatch.setenv("ATTNFUZZ_STATE", str(tmp_path / "state"))
    monkeypatch.setenv("ATTNFUZZ_FAULT", "device-lost:2")
    case = Case.from_json((ROOT / "repros" / "index-remap-7e944ef6" / "case.json").read_text())
    executor = WorkerExecutor(WorkerSpec("selftest.fault", "cpu", recycle_after=3), tmp_path / "logs")
    try:
        results = [executor.check(case) for _ in range(5)]
    finally:
        executor.close()
    lost = results[1][1]
    assert [v.where for v in lost] == ["device_lost"] and "out of memory" in lost[0].detail
    assert all(v.ok for _, verdicts in results[2:] for v in verdicts)
    # case 2 lost the device (worker 2 next); worker 2 served cases 3-5, recycled after its third
    assert executor.started == 2 and results[4][0].notes.get("worker_recycled") == "after 3 cases"


PARENT_PLANS = """
import json, sys
from fuzzer.targets.registry import TARGETS
from fuzzer.targets.vllm_api import RemapApi
from strategies.profiles import PROFILES

plans = json.loads(sys.argv[1])
api = RemapApi("0.33.0", frozenset({"BLOCK_SIZE", "BLOCK_STRIDE_ROWS", "idx_mapping"}),
               frozenset({"BLOCK_SIZE", "BLOCK_STRIDE_ROWS", "cp_kv_cache_interleave_size"}), True, True)
for name, cls in TARGETS.items():
    target = cls("cpu")
    target.adopt({k: api if k == "api" else plans.get(k) for k in target.PLANNED})
    target.cases(PROFILES["cpu"]).strategy()
print("vllm imported by:", sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))[:5] or "none")
"""


def test_a_campaigns_parent_plans_every_target_without_vllm():
    """The parent of a worker campaign draws cases from what the worker's prepare() reported (`Target.PLANNED`):
    it never imports vLLM itself, which would add vLLM's import (6-21 s) to every campaign's clock."""
    plans = json.dumps({"block_stride_rows": True, "world": 2, "kv_records": [584, 528]})
    r = subprocess.run([sys.executable, "-c", PARENT_PLANS, plans], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("vllm imported by: none"), r.stdout[-2000:]


def test_an_out_of_memory_that_no_rerun_repeats_is_the_hosts_not_a_finding(tmp_path):
    """Three sanitized campaigns on an 80 GB H100 lost their contexts to "out of memory" at the same second, and no
    re-run on a fresh worker did again: the device was short, not the case. Such a case is untested (exit 2, named),
    never a finding; one that runs out of memory on its re-run too stays a finding."""
    r = campaign(tmp_path, "device-lost:2", "--reruns", "1", "--no-shrink", max_examples=3)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["findings"] == [] and len(s["host_faults"]) == 1 and "out of memory" in s["host_faults"][0]
    assert not list((tmp_path / "state" / "pending" / "selftest.fault").glob("*/finding.json"))
    again = tmp_path / "again"
    again.mkdir()
    r = campaign(again, "device-lost:2,device-lost:4", "--reruns", "1", "--no-shrink", max_examples=3)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    s = json.loads((again / "summary.json").read_text())
    assert len(s["findings"]) == 1 and s["host_faults"] == []


def test_a_sanitized_worker_is_replaced_once_half_the_memory_free_at_its_start_is_gone(tmp_path):
    """Under initcheck a worker's device memory grows outside PyTorch's allocator (an H100 ran out after ~120 cases,
    before the 150-case recycle): the worker reports low memory, and the executor replaces it after that case."""
    from fuzzer.observation import Observation
    from fuzzer.run.worker import SANITIZED_RECYCLING, WorkerExecutor, WorkerSpec, device_memory_low

    gib = 1 << 30
    assert device_memory_low(41 * gib, 80 * gib, 0.5) is None
    assert device_memory_low(39 * gib, 80 * gib, 0.5) == "free device memory 39936 MiB, 81920 MiB at the worker's start"
    assert device_memory_low(None, 80 * gib, 0.5) is None and device_memory_low(1, None, 0.5) is None  # not CUDA
    executor = WorkerExecutor(WorkerSpec("selftest.fault", "cuda", sanitizer="initcheck", **SANITIZED_RECYCLING),
                              tmp_path / "logs")
    executor._cases_this_worker = 7
    assert executor._recycle_why(Observation("selftest.fault", "cuda")) is None
    low = Observation("selftest.fault", "cuda", notes={"device_memory_low": "free device memory 39936 MiB, ..."})
    assert executor._recycle_why(low) == "after 7 cases: free device memory 39936 MiB, ..."
    executor._cases_this_worker = SANITIZED_RECYCLING["recycle_after"]
    assert executor._recycle_why(Observation("selftest.fault", "cuda")) == "after 150 cases"
