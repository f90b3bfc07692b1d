"""vLLM's Step5 sparse decode kernel (`sparse_decode_attention`, STEP5_DSA's decode route) called directly on one
GPU, across batch sizes that pick one split (the fused store) or several (the combine), with bf16 and fp8 caches,
with and without the head gate: how many output values are non-finite, and the largest difference from an fp32
reference over the same selected regions. No attnfuzz in the loop: it tells a kernel's NaN from a harness's.

    scripts/gpu-host.sh python3 bench/step5_decode_check.py            (on the GPU host, the bundle unpacked)
"""

from __future__ import annotations

import itertools

import torch


def reference(query, cache, regions, table, positions, active, scale, k_scale, v_scale, groups, query_len, gate):
    rows, heads, _ = query.shape
    block = cache.shape[2]
    out = torch.zeros(rows, heads, 192, dtype=torch.float32, device=query.device)
    kv = cache.float() if cache.dtype != torch.float8_e4m3fn else cache.float()
    for r in range(rows):
        if not bool(active[r]):
            continue
        g, req, pos = r % groups, r // (groups * query_len), int(positions[r])
        toks = [int(x) * 8 + i for x in regions[r].tolist() if x >= 0 for i in range(8) if int(x) * 8 + i <= pos]
        if not toks:
            continue
        t = torch.tensor(toks, device=query.device)
        pages = table[req, t // block].long()
        rows_kv = kv[pages, g, t % block]
        k, v = rows_kv[:, :192] * k_scale, rows_kv[:, 192:] * v_scale
        p = torch.softmax(query[r].float() @ k.T * scale, dim=-1)
        out[r] = p @ v
    if gate is not None:
        token = torch.arange(rows, device=query.device) // groups
        head = (torch.arange(rows, device=query.device) % groups)[:, None] * heads + torch.arange(heads, device=query.device)
        out = out * torch.sigmoid(gate[token[:, None], head].float())[..., None]
    return out


TOKENS = (8, 64, 66, 100)


def main() -> None:
    from fuzzer.env import prepare_process
    from fuzzer.support.step5_runtime import import_package

    prepare_process("cuda" if torch.cuda.is_available() else "cpu")  # on a CPU: the interpreter's corrections

    import_package()  # vllm.models.step5's __init__ imports the VL model (torchvision): import the ops alone
    from vllm.models.step5.nvidia.ops.sparse_decode_attention import sparse_decode_attention, sparse_decode_splits

    torch.manual_seed(0)
    dev = "cuda"
    groups, heads, block, region_count = 2, 8, 32, 16
    print(f"{torch.cuda.get_device_name()}: rows = tokens x {groups} groups, {heads} heads, block {block}")
    print("tokens rows splits cache gated | non-finite out | max |diff| vs fp32 reference")
    for tokens, dtype, gated in itertools.product(TOKENS, ("bf16", "fp8"), (False, True)):
        rows = tokens * groups
        ctx = 200
        pages_per_req = (ctx + block) // block
        table = torch.arange(tokens * pages_per_req, device=dev, dtype=torch.int32).view(tokens, pages_per_req)
        vals = torch.randn(tokens * pages_per_req, groups, block, 384, device=dev)
        if dtype == "fp8":
            cache = (vals * 8).to(torch.float8_e4m3fn)
            k_scale = torch.tensor([0.37], device=dev)
            v_scale = torch.tensor([0.21], device=dev)
        else:
            cache = vals.to(torch.bfloat16)
            k_scale = v_scale = None
        positions = torch.full((rows,), ctx - 1, device=dev, dtype=torch.int64)
        active = torch.ones(rows, device=dev, dtype=torch.bool)
        regions = torch.full((rows, region_count), -1, device=dev, dtype=torch.int32)
        live = torch.randperm(ctx // 8, device=dev)[:region_count - 4].to(torch.int32)
        regions[:, 4:] = live
        query = torch.randn(rows, heads, 192, device=dev, dtype=torch.bfloat16)
        out = torch.full((rows, heads, 192), float("nan"), device=dev, dtype=torch.bfloat16)
        gate = torch.randn(tokens, groups * heads, device=dev, dtype=torch.bfloat16) if gated else None
        splits = sparse_decode_splits(rows)
        scale = 192 ** -0.5
        sparse_decode_attention(query, cache, regions, table, positions, active, out, scale=scale, splits=splits,
                                k_scale=k_scale, v_scale=v_scale, gate=gate)
        torch.cuda.synchronize()
        ref = reference(query, cache, regions, table, positions, active, scale,
                        float(k_scale) if k_scale is not None else 1.0, float(v_scale) if v_scale is not None else 1.0,
                        groups, 1, gate)
        bad = int((~torch.isfinite(out)).sum())
        diff = (out.float() - ref).abs().nan_to_num(float("inf")).max().item()
        print(f"{tokens:6d} {rows:4d} {splits:6d} {dtype:5s} {str(gated):5s} | {bad:14d} | {diff:.4g}")


if __name__ == "__main__":
    main()
