"""The seed bug's launch on a GPU: vLLM's real index-remap kernel called as the pre-fix call site called it
(req_id_per_token of 12 rows, topk_indices of 2), with the converter's row check removed (the mutant)."""

import torch
import vllm  # noqa: F401

from fuzzer.mutants import inject

inject("remap-no-length-check")
from vllm.v1.attention.backends.mla.sparse_utils import triton_convert_req_index_to_global_index  # noqa: E402

req_id = torch.zeros(12, dtype=torch.int32, device="cuda")
block_table = torch.arange(1, 5, dtype=torch.int32, device="cuda").view(1, 4)
topk_indices = torch.randint(0, 200, (2, 128), dtype=torch.int32, device="cuda")
triton_convert_req_index_to_global_index(req_id, block_table, topk_indices, BLOCK_SIZE=64, NUM_TOPK_TOKENS=128)
torch.cuda.synchronize()
print("launched")
