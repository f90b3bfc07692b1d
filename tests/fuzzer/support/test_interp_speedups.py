"""The interpreter speed-ups (fuzzer/support/interp/sanitizer.py, `speed_up_interpreter`) change how much Python
Triton runs per operation, never a result: the same kernels, run in a process with them and in one without
(ATTNFUZZ_INTERP_FAST=0), give byte-identical outputs and the same bounds-checker reports."""

import json
import os

import pytest

from tests.conftest import python

# Kernels of our own that reach what the speed-ups touch: integer arithmetic past int32 (the overflow checks),
# broadcasts of equal and unequal shapes, block types of ints, floats and pointers, reductions and a scan (their
# combine functions are @triton.jit calls from the kernel), a helper function, bf16 casts, atomics, and loads and
# stores out of bounds (the checker's fast path and its full one).
KERNELS = r'''
import hashlib, json, os, sys
import torch, triton, triton.language as tl
from fuzzer.support.interp.sanitizer import SANITIZER, speed_up_interpreter

@triton.jit
def _helper(x, y):
    return x * 3 + y

@triton.jit
def _mix(a_ptr, b_ptr, out_ptr, red_ptr, scan_ptr, cnt_ptr, n, M: tl.constexpr, N: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, M)[:, None]
    cols = tl.arange(0, N)[None, :]
    a = tl.load(a_ptr + rows * N + cols, mask=(rows * N + cols) < n, other=-7)
    b = tl.load(b_ptr + cols)                       # [1, N] against [M, N]: a broadcast
    big = a * 1000003 + pid * 2147483                # wraps int32, as the compiled kernel does
    v = _helper(big, b) // 7 % 1000 - (a & 5) ^ (b | 3)
    f = v.to(tl.float32) * 0.37
    h = f.to(tl.bfloat16)
    w = tl.where(v > 0, h.to(tl.float32), -f)
    tl.store(out_ptr + pid * M * N + rows * N + cols, w)
    tl.store(red_ptr + pid * 2 * M + tl.arange(0, M), tl.sum(v, axis=1))
    tl.store(red_ptr + pid * 2 * M + M + tl.arange(0, M), tl.max(w, axis=1))
    flat = tl.arange(0, N)
    tl.store(scan_ptr + pid * N + flat, tl.cumsum(tl.load(b_ptr + flat), axis=0))
    tl.atomic_add(cnt_ptr + (flat % 3), 1)

@triton.jit
def _out_of_bounds(src, dst, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(dst + i, tl.load(src + i, mask=i < n, other=0) + 1)   # the store is unmasked: writes BLOCK

def digest(t):
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]

results = {"speed_ups": list(speed_up_interpreter())}
g = torch.Generator().manual_seed(0)
M, N, P = 4, 16, 3
a = torch.randint(-2**31, 2**31 - 1, (M * N,), dtype=torch.int32, generator=g)
b = torch.randint(-1000, 1000, (N,), dtype=torch.int32, generator=g)
out = torch.zeros(P * M * N, dtype=torch.float32)
red = torch.zeros(P * 2 * M, dtype=torch.float32)
scan = torch.zeros(P * N, dtype=torch.int32)
cnt = torch.zeros(3, dtype=torch.int32)
with SANITIZER.install().collect() as found:
    _mix[(P,)](a, b, out, red, scan, cnt, M * N - 5, M=M, N=N)
results["mix"] = [digest(t) for t in (out, red, scan, cnt)] + [v.describe() for v in found]
src, dst = torch.arange(16, dtype=torch.int32), torch.zeros(12, dtype=torch.int32)
with SANITIZER.collect() as found:
    _out_of_bounds[(1,)](src, dst[:8], 10, BLOCK=16)
results["oob"] = [digest(dst)] + [v.describe() for v in found]

if os.environ.get("WITH_VLLM") == "1":  # vLLM's index remap, on the paths the campaign draws
    from vllm.v1.attention.backends.mla import sparse_utils as su
    for width, tokens, counts in ((256, 3, False), (2048, 2, True), (4224, 1, True), (4224, 1, False)):
        reqs, block = 3, 64
        bt = torch.randint(0, 1000, (reqs, width // block), dtype=torch.int32, generator=g)
        req = torch.randint(0, reqs, (tokens,), dtype=torch.int32, generator=g)
        ti = torch.randint(-1, width + 200, (tokens, width), dtype=torch.int32, generator=g)  # some past the table
        kw = dict(BLOCK_SIZE=block, NUM_TOPK_TOKENS=width)
        if counts:
            kw["return_valid_counts"] = True
        with SANITIZER.collect() as found:
            res = su.triton_convert_req_index_to_global_index(req, bt, ti, **kw)
        res = res if isinstance(res, tuple) else (res,)
        results[f"remap-{width}-{tokens}-{counts}"] = [digest(t) for t in res if t is not None] + [
            v.describe() for v in found]
print("RESULTS " + json.dumps(results))
'''


def _run(fast: bool, with_vllm: bool) -> dict:
    env = dict(os.environ, ATTNFUZZ_INTERP_FAST="1" if fast else "0", WITH_VLLM="1" if with_vllm else "0")
    r = python("-c", KERNELS, env=env, fresh=True, timeout=600)  # a new interpreter: the speed-ups are per process
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULTS "))[8:])


def _compare(with_vllm: bool) -> None:
    slow, fast = _run(False, with_vllm), _run(True, with_vllm)
    assert slow.pop("speed_ups") == [] and len(fast.pop("speed_ups")) == 6  # every speed-up applies to this Triton
    assert fast == slow
    assert any("out-of-bounds store" in line for line in fast["oob"])  # the checker still reports


def test_kernels_of_our_own_give_the_same_bytes_and_reports_with_and_without_the_speed_ups():
    _compare(with_vllm=False)


@pytest.mark.vllm
@pytest.mark.nightly  # 52 s on the CI host; the kernels of our own above reach the same speed-ups in CI
def test_vllm_index_remap_gives_the_same_bytes_and_reports_with_and_without_the_speed_ups():
    _compare(with_vllm=True)
