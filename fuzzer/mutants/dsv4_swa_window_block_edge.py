"""SWA window off by one at a block boundary (class N): DeepSeek-V4's SWA indices kernel starts a query's window one
token late when the window's first position falls exactly on an SWA block boundary, so the token `window_size`
positions back is dropped there (its index and its length both one short), as a block-aligned start computed from
the previous block's end would. Found by the exact check of decode/prefill SWA indices and lengths; shows for a
token at position m * block_size + window_size - 1 (m >= 1)."""

from fuzzer.mutants._kernel_patch import patch_kernel_class

BUG_CLASS = "N"
TARGETS = ("vllm.dsv4.flashmla",)


def apply():
    patch_kernel_class("vllm.v1.attention.backends.mla.sparse_swa", "ComputeSWAIndicesAndLensKernel", [(
        "    end_pos = pos + right + 1",
        "    start_pos = start_pos + ((start_pos % block_size == 0) & (start_pos > 0)).to(tl.int32)\n"
        "    end_pos = pos + right + 1")], "dsv4-swa-window-block-edge")
