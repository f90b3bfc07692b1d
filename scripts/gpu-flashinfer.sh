#!/usr/bin/env bash
# Real FlashInfer (flashinfer-python 0.7.2.post1, what vLLM 0.33.0's FLASHINFER_MLA_SPARSE_SM90 imports:
# flashinfer.mla.BatchMLAPagedAttentionWrapper, backend fa3) on the GPU test host. The wheel is 62 MB (420 MB
# unpacked); `build` packs what `import flashinfer.mla` and the SM90 MLA module's JIT build read (every Python file
# of the package, its dist-info, and of flashinfer/data/ the batch_mla sources and the include trees its nvcc command
# names: 6,000 files, 136 MB, 10.9 MB as tar.xz) and cuts it in two parts, p1 (5 MiB) and p2 (the rest, with the
# checksum and a ninja wheel in case the host's ninja is not on PATH). Each part rides in a call that has room for it:
#
#   here, once:  scripts/gpu-flashinfer.sh build        (PYTHON=a python with torch; FI_WHEEL=a local copy of the wheel)
#
#   with vLLM's cache ops (scripts/gpu-ops.sh):
#     call 1:  carry [".gpu-ops/a", ".gpu-flashinfer/p1"]                 (58 MiB)
#              bash scripts/gpu-ops.sh stash && bash scripts/gpu-flashinfer.sh stash
#     call 2:  carry [".gpu-ops/b", ".gpu-bundle", ".gpu-flashinfer/p2"]  (56 MiB)
#              bash scripts/gpu-ops.sh unpack && bash scripts/gpu-flashinfer.sh install && bash scripts/gpu-flashinfer.sh check && ...
#   without them, one call:
#     call 1:  carry [".gpu-bundle", ".gpu-flashinfer/p1", ".gpu-flashinfer/p2"]   (48 MiB)
#              bash scripts/gpu-flashinfer.sh install && bash scripts/gpu-flashinfer.sh check && ...
#   later calls while the machine is warm: carry [".gpu-bundle"], nothing to install again.
#
# `install` joins the parts (stashed in /tmp/gpu-flashinfer/parts by an earlier call, or carried in this one),
# checks the checksum, unpacks into /tmp/gpu-flashinfer/site and writes /tmp/gpu-flashinfer/env.sh (PYTHONPATH, the
# JIT cache under /tmp/gpu-flashinfer/ws so compiled modules last while the machine stays warm, ninja and nvcc on
# PATH). scripts/gpu-host.sh sources env.sh only for runs that ask, with ATTNFUZZ_FLASHINFER=real: an importable
# FlashInfer changes what vLLM does elsewhere (has_flashinfer() gates other backends, the indexer's top-k, ...).
# `check` (through gpu-host.sh, so with the bundle's vLLM and tvm_ffi 0.1.11): import, vLLM's gate
# has_flashinfer_sm90_nope_mla(), then the JIT build and a plan+run per KV dtype (bf16, fp8 with ckv_scale, fp8
# with ckv_scale_arr) and head count (16, 64, 128) as vLLM calls it, against a float32 reference; exits 1 when any
# of it fails, 2 when FlashInfer is not installed (the machine went back: start again at call 1).
#
# Tried off the host (GPU_FLASHINFER_HOST=another folder): the parts stash, join and unpack; the packed files import
# (`flashinfer.mla` with a CPU torch and tvm_ffi 0.1.11, vLLM's gate true with nvcc and ninja on PATH); nvcc 13.0 builds
# both MLA modules (bf16, e4m3 KV) from them alone, every header it read packed (122 s for one on 2 busy cores);
# check's cases run clean on the CPU against attnfuzz's stand-in. Only the host runs FlashInfer's kernels.
#
#   scripts/gpu-flashinfer.sh build [VERSION] | split | sizes | stash | install | check | env
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
FI=$ROOT/.gpu-flashinfer
HOST=${GPU_FLASHINFER_HOST:-/tmp/gpu-flashinfer}  # (another place only to try it out off the host)
TAR=flashinfer-mla.tar.xz
PART1=$((5 << 20))
HELPER=$ROOT/scripts/gpu_flashinfer.py
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 --platform any)
pick_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; elif [ -x "$ROOT/.venv/bin/python" ]; then echo "$ROOT/.venv/bin/python"
  else echo python3; fi
}
case ${1:-} in
  build)
    VER=${2:-0.7.2.post1}
    PY=$(pick_python)
    mkdir -p "$FI/dl"
    WHEEL=${FI_WHEEL:-$FI/dl/flashinfer_python-$VER-py3-none-any.whl}
    [ -f "$WHEEL" ] || "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${PLAT[@]}" -d "$FI/dl" "flashinfer-python==$VER"
    # ninja: the host's image has the ninja package, carried in case its binary is not on PATH there. nvidia-ml-py
    # (pynvml, which `import flashinfer` needs; the host has it) only for the import here.
    ls "$FI"/dl/ninja-*.whl >/dev/null 2>&1 || "$PY" -m pip download -q --no-deps --only-binary=:all: \
      --python-version 3.12 --implementation cp "${PLAT[@]}" -d "$FI/dl" ninja
    ls "$FI"/dl/nvidia_ml_py-*.whl >/dev/null 2>&1 || "$PY" -m pip download -q --no-deps --only-binary=:all: \
      --python-version 3.12 --implementation cp "${PLAT[@]}" -d "$FI/dl" nvidia-ml-py
    TMP=$(mktemp -d)
    trap 'rm -rf "$TMP"' EXIT
    "$PY" -m pip install -q --no-deps --no-compile --no-index --target "$TMP/site" "$WHEEL"
    "$PY" -m pip install -q --no-deps --no-compile --no-index --target "$TMP/deps" "$FI"/dl/nvidia_ml_py-*.whl
    # The fa3 MLA module's JIT spec as the host makes it (sm_90a), written without CUDA: its generated sources.
    FLASHINFER_CUDA_ARCH_LIST=9.0a CUDA_HOME=/usr/local/cuda FLASHINFER_WORKSPACE_BASE="$TMP/ws" \
      PYTHONPATH="$TMP/site:$TMP/deps" "$PY" -c "
