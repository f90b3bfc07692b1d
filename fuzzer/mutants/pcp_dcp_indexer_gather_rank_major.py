"""PCP + DCP indexer prefill keys left rank-major (class O; its cause is a PCP + DCP gather, G, but what the judge sees is
a wrong selection): under PCP with DCP the indexer all-gathers every DCP
rank's shard of a prefill chunk's index keys (`dcp_gather_kv_rows`) and must put them back in token order through
the chunk plan's `pcp_deinterleave_idx` before the logits; this returns the gathered shards as they arrive, rank
after rank. The logits' causal bounds and the top-k's ids then name positions of the wrong tokens: a prefill row
whose window passes the top-k width keeps the wrong keys."""

from fuzzer.mutants._kernel_patch import patch_function

BUG_CLASS = "O"
TARGETS = ("vllm.dsv32.attention.pcp_dcp",)


def apply():
    patch_function("vllm.model_executor.layers.sparse_attn_indexer", "dcp_gather_kv_rows",
                   [("return torch.index_select(gathered, 0, deinterleave_idx, out=out_buf[:deinterleave_idx.shape[0]])",
                     "return gathered[:deinterleave_idx.shape[0]]")],
                   "pcp-dcp-indexer-gather-rank-major")
