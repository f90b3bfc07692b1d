"""PCP + DCP prefill rows grouped in fixed pairs (class G): FlashMLA's builder groups a PCP rank's prefill rows
into workspace entries two by two, as if every prefill came as a head and a tail chunk row. A prefill too short
to split runs whole on every rank as one row, so from there on each entry pairs rows of two requests: the
second request's tokens attend over the first one's gathered context (its block table and shard rows)."""

import importlib

import numpy as np

BUG_CLASS = "G"
TARGETS = ("vllm.flashmla_sparse.layer.pcp_dcp",)


def apply():
    module = importlib.import_module("vllm.v1.attention.backends.mla.flashmla_sparse")

    def gathered_prefill_shards(row_req_idx, row_shard_rows):
        n = len(row_req_idx)
        row_bounds = np.unique(np.r_[np.arange(0, n, 2), n])  # rows 0-1, 2-3, ...: "two chunk rows a request"
        return row_bounds, row_shard_rows[row_bounds[:-1]].astype(np.int64)

    module.gathered_prefill_shards = gathered_prefill_shards