import sys, torch
from flashinfer.jit import gen_batch_mla_module
for kv in (torch.bfloat16, torch.float8_e4m3fn):
    spec = gen_batch_mla_module('fa3', torch.bfloat16, kv, torch.bfloat16, torch.int32, 512, 64, False)
    spec.write_ninja()
    print(spec.name)" > "$TMP/specs"
    GEN=$(ls -d "$TMP"/ws/.cache/flashinfer/*/90a/generated/*_kv_e4m3_*sm90)
    "$PY" "$HELPER" manifest "$TMP/site" "$GEN" "$TMP/files"
    # Every file the ninja files name under the unpacked wheel must be packed too.
    grep -oh "$TMP/site/[^ $]*" "$TMP"/ws/.cache/flashinfer/*/90a/cached_ops/*/build.ninja | sort -u \
      | sed "s|^$TMP/site/||" > "$TMP/named"
    while read -r d; do
      grep -q "^$d/" "$TMP/files" || { echo "gpu-flashinfer: $d (named by the ninja file) is not packed" >&2; exit 1; }
    done < "$TMP/named"
    echo "$VER" > "$TMP/VERSION"
    (cd "$TMP/site" && tar cf - --owner=0 --group=0 --sort=name -T "$TMP/files") | xz -9 -T1 > "$FI/$TAR"
    cp "$TMP/files" "$FI/MANIFEST"; cp "$TMP/named" "$FI/INCLUDE_DIRS"; cp "$TMP/VERSION" "$FI/VERSION"
    "$0" split;;
  split)  # p1: the first 5 MiB; p2: the rest, the checksum of the whole, the version and ninja's wheel
    rm -rf "$FI/p1" "$FI/p2"
    "$(pick_python)" "$HELPER" split "$FI/$TAR" "$FI" "$PART1" 0
    cp "$FI/VERSION" "$FI/p2/" && cp "$FI"/dl/ninja-*.whl "$FI/p2/"
    du -b "$FI/$TAR" "$FI"/p1/* "$FI"/p2/*;;
  sizes)  # what each call of the sequence above carries, against the 64 MiB limit
    tree=$(cd "$ROOT" && git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
    size() { local t=$tree d; for d in "$@"; do [ -e "$ROOT/$d" ] || { echo "missing $d"; return; }
             t=$((t + $(du -sbL "$ROOT/$d" | cut -f1))); done; echo "$t bytes ($((t * 100 / (64 << 20)))% of 64 MiB)"; }
    echo "working tree: $tree bytes"
    echo "ops call 1 [.gpu-ops/a .gpu-flashinfer/p1]:             $(size .gpu-ops/a .gpu-flashinfer/p1)"
    echo "ops call 2 [.gpu-ops/b .gpu-bundle .gpu-flashinfer/p2]: $(size .gpu-ops/b .gpu-bundle .gpu-flashinfer/p2)"
    echo "one call [.gpu-bundle .gpu-flashinfer/p1 .gpu-flashinfer/p2]: $(size .gpu-bundle .gpu-flashinfer/p1 .gpu-flashinfer/p2)";;
  stash)  # on the GPU host: keep the carried parts for a later call
    mkdir -p "$HOST/parts"
    n=0; for d in "$FI"/p*/; do [ -d "$d" ] && cp "$d"* "$HOST/parts/" && n=$((n + 1)); done
    [ "$n" -gt 0 ] || { echo "gpu-flashinfer: no part carried (.gpu-flashinfer/p1 or p2)" >&2; exit 1; }
    echo "gpu-flashinfer: stashed in $HOST/parts: $(cd "$HOST/parts" && ls | tr '\n' ' ')";;
  install)  # on the GPU host: parts from the stash and from this call, joined, checked, unpacked
    mkdir -p "$HOST/parts"
    for d in "$FI"/p*/; do [ -d "$d" ] && cp "$d"* "$HOST/parts/"; done
    if [ ! -f "$HOST/parts/SHA256SUMS" ] || [ ! -f "$HOST/parts/$TAR.part-1" ] || [ ! -f "$HOST/parts/$TAR.part-2" ]; then
      if [ -f "$HOST/.ready" ]; then echo "gpu-flashinfer: already installed ($(cat "$HOST/.ready"))"; exit 0; fi
      echo "gpu-flashinfer: parts missing in $HOST/parts ($(ls "$HOST/parts" | tr '\n' ' ')): carry p1 and p2, or stash p1 in" \
           "an earlier call of a machine that is still warm (it went back: start again at call 1)" >&2; exit 1
    fi
    sum=$(cut -d' ' -f1 "$HOST/parts/SHA256SUMS")
    if [ -f "$HOST/.ready" ] && [ "$(cat "$HOST/.ready")" = "$(cat "$HOST/parts/VERSION") $sum" ]; then
      echo "gpu-flashinfer: already installed ($(cat "$HOST/.ready"))"; exit 0
    fi
    python3 "$HELPER" join "$HOST/$TAR" "$HOST/parts/$TAR.part-1" "$HOST/parts/$TAR.part-2"
    rm -rf "$HOST/site" "$HOST/.ready" && mkdir -p "$HOST/site" "$HOST/ws"
    tar xJf "$HOST/$TAR" -C "$HOST/site" && rm -f "$HOST/$TAR"
    NINJA_DIR=""
    if ! command -v ninja >/dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target "$HOST/ninja" "$HOST"/parts/ninja-*.whl
      NINJA_DIR=$HOST/ninja/bin
    fi
    # FlashInfer takes CUDA_HOME, else `which nvcc`/../..: a wrapper script on PATH (/usr/local/bin/nvcc) would give
    # /usr/local, without include/ and lib64/libcudart.so. The toolkit is the first that has bin/nvcc and libcudart.
    CUDA=""
    for c in "${CUDA_HOME:-}" /usr/local/cuda "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /nonexistent)")")")"; do
      if [ -n "$c" ] && [ -x "$c/bin/nvcc" ] && ls "$c"/lib64/libcudart.so* >/dev/null 2>&1; then CUDA=$c; break; fi
    done
    [ -n "$CUDA" ] || echo "gpu-flashinfer: no CUDA toolkit with bin/nvcc and lib64/libcudart.so found: the JIT build will fail" >&2
    # The module links with -lcuda (from $CUDA/lib64/stubs or the linker's paths): where neither has libcuda.so, a
    # link to the driver's libcuda.so.1 in a folder of its own, passed through FLASHINFER_EXTRA_LDFLAGS.
    LIBCUDA_DIR=""
    if [ ! -e "$CUDA/lib64/stubs/libcuda.so" ] && ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so '; then
      drv=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
      for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/lib64; do
        [ -n "$drv" ] && break; [ -e "$d/libcuda.so.1" ] && drv=$d/libcuda.so.1
      done
      if [ -n "$drv" ]; then mkdir -p "$HOST/lib" && ln -sfn "$drv" "$HOST/lib/libcuda.so" && LIBCUDA_DIR=$HOST/lib
      else echo "gpu-flashinfer: no libcuda.so.1 found: the JIT module's link (-lcuda) will fail" >&2; fi
    fi
    cat > "$HOST/env.sh" <<EOF
