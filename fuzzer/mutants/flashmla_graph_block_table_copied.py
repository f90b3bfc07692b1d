"""Metadata rebuilt out of place (class M: a graph replay reading stale metadata): the sparse-MLA metadata
builder hands the kernels a fresh copy of the block table each step (as a builder that reshapes or remaps the
runner's table into a new tensor would) instead of a view of the runner's persistent one. Eager steps are
right: the copy holds the step's table. A full CUDA graph captured the copy made for its dummy capture batch
(null-block rows), so every replayed decode step reads that one: its selected tokens resolve to block 0."""

BUG_CLASS = "M"
TARGETS = ("vllm.flashmla_sparse",)


def apply():
    from vllm.model_executor.layers.attention import sparse_mla_attention

    builder = sparse_mla_attention.SparseMLACommonMetadataBuilder
    build = builder.build

    def build_out_of_place(self, common_prefix_len, common_attn_metadata, fast_build=False):
        metadata = build(self, common_prefix_len, common_attn_metadata, fast_build)
        metadata.block_table = metadata.block_table.clone()
        return metadata

    builder.build = build_out_of_place
