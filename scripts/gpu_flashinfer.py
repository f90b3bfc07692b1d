"""FlashInfer's MLA path for the GPU test host: what to pack, how it travels in parts, and the check there.

Driven by scripts/gpu-flashinfer.sh (its header has the call sequence). Subcommands:

  manifest SITE GEN_DIR OUT   the files of SITE (flashinfer installed there with --no-deps) the host needs:
                              every Python file of the package (`import flashinfer` imports most of them), its
                              dist-info, and of flashinfer/data/ only what the SM90 MLA module's JIT build reads
                              (its sources, its jinja template and the whole include trees its nvcc command
                              names); GEN_DIR holds the generated sources of one fa3 MLA spec (their includes
                              are resolved to check that every header reached is packed)
  split FILE DEST_DIR SIZE... FILE cut into parts DEST_DIR/p<i>/<name>.part-<i> of the sizes given (the last one
                              takes the rest), the SHA256SUMS of the whole beside the last part (it travels with it)
  join OUT PART...            the parts in order into OUT, checked against the SHA256SUMS beside the last part
  check                       on the GPU host: import, vLLM's gate, a JIT build and a plan+run per case
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

# The include directories of FlashInfer's nvcc command (flashinfer/jit/cpp_ext.py: build_common_cflags,
# get_system_includes; flashinfer/jit/env.py: CCCL_INCLUDE_DIRS, CUTLASS_INCLUDE_DIRS, SPDLOG_INCLUDE_DIR), in its
# order, relative to flashinfer/data. Packed whole (headers reached under #if branches the scan cannot decide are
# in them too), except csrc/, 258 MB of every module's sources: from it only what the MLA module reads.
INCLUDE_TREES = (
    "cccl/cub", "cccl/libcudacxx/include", "cccl/thrust",
    "include",
    "cutlass/include", "cutlass/tools/util/include",
    "spdlog/include",
)
CSRC_INCLUDE_DIR = "csrc"
# gen_batch_mla_module (flashinfer/jit/attention/modules.py) copies these from csrc/ for backend fa3 (and fa2).
MLA_SOURCES = (
    "csrc/batch_mla_config.jinja",
    "csrc/batch_mla_sm90_plan.cu", "csrc/batch_mla_sm90_run.cu", "csrc/batch_mla_sm90_binding.cu",
    "csrc/batch_mla_plan.cu", "csrc/batch_mla_run.cu", "csrc/batch_mla_binding.cu",
)
# vLLM's MLA prefill concatenates k_nope and k_pe through FlashInfer wherever it imports
# (`torch.ops.vllm.flashinfer_concat_mla_k`: gen_concat_mla_module, flashinfer/jit/dsv3_optimizations.py, JIT-built
# from csrc/ with csrc/ and include/ on the include path); without it every layer target fails at its first prefill.
CONCAT_MLA_SOURCES = ("csrc/concat_mla.cu",)
# Outside data/: the package's kernel sources for other modules (experimental/*/csrc, moe_ep/kernel_src, ...) are
# left out; everything else (Python, json tables read at import or plan time) goes.
DROP_OUTSIDE_DATA = (".cu", ".cuh", ".c", ".h", ".cpp", ".cc", ".hpp", ".md")
INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"]+)[>"]', re.M)


def include_closure(sources: list[Path], include_dirs: list[Path]) -> tuple[set[Path], set[str]]:
    """Every file the sources reach through #include, whatever the #if around it (so a superset of what nvcc
    reads from these directories), and the names found in none of them (CUDA's, the C++ library's, tvm_ffi's)."""
    seen: set[Path] = set()
    unresolved: set[str] = set()
    todo = [p.resolve() for p in sources]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for quote, name in INCLUDE_RE.findall(f.read_text(errors="replace")):
            for d in ([f.parent] if quote == '"' else []) + include_dirs:
                if (d / name).is_file():
                    todo.append((d / name).resolve())
                    break
            else:
                unresolved.add(name)
    return seen, unresolved


def manifest(site: Path, gen_dir: Path) -> tuple[list[str], dict]:
    pkg = site / "flashinfer"
    data = pkg / "data"
    files: set[str] = set()
    for p in pkg.rglob("*"):
        if not p.is_file() or "__pycache__" in p.parts:
            continue
        rel = p.relative_to(site).as_posix()
        if rel.startswith("flashinfer/data/"):
            continue
        if p.suffix not in DROP_OUTSIDE_DATA:
            files.add(rel)
    for d in site.glob("flashinfer_python-*.dist-info"):
        files.update(p.relative_to(site).as_posix() for p in d.rglob("*") if p.is_file())
    files.update(p.relative_to(site).as_posix() for p in data.glob("*.py"))
    for tree in INCLUDE_TREES:
        files.update(p.relative_to(site).as_posix() for p in (data / tree).rglob("*") if p.is_file())
    for src in MLA_SOURCES + CONCAT_MLA_SOURCES:
        if not (data / src).is_file():
            raise SystemExit(f"gpu_flashinfer: {src} is not in the wheel")
        files.add(f"flashinfer/data/{src}")
    # nvcc's search order: -I cccl, then -isystem (python, cuda, tvm_ffi), include, csrc, cutlass, spdlog.
    dirs = [data / t for t in INCLUDE_TREES[:3]] + [data / "include", data / CSRC_INCLUDE_DIR] + \
        [data / t for t in INCLUDE_TREES[4:]]
    sources = sorted(gen_dir.glob("*.cu")) + sorted(gen_dir.glob("*.inc"))
    if len(sources) < 4:
        raise SystemExit(f"gpu_flashinfer: no generated sources in {gen_dir}")
    sources += [data / src for src in CONCAT_MLA_SOURCES]
    reached, unresolved = include_closure(sources, dirs)
    csrc_reached = []
    for p in reached:
        try:
            rel = p.relative_to(site.resolve()).as_posix()
        except ValueError:
            continue  # the generated sources themselves
        if rel.startswith("flashinfer/data/csrc/"):
            csrc_reached.append(rel)
            files.add(rel)
    missing = [p for p in reached if p.is_relative_to(site.resolve())
               and p.relative_to(site.resolve()).as_posix() not in files]
    info = {"reached": len(reached), "csrc_reached": sorted(csrc_reached), "unresolved": sorted(unresolved),
            "missing": sorted(str(p) for p in missing)}
    return sorted(files), info


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split(path: Path, dest: Path, sizes: list[int]) -> list[Path]:
    """Cut path into len(sizes) parts, dest/p<i>/<name>.part-<i>, the i-th of sizes[i] bytes (the last takes
    the rest, never empty); SHA256SUMS beside the last part names the whole file's checksum."""
    total = path.stat().st_size
    if sum(sizes[:-1]) >= total:
        raise ValueError(f"{path.name}: {total} bytes do not fill the first {len(sizes) - 1} parts")
    parts = []
    with open(path, "rb") as f:
        for i, size in enumerate(sizes, 1):
            part = dest / f"p{i}" / f"{path.name}.part-{i}"
            part.parent.mkdir(parents=True, exist_ok=True)
            chunk = f.read() if i == len(sizes) else f.read(size)
            part.write_bytes(chunk)
            parts.append(part)
    (parts[-1].parent / "SHA256SUMS").write_text(f"{sha256(path)}  {path.name}\n")
    return parts


def join(parts: list[Path], out: Path, sums: Path) -> None:
    """Concatenate parts into out and check it against sums (raises ValueError on a mismatch, out removed)."""
    want = {line.split(None, 1)[1].strip(): line.split(None, 1)[0]
            for line in sums.read_text().splitlines() if line.strip()}
    name = out.name
    if name not in want:
        raise ValueError(f"{sums} names no {name}")
    with open(out, "wb") as o:
        for p in parts:
            with open(p, "rb") as f:
                while block := f.read(1 << 20):
                    o.write(block)
    if sha256(out) != want[name]:
        out.unlink()
        raise ValueError(f"{name}: checksum mismatch (parts out of order, or from two builds)")


def check() -> int:
    """On the GPU host (through scripts/gpu-host.sh with ATTNFUZZ_FLASHINFER=real): import, vLLM's gate, then per
    KV dtype, ckv scaling and head count a plan (the first one per KV dtype includes nvcc's JIT build, timed) and a
    run as vLLM's FLASHINFER_MLA_SPARSE_SM90 calls them, against a float32 reference."""
    import importlib.metadata
    import inspect
    import os
    import time
    import warnings

    warnings.simplefilter("ignore", DeprecationWarning)
    import torch

    t = time.time()
    import flashinfer
    import flashinfer.mla
    from flashinfer.mla import BatchMLAPagedAttentionWrapper
    print(f"gpu-flashinfer: flashinfer {flashinfer.__version__} from {Path(flashinfer.__file__).parent} "
          f"(import {time.time() - t:.1f}s), tvm_ffi {importlib.metadata.version('apache-tvm-ffi')}, "
          f"torch {torch.__version__}, workspace {os.environ.get('FLASHINFER_WORKSPACE_BASE')}")
    params = inspect.signature(BatchMLAPagedAttentionWrapper.run).parameters
    print("gpu-flashinfer: run() takes ckv_scale_arr keyword-only:",
          params.get("ckv_scale_arr") is not None
          and params["ckv_scale_arr"].kind is inspect.Parameter.KEYWORD_ONLY)
    failed = 0
    try:
        from vllm.utils.flashinfer import has_flashinfer, has_flashinfer_sm90_nope_mla
        gate = has_flashinfer_sm90_nope_mla()
        print(f"gpu-flashinfer: vllm has_flashinfer()={has_flashinfer()} has_flashinfer_sm90_nope_mla()={gate}")
        failed += not gate
    except ImportError as e:  # vLLM not on the path (no .gpu-bundle): the gate is not checked
        print(f"gpu-flashinfer: vLLM not importable ({e}); gate not checked")
        failed += 1

    failed += run_cases(BatchMLAPagedAttentionWrapper, torch.device("cuda"))
    failed += concat_mla_case(torch.device("cuda"))
    print("gpu-flashinfer:", "check passed" if not failed else f"{failed} check(s) failed")
    return 1 if failed else 0


def concat_mla_case(dev) -> int:
    """FlashInfer's concat_mla_k as vLLM's MLA prefill calls it (k [T, H, 192] from k_nope [T, H, 128] and k_pe
    [T, 1, 64] broadcast over the heads; its JIT build timed) against torch.cat; 1 if it differs."""
    import time

    import torch
    from flashinfer.concat_ops import concat_mla_k

    t_, h = 37, 16
    g = torch.Generator(device=dev).manual_seed(1)
    k_nope = torch.randn(t_, h, 128, device=dev, generator=g).to(torch.bfloat16)
    k_pe = torch.randn(t_, 1, 64, device=dev, generator=g).to(torch.bfloat16)
    k = torch.full((t_, h, 192), float("nan"), dtype=torch.bfloat16, device=dev)
    t = time.time()
    concat_mla_k(k, k_nope, k_pe)
    torch.cuda.synchronize()
    same = torch.equal(k, torch.cat([k_nope, k_pe.expand(t_, h, 64)], dim=-1))
    print(f"gpu-flashinfer: concat_mla_k {t_} tokens x {h} heads: {time.time() - t:.1f}s (nvcc's JIT build, unless "
          f"cached) {'equal to torch.cat' if same else 'DIFFERS from torch.cat'}")
    return 0 if same else 1


def run_cases(wrapper_cls, dev) -> int:
    """The plan+run cases of `check` with wrapper_cls on dev (here: attnfuzz's stand-in on the CPU, a dry run of
    this code); the number that failed."""
    import math
    import time

    import torch

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    failed = 0
    ckv_dim, kpe_dim = 512, 64
    sm_scale = 1.0 / math.sqrt(192)
    g = torch.Generator(device=dev).manual_seed(0)
    # (KV dtype, how ckv is scaled): vLLM passes ckv_scale (its per-tensor k_scale); ckv_scale_arr (per token and
    # 128-channel group) is what its gate looks for, not wired in vLLM yet.
    for kv_dtype, scaling in ((torch.bfloat16, None), (torch.float8_e4m3fn, "ckv_scale"),
                              (torch.float8_e4m3fn, "ckv_scale_arr")):
        for heads in (16, 64, 128):
            tokens, topk, pool = 5, 64, 400
            lens = torch.tensor([topk, 1, 17, 0, topk - 1], dtype=torch.int32)  # vLLM's valid-count boundaries
            max_tokens = 8
            ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
            kv_indices = torch.zeros(max_tokens * topk, dtype=torch.int32, device=dev)
            kv_len_arr = torch.full((max_tokens,), topk, dtype=torch.int32, device=dev)
            kv_indptr = torch.zeros(max_tokens + 1, dtype=torch.int32, device=dev)
            w = wrapper_cls(
                ws, qo_indptr=torch.zeros(max_tokens + 1, dtype=torch.int32, device=dev), kv_indptr=kv_indptr,
                kv_indices=kv_indices, kv_len_arr=kv_len_arr, use_cuda_graph=True, backend="fa3")
            qo = torch.clamp(torch.arange(max_tokens + 1, dtype=torch.int32), max=tokens)
            lens_all = torch.zeros(max_tokens, dtype=torch.int32)
            lens_all[:tokens] = lens
            kvp = torch.zeros(max_tokens + 1, dtype=torch.int32)
            kvp[1:] = torch.cumsum(lens_all, 0)
            n_idx = max(int(kvp[-1]), 1)
            rows = [torch.randperm(pool, generator=g, device=dev)[: int(n)].to(torch.int32) for n in lens]
            kv_indices[:int(kvp[-1])] = torch.cat(rows)
            t = time.time()
            w.plan(qo, kvp, kv_indices[:n_idx], lens_all, heads, ckv_dim, kpe_dim, 1, False, sm_scale,
                   q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
            sync()
            plan_s = time.time() - t
            q_nope = torch.randn(tokens, heads, ckv_dim, device=dev, generator=g).to(torch.bfloat16)
            q_pe = torch.randn(tokens, heads, kpe_dim, device=dev, generator=g).to(torch.bfloat16)
            cache = torch.randn(pool, 1, ckv_dim + kpe_dim, device=dev, generator=g).to(torch.bfloat16)
            # Dequantization scale of each ckv channel of each row (kpe's is 1.0).
            scale = torch.ones(pool, 1, ckv_dim, device=dev)
            kw = {}
            if scaling == "ckv_scale":
                scale *= 0.5
                kw = {"ckv_scale": 0.5, "kpe_scale": 1.0}
            elif scaling == "ckv_scale_arr":
                groups = torch.rand(pool, 1, ckv_dim // 128, device=dev, generator=g) + 0.25
                scale = groups.repeat_interleave(128, dim=-1)
                kw = {"ckv_scale_arr": groups.contiguous(), "kpe_scale": 1.0}
            if kv_dtype == torch.float8_e4m3fn:
                cache = torch.cat([cache[..., :ckv_dim].float() / scale, cache[..., ckv_dim:].float()], -1) \
                    .to(torch.float8_e4m3fn)
            ckv, kpe = cache[..., :ckv_dim], cache[..., ckv_dim:]
            t = time.time()
            out = w.run(q_nope, q_pe, ckv, kpe, **kw)
            sync()
            run_s = time.time() - t
            # Reference: each token attends to its own selected rows; ckv is both K (with kpe) and V.
            c = torch.cat([cache[..., :ckv_dim].float() * scale, cache[..., ckv_dim:].float()], -1).squeeze(1)
            err = 0.0
            for i, r in enumerate(rows):
                if r.numel() == 0:
                    continue
                kv = c[r.long()]
                s = (q_nope[i].float() @ kv[:, :ckv_dim].T + q_pe[i].float() @ kv[:, ckv_dim:].T) * sm_scale
                ref = torch.softmax(s, -1) @ kv[:, :ckv_dim]
                err = max(err, (out[i].float() - ref).abs().max().item())
            tol = 0.05 if kv_dtype == torch.bfloat16 else 0.1
            ok = err < tol and bool(torch.isfinite(out[(lens > 0).to(dev)]).all())
            failed += not ok
            print(f"gpu-flashinfer: kv {str(kv_dtype).split('.')[-1]:13s} {scaling or '':13s} heads {heads:3d}: "
                  f"plan {plan_s:6.1f}s (the first per KV dtype: nvcc's JIT build, unless cached) run {run_s:6.2f}s "
                  f"max|out-ref| {err:.4f} (< {tol}) {'ok' if ok else 'FAILED'}")
    return failed


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else ""
    if cmd == "manifest":
        site, gen_dir, out = Path(argv[1]), Path(argv[2]), Path(argv[3])
        files, info = manifest(site, gen_dir)
        out.write_text("".join(f + "\n" for f in files))
        print(f"gpu_flashinfer: {len(files)} files; the fa3 MLA sources reach {info['reached']} files through "
              f"#include, from csrc/ {info['csrc_reached']}; outside the wheel: {len(info['unresolved'])} names "
              f"(CUDA, C++, tvm_ffi)")
        if info["missing"]:
            print("gpu_flashinfer: reached but not packed:", *info["missing"], sep="\n  ")
            return 1
        return 0
    if cmd == "split":
        for p in split(Path(argv[1]), Path(argv[2]), [int(s) for s in argv[3:]]):
            print(p.stat().st_size, p)
        return 0
    if cmd == "join":
        parts = [Path(p) for p in argv[2:]]
        try:
            join(parts, Path(argv[1]), parts[-1].parent / "SHA256SUMS")
        except ValueError as e:
            print(f"gpu-flashinfer: {e}", file=sys.stderr)
            return 1
        return 0
    if cmd == "check":
        return check()
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