# Written by scripts/gpu-flashinfer.sh install; sourced by scripts/gpu-host.sh when ATTNFUZZ_FLASHINFER=real.
export PYTHONPATH="\${PYTHONPATH:+\$PYTHONPATH:}$HOST/site"
export FLASHINFER_WORKSPACE_BASE=$HOST/ws
export FLASHINFER_CUDA_ARCH_LIST=9.0a
export FLASHINFER_NVCC_THREADS=\${FLASHINFER_NVCC_THREADS:-4}
${NINJA_DIR:+export PATH="$NINJA_DIR:\$PATH"}
${CUDA:+export CUDA_HOME=$CUDA PATH="$CUDA/bin:\$PATH"}
${LIBCUDA_DIR:+export FLASHINFER_EXTRA_LDFLAGS="-L$LIBCUDA_DIR"}
EOF
    echo "$(cat "$HOST/parts/VERSION") $sum" > "$HOST/.ready"
    echo "gpu-flashinfer: flashinfer $(cat "$HOST/parts/VERSION") installed in $HOST/site ($(du -sm "$HOST/site" | cut -f1) MB)," \
         "ninja $(command -v ninja || echo "$NINJA_DIR/ninja"), CUDA_HOME ${CUDA:-none}${LIBCUDA_DIR:+, libcuda $drv}";;
  check)  # on the GPU host, after install
    [ -f "$HOST/.ready" ] || { echo "gpu-flashinfer: not installed (the machine went back: start again at call 1)" >&2; exit 2; }
    ATTNFUZZ_FLASHINFER=real PYTHONUNBUFFERED=1 "$ROOT/scripts/gpu-host.sh" python3 "$HELPER" check;;
  env) echo "$HOST/env.sh";;
  *) echo "usage: scripts/gpu-flashinfer.sh build [VERSION] | split | sizes | stash | install | check | env" >&2; exit 2;;
esac
