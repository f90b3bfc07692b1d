"""Pending findings are taken back only by a campaign of their own kind: same target, same injected bug."""

from fuzzer.env import HostInfo
from fuzzer.observation import Observation
from fuzzer.records import Finding
from fuzzer.search.pending import Pending
from oracles.verdict import Verdict
from strategies.case import Case, Request, TopkSpec

CASE = Case(requests=(Request(1, 4),), num_decodes=1, block_size=16, block_table=((1,),), topk_width=128,
            topk=(TopkSpec(valid=4),))


def _finding(inject):
    host = HostInfo(device="cpu", device_name="x86_64", vllm="0.33.0", torch="2", triton="3", python="3.11",
                    interpreted=True)
    return Finding("vllm.flashmla_sparse", "output:output", CASE, [Verdict("output", False, "off", where="output")],
                   Observation("vllm.flashmla_sparse", "cpu"), host, inject, 1, 0.1)


def test_a_campaign_of_another_mutant_leaves_pending_findings_alone(tmp_path):
    Pending(tmp_path, "vllm.flashmla_sparse", "mutant-a").save(_finding("mutant-a"))
    Pending(tmp_path, "vllm.flashmla_sparse", None).save(_finding(None))  # same signature, no mutant
    assert [f.inject for f in Pending(tmp_path, "vllm.flashmla_sparse", "mutant-b").load()] == []
    assert [f.inject for f in Pending(tmp_path, "vllm.flashmla_sparse", "mutant-a").load()] == ["mutant-a"]
    assert [f.inject for f in Pending(tmp_path, "vllm.flashmla_sparse").load()] == [None]
    assert Pending(tmp_path, "vllm.index_remap", "mutant-a").load() == []
