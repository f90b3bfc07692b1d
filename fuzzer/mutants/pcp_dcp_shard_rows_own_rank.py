"""PCP + DCP prefill workspace sized by the rank's own shard (class G): FlashMLA's builder takes each prefill
request's shard rows from the rank's own DCP share of the row's extent (what a DCP-only runner passes as
dcp_local_seq_lens) instead of `dcp_local_seq_lens_cpu_upper_bound`, the largest shard of the whole request,
alike on every rank. The ranks then upconvert shards of different sizes into the all-gather of
`_gather_prefill_chunk` (over NCCL a hang or rows of the wrong ranks), and a rank's workspace can end before
the positions its rows select."""

from fuzzer.mutants._kernel_patch import patch_method

BUG_CLASS = "G"
TARGETS = ("vllm.flashmla_sparse.layer.pcp_dcp",)


def apply():
    patch_method("vllm.v1.attention.backends.mla.flashmla_sparse", "FlashMLASparseMetadataBuilder",
                 "_build_fp8_separate_prefill_decode",
                 [("shard_rows_cpu = common_attn_metadata.dcp_local_seq_lens_cpu_upper_bound",
                   "shard_rows_cpu = get_dcp_local_seq_lens(seq_lens_cpu, self.dcp_world_size, "
                   "get_dcp_group().rank_in_group, self.cp_kv_cache_interleave_size)")],
                 "pcp-dcp-shard-rows-own-rank")
