"""Step5's decode summary update handed each token's sequence length for its position (class D): the impl passes
`seq_lens - 1` (the token's position) to `Step5SparseSummaryCache.update_decode`; here it passes `seq_lens`, one past.
The Triton update then stores every open-region row one ring row late and summarizes a region when its seventh
token arrives (position % 8 == 6 read as 7), from a ring row nobody wrote and without the region's last row: the
summary cache and the tail ring drift from the tokens, and with them the regions the indexer scores."""

from fuzzer.mutants._kernel_patch import patch_method

BUG_CLASS = "D"
TARGETS = ("vllm.step5_dsa",)


def apply():
    patch_method("vllm.models.step5.nvidia.sparse_attention", "Step5DSAAttentionImpl", "_forward_decode",
                 [("self.summary_cache.update_decode(proxy_key, proxy_z, slots, seq_lens - 1, self.csa_ring)",
                   "self.summary_cache.update_decode(proxy_key, proxy_z, slots, seq_lens, self.csa_ring)")],
                 "step5-summary-position-off-by-one")
