"""vLLM 0.33.0's vendored DeepGEMM (vllm/third_party/deep_gemm, 2.8.1), SM90 `fp8_fp4_paged_mqa_logits`: a request
with context length 0 between two others makes the kernel score the request after it with the zero-length
request's query and weights, wherever one SM's share of the work crosses it. vLLM's indexer hands the kernel such
batches under decode context parallelism: its DCP-local `seq_lens` are 0 on every rank that holds none of a short
request's tokens. See vllm-0.33.0-deepgemm-sm90-paged-logits-zero-length-request.md.

Needs an H100 or H200 (SM90) and vLLM 0.30.0 or later (run on 0.33.0 and 0.34.0); nothing else. Exit 1 when rows are wrong, 0 when every row is right.
    python vllm-0.33.0-deepgemm-sm90-paged-logits-zero-length-request.py
"""

import sys

import torch

import vllm
from vllm.utils.deep_gemm import fp8_fp4_paged_mqa_logits, get_num_sms, get_paged_mqa_logits_metadata

HEAD_DIM, HEADS, BLOCK = 128, 64, 64


def reference(q, weights, values, scales, table, q_row, kv_row, length):
    """fp32 logits of q_row's query and weights over kv_row's first `length` keys:
    sum_h w_h * relu(q_h . k_j) * scale_j."""
    pages = table[kv_row, : -(-length // BLOCK)].long()
    k = values[pages].reshape(-1, HEAD_DIM)[:length].float()
    s = scales[pages].reshape(-1)[:length]
    return ((q[q_row, 0].float() @ k.T).clamp(min=0) * weights[q_row][:, None]).sum(0) * s


def run(lens, seed=0, clamp=False):
    torch.manual_seed(seed)
    dev = "cuda"
    b = len(lens)
    width = max(-(-n // BLOCK) for n in lens)
    num_blocks = b * width + 1
    values = torch.randn(num_blocks, BLOCK, HEAD_DIM, device=dev).to(torch.float8_e4m3fn)
    scales = torch.rand(num_blocks, BLOCK, device=dev) + 0.5
    # The indexer's K cache: per block, BLOCK x 128 fp8 values, then BLOCK fp32 scales.
    kv_cache = torch.cat([values.view(torch.uint8).reshape(num_blocks, -1),
                          scales.view(torch.uint8).reshape(num_blocks, -1)], 1).view(num_blocks, BLOCK, 1, HEAD_DIM + 4)
    table = (torch.randperm(num_blocks - 1, device=dev)[: b * width] + 1).view(b, width).int()
    q = torch.randn(b, 1, HEADS, HEAD_DIM, device=dev).to(torch.float8_e4m3fn)
    weights = torch.randn(b, HEADS, device=dev)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=dev)[:, None]  # [B, next_n]: next_n 1
    if clamp:  # the workaround: no request without keys for the kernel (its rows' extra task is ignored below)
        context_lens = context_lens.clamp(min=1)
    schedule = get_paged_mqa_logits_metadata(context_lens, BLOCK, get_num_sms())
    logits = fp8_fp4_paged_mqa_logits((q, None), kv_cache, weights, context_lens, table, schedule,
                                      max(lens))
    wrong = []
    for row, n in enumerate(lens):
        if n == 0:
            continue
        want = reference(q, weights, values, scales, table, row, row, n)
        got = logits[row, :n]
        bad = (got - want).abs() > 1e-2 * want.abs().max()
        if bad.any():
            # The skipped request's query and weights (loaded ahead for it) on this row's keys?
            skipped = reference(q, weights, values, scales, table, row - 1, row, n)
            with_skipped = bool(((got - skipped).abs()[bad] <= 1e-2 * skipped.abs().max()).all())
            wrong.append((row, int(bad.sum()), n, lens[row - 1], with_skipped))
    return wrong


def main():
    print(f"vLLM {vllm.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}, {get_num_sms()} SMs")
    found = 0
    # A request of length 0 among requests of 1,000 keys (4 of the kernel's 256-key segments each): more segments
    # than SMs, so some SM's share runs from the request before it to the request after it.
    for where in range(30, 46):
        lens = [1000] * where + [0] + [1000] * 40
        for row, count, n, before, with_skipped in run(lens):
            found += 1
            print(f"zero-length request at {where}: row {row} ({n} keys): {count} of its logits wrong"
                  + (f"; they are row {row - 1}'s query (length {before}) scored on row {row}'s keys"
                     if with_skipped else ""))
    if found:
        fixed = sum(len(run([1000] * w + [0] + [1000] * 40, clamp=True)) for w in range(30, 46))
        print(f"with the lengths clamped to >= 1 for the schedule and the kernel: {fixed} rows wrong")
        print(f"BUG: {found} rows scored with another request's query")
        return 1
    print("every row matches the reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
