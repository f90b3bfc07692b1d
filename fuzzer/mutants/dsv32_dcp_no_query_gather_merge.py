"""DeepSeek-V3.2's attention module under pure DCP without the query gather and the LSE merge (class G): the
attention half of vLLM PR 50005 (issue 50095) reverted. `DeepseekV32Attention._sparse_indexer_and_attn` gathers the
query heads over the DCP group and merges the ranks' partial outputs by LSE only under PCP + DCP, as before that
fix: under DCP alone each rank sends its own heads into `forward_mqa` over the KV shard it owns and keeps that
partial result (softmax over its share only; zero where it holds none of a row's selected tokens) as the layer's
output. Dense-MHA tokens are unaffected (MLAAttention.forward_impl gathers and merges for them)."""

from fuzzer.mutants._kernel_patch import patch_method

BUG_CLASS = "G"
TARGETS = ("vllm.dsv32.attention.dcp",)


def apply():
    patch_method("vllm.models.deepseek_v32.attention", "DeepseekV32Attention", "_sparse_indexer_and_attn",
                 [("elif not self.use_pcp and self.impl.dcp_world_size > 1:", "elif False:"),
                  ("if self.impl.dcp_world_size > 1:", "if self.use_pcp and self.impl.dcp_world_size > 1:")],
                 "dsv32-dcp-no-query-gather-merge")
