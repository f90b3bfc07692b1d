"""A finding's report.md says who saw the failure and what its case is: shrunk, or not and why."""

import pytest

from fuzzer.artifacts.finding_report import render_report
from fuzzer.env import HostInfo
from fuzzer.observation import Observation
from fuzzer.records import Finding
from oracles.verdict import Verdict
from tests.strategies.test_case import small_case

HOST = HostInfo("cpu", "x86_64", "0.33.0", "2.13", "3.9", "3.11", True)
HANG = "no result within 5 s, nor within 20 s on a fresh worker (watchdog): worker killed"


def _finding(verdict: Verdict, error_type=None, error=None, shrunk=False, **notes) -> Finding:
    obs = Observation("selftest.fault", "cpu", error_type=error_type, error=error, notes=notes)
    return Finding("selftest.fault", verdict.signature, small_case(), [verdict], obs, HOST, None, 2, 1.0,
                   has_repro=False, shrunk=shrunk)


@pytest.mark.parametrize("finding, seen", [
    (_finding(Verdict("hang", False, HANG, where="hang"), "Hang", HANG),
     "the watchdog: no result within 5 s, nor within 20 s on a fresh worker"),
    (_finding(Verdict("crash", False, "worker died (killed by SIGSEGV)", where="killed-by-SIGSEGV"), "WorkerCrash",
              "the worker died running this case (killed by SIGSEGV)"),
     "the campaign: the worker died running this case (killed by SIGSEGV)"),
    (_finding(Verdict("output", False, "row 0 differs", where="x")), "the oracle"),
    (_finding(Verdict("memory", False, "Invalid __global__ read", "C", where="memcheck:k:1"), sanitizer="memcheck"),
     "compute-sanitizer memcheck"),
])
def test_the_report_says_who_saw_the_failure(finding, seen):
    assert f"- seen by: {seen}\n" in render_report(finding)


@pytest.mark.parametrize("kept, notes, words", [
    (True, {}, "shrunk to: `"),
    (False, {}, "not shrunk (the campaign ran without shrinking, --no-shrink): the case as first found, `"),
    (False, {"shrink_cut_short": True}, "not shrunk to the end (a signal stopped its shrink): the smallest failing"),
    (False, {"resumed": True}, "as a killed campaign left it (its shrink may not have finished): `"),
])
def test_the_report_says_whether_the_case_was_shrunk(kept, notes, words):
    report = render_report(_finding(Verdict("output", False, "row 0 differs", where="x"), shrunk=kept, **notes))
    assert words in report
    assert ("shrunk to:" in report) is kept
