"""A campaign runs no more cases than asked: Hypothesis replays its whole stored corpus (a fleet's shared
database) whatever max_examples says, and SIGTERM stops a shrink too (its best case is already on disk)."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.database import InMemoryExampleDatabase

from fuzzer.env import HostInfo
from fuzzer.observation import Observation
from fuzzer.run.executors import InProcessExecutor
from fuzzer.search.campaign import Campaign, _Stop
from fuzzer.targets.base import Target
from oracles.verdict import Verdict, passed
from strategies.batches import CaseSpace
from strategies.case import Case, Request, TopkSpec
from strategies.profiles import PROFILES

HOST = HostInfo("cpu", "test", "-", "-", "-", "-", False)


def _case(n: int) -> Case:
    return Case(requests=(Request(1, n),), num_decodes=1, block_size=64, block_table=((1,) * (1 + n // 64),),
                topk_width=128, topk=(TopkSpec(valid=1),)).validate()


class Counting(Target):
    """Runs nothing: counts the cases it is given; fails on contexts of 13."""
    name, summary, bug_classes = "test.counting", "counts cases", ""
    oracle = staticmethod(lambda case, obs: [Verdict("output", False, "13", where="x")] if case.requests[0].context_len == 13
                          else [passed("output", "fine")])

    def __init__(self, device="cpu"):
        super().__init__(device)
        self.ran = 0

    def unavailable(self):
        return None

    def cases(self, profile, plan=None):
        return CaseSpace(lambda swarm: st.integers(0, 200).map(_case), {})

    def run(self, case):
        self.ran += 1
        return Observation(self.name, self.device)

    def repro_spec(self, finding):
        return None


def test_a_stored_corpus_larger_than_max_examples_is_not_all_replayed(tmp_path):
    db = InMemoryExampleDatabase()
    first = Counting()
    Campaign(first, PROFILES["cpu"], HOST, executor=InProcessExecutor(first), max_examples=60, reruns=0, shrink=False,
             database=db).run()
    target = Counting()
    result = Campaign(target, PROFILES["cpu"], HOST, executor=InProcessExecutor(target), seed=1, max_examples=5, reruns=0,
                      shrink=False, database=db).run()
    assert result.examples == target.ran <= 5


def test_sigterm_stops_even_a_shrink():
    target = Counting()
    campaign = Campaign(target, PROFILES["cpu"], HOST, executor=InProcessExecutor(target), max_examples=10, reruns=0)
    campaign._batch_failed = True  # shrinking: cases past max_examples still run
    campaign.result.examples = 50
    campaign._test(_case(1))
    campaign._winding_down = True
    with pytest.raises(_Stop):
        campaign._test(_case(1))


def test_without_shrinking_a_failed_batch_stops_at_the_count_too():
    """--no-shrink: nothing is shrunk, so a batch that found a bug has no reason to run past the count (the
    replays of a shared database's corpus did, on the GPU host and in CI)."""
    target = Counting()
    campaign = Campaign(target, PROFILES["cpu"], HOST, executor=InProcessExecutor(target), max_examples=10, reruns=0,
                        shrink=False)
    campaign._batch_failed = True
    campaign.result.examples = 10
    with pytest.raises(_Stop):
        campaign._test(_case(1))


class TwoBugs(Counting):
    """Fails one way on contexts of 7k + 3, another on contexts of 7k + 5."""
    name = "test.two-bugs"
    oracle = staticmethod(lambda case, obs: {3: [Verdict("output", False, "a", where="a")],
                                             5: [Verdict("output", False, "b", where="b")]}.get(
                                                 case.requests[0].context_len % 7, [passed("output", "fine")]))


@pytest.mark.parametrize("max_findings", [None, 1])
def test_two_stored_failures_replayed_without_shrinking_are_both_recorded(max_findings):
    """--no-shrink (and --max-findings) with two distinct failures stored: Hypothesis replays each failure once more
    before it reports them, and past max_examples that replay raised the campaign's stop in both, which Hypothesis
    grouped into a BaseExceptionGroup that ended the campaign with neither finding saved. The replay runs no case."""
    db = InMemoryExampleDatabase()
    first = TwoBugs()
    found = Campaign(first, PROFILES["cpu"], HOST, executor=InProcessExecutor(first), max_examples=30, reruns=0,
                     shrink=False, database=db, search="plain").run()
    assert {f.signature for f in found.findings} == {"output:a", "output:b"}
    target = TwoBugs()
    result = Campaign(target, PROFILES["cpu"], HOST, executor=InProcessExecutor(target), max_examples=2, reruns=0,
                      shrink=False, database=db, search="plain", max_findings=max_findings).run()
    assert {f.signature for f in result.findings} == {"output:a", "output:b"}
    assert not any(f.shrunk for f in result.findings)
    assert target.ran == result.examples == 2  # the two stored failures; Hypothesis's last replay ran nothing
