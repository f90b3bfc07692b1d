"""oracles/dcp.py's DCP geometry of the indexer's decode rows: each rank's share of a request's keys, and which rows
DeepGEMM's SM90 paged logits score right after an entry with no keys on some rank (the vLLM 0.33.0 bug in
docs/bug-reports/vllm-0.33.0-deepgemm-sm90-paged-logits-zero-length-request.md)."""

from oracles.dcp import after_zero_length_entry, local_length
from strategies.case import Case, Dcp, IndexerStep, Request


def decodes(lengths_and_queries, dcp, mtp=0):
    reqs = tuple(Request(q, n) for n, q in lengths_and_queries)
    return Case(requests=reqs, num_decodes=len(reqs), block_size=64, block_table=tuple((0,) for _ in reqs),
                topk_width=512, topk=(), heads=64, kv_cache_dtype="fp8_ds_mla", dcp=dcp,
                indexer=IndexerStep(num_speculative_tokens=mtp))


def test_each_rank_holds_its_interleaved_share():
    assert [local_length(5, Dcp(2), r) for r in (0, 1)] == [3, 2]
    assert [local_length(100, Dcp(2, 0, 64), r) for r in (0, 1)] == [64, 36]
    assert [local_length(36, Dcp(2, 0, 64), r) for r in (0, 1)] == [36, 0]


def test_the_row_after_a_request_without_keys_on_a_rank():
    case = decodes([(1500, 1), (0, 1), (1400, 1), (900, 1)], Dcp(2))  # request 1: one token, none on rank 1
    assert [after_zero_length_entry(case, r) for r in range(4)] == [False, False, True, False]
    assert not any(after_zero_length_entry(decodes([(1500, 1), (0, 1), (1400, 1)], Dcp()), r) for r in range(3))


def test_flattened_mtp_rows_are_entries_of_their_own():
    # MTP 2 (3 rows a request): SM90 flattens them. A fresh request's rows hold 1, 2, 3 keys: each is first to have
    # keys on a rank (1, then 2) the row before had none on, and the next request's first row follows one (rank 3)
    case = decodes([(800, 3), (0, 3), (700, 3)], Dcp(4), mtp=2)
    assert [r for r in range(9) if after_zero_length_entry(case, r)] == [4, 5, 6]
    # MTP 1 (2 rows): native rows per request, the request's length its last token's
    case = decodes([(800, 2), (0, 2), (700, 2)], Dcp(4), mtp=1)
    assert [r for r in range(6) if after_zero_length_entry(case, r)] == [4, 5]
