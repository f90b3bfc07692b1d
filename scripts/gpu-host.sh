#!/usr/bin/env bash
# On the GPU test host (torch + triton + hypothesis, no vLLM, no registry): make vLLM importable from the
# bundle that ../shared/gpu-host/build-bundle.sh builds into .gpu-bundle, then run the command given.
#
#   scripts/gpu-host.sh [--vllm 0.26.0] -- attnfuzz run --target vllm.index_remap ...
#
# Older releases (for nightly runs against them) come from .gpu-bundle/old/vllm-<version>.tgz: their
# Python sources only, which is all the index targets need; they share the bundle's wheels.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VER=""
if [ "${1:-}" = "--vllm" ]; then VER=$2; shift 2; fi
[ "${1:-}" = "--" ] && shift
# The bundle travels in one call of a machine; activate.sh installs it in /tmp/gpu-bundle and a copy of it stays
# there, so later calls of the same machine need not carry .gpu-bundle again (room for other packs).
if [ -f "$ROOT/.gpu-bundle/activate.sh" ]; then
  source "$ROOT/.gpu-bundle/activate.sh" >/dev/null
  [ -f /tmp/gpu-bundle/activate.sh ] || cp "$ROOT/.gpu-bundle/activate.sh" /tmp/gpu-bundle/activate.sh
elif [ -f /tmp/gpu-bundle/.ready ] && [ -f /tmp/gpu-bundle/activate.sh ]; then
  source /tmp/gpu-bundle/activate.sh >/dev/null
else
  echo "gpu-host.sh: no .gpu-bundle carried and none installed on this machine (carry .gpu-bundle)" >&2; exit 2
fi
if [ -n "$VER" ]; then
  SRC=/tmp/vllm-$VER/src
  if [ ! -d "$SRC/vllm" ]; then
    mkdir -p "$SRC" && tar xzf "$ROOT/.gpu-bundle/old/vllm-$VER.tgz" -C "$SRC"
    : > "$SRC/vllm/_C_stable_libtorch.py"
    mkdir -p "$SRC/vllm/vllm_flash_attn" && cp "$ROOT/.gpu-bundle/fa_standin.py" "$SRC/vllm/vllm_flash_attn/__init__.py"
    # That release's own FlashMLA extensions, where the bundle carries them (old/so-VER, from its wheel).
    if [ -d "$ROOT/.gpu-bundle/old/so-$VER" ]; then cp "$ROOT/.gpu-bundle/old/so-$VER"/*.so "$SRC/vllm/"; fi
  fi
  # That release's vendored DeepGEMM (scripts/bundle-old-release.sh VER --deep-gemm), in place of its Python-only copy.
  if [ -f "$ROOT/.gpu-bundle/old/deep_gemm-$VER.tar.xz" ] && ! ls "$SRC/vllm/third_party/deep_gemm/"_C*.so >/dev/null 2>&1; then
    rm -rf "$SRC/vllm/third_party/deep_gemm" && tar xJf "$ROOT/.gpu-bundle/old/deep_gemm-$VER.tar.xz" -C "$SRC/vllm/third_party"
  fi
  # Compiled extensions too large to travel with the bundle (0.23.0's vllm._C, 43 MB) come in a call of their
  # own, in .gpu-extra/so-VER/, while the machine still holds the bundle from the call before.
  if [ -d "$ROOT/.gpu-extra/so-$VER" ]; then cp -u "$ROOT/.gpu-extra/so-$VER"/*.so "$SRC/vllm/"; fi
  export PYTHONPATH="$SRC:/tmp/gpu-bundle/site"
fi
# vLLM's vendored DeepGEMM (its extension and JIT headers), when `scripts/gpu-ops.sh unpack` stashed it: in place of
# the bundle's Python-only copy, for the indexer's CUDA route. Its JIT needs a CUDA toolkit (CUDA_HOME).
DG=/tmp/gpu-bundle/src/vllm/third_party/deep_gemm
if [ -z "$VER" ] && [ -f /tmp/gpu-bundle-ops/deep_gemm.tar.xz ] && [ ! -f "$DG/_C_extension.abi3.so" ]; then
  tar xJf /tmp/gpu-bundle-ops/deep_gemm.tar.xz -C "$(dirname "$DG")"
fi
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
# vLLM's flash_attn_interface.py (part b of the ops): FA4's target calls vLLM's own flash_attn_varlen_func from it
if [ -z "$VER" ] && [ -f /tmp/gpu-bundle-ops/flash_attn_interface.py ]; then
  export ATTNFUZZ_VLLM_FLASH_ATTN_INTERFACE=/tmp/gpu-bundle-ops/flash_attn_interface.py
fi
# vLLM 0.33.0's own vllm_flash_attn with its FA3 extension (scripts/gpu-kernels.sh install fa3), for the runs that ask
# with ATTNFUZZ_FA3=real: a tree of links to the bundle's vllm/ with that package in place of the bundle's import
# stand-in, so that other runs on the machine keep theirs.
FA3_TAG=""
if [ "${ATTNFUZZ_FA3:-}" = real ]; then
  KH=${GPU_KERNELS_HOST:-/tmp/gpu-kernels}
  [ -f "$KH/fa3/.ready" ] || { echo "gpu-host.sh: ATTNFUZZ_FA3=real, but FA3 is not installed (scripts/gpu-kernels.sh install fa3)" >&2; exit 2; }
  [ -z "$VER" ] || { echo "gpu-host.sh: ATTNFUZZ_FA3=real is vLLM 0.33.0's FA3, not $VER's" >&2; exit 2; }
  BUNDLE_VLLM=/tmp/gpu-bundle/src/vllm OVER=$KH/fa3/src/vllm
  mkdir -p "$OVER"
  # vllm's siblings too: its dist-info (without it vLLM's version is unknown, and vLLM then takes the host for a
  # CPU build and turns Triton off)
  for e in /tmp/gpu-bundle/src/*; do
    n=$(basename "$e"); [ "$n" = vllm ] || [ -L "$KH/fa3/src/$n" ] || ln -s "$e" "$KH/fa3/src/$n" 2>/dev/null || [ -L "$KH/fa3/src/$n" ]
  done
  for e in "$BUNDLE_VLLM"/* "$BUNDLE_VLLM"/.[!.]*; do
    [ -e "$e" ] || continue
    # runs start at once: a link another run made between the test and ln is as good as this one's
    n=$(basename "$e"); [ "$n" = vllm_flash_attn ] || [ -L "$OVER/$n" ] || ln -s "$e" "$OVER/$n" 2>/dev/null || [ -L "$OVER/$n" ]
  done
  [ -L "$OVER/vllm_flash_attn" ] || ln -s "$KH/fa3/site/vllm_flash_attn" "$OVER/vllm_flash_attn" 2>/dev/null || [ -L "$OVER/vllm_flash_attn" ]
  export PYTHONPATH="$KH/fa3/src${PYTHONPATH#/tmp/gpu-bundle/src}"
  FA3_TAG=-fa3
fi
# vLLM's sources seen through a path with /site-packages/ in it: Hypothesis then treats vLLM as third-party
# and does not parse all of its modules for constants at the first draw (10 s per process on the host).
SRC_DIR=${PYTHONPATH%%:*}
LINK=/tmp/attnfuzz-vllm/${VER:-bundle}$FA3_TAG/site-packages
mkdir -p "$(dirname "$LINK")"
[ "$(readlink "$LINK" 2>/dev/null)" = "$SRC_DIR" ] || ln -sfn "$SRC_DIR" "$LINK"  # jobs start at once
export PYTHONPATH="$LINK${PYTHONPATH#"$SRC_DIR"}"
export PYTHONPATH="$ROOT:$PYTHONPATH"
# Pure-Python packages an older release needs and the bundle lacks (0.23.0: gguf), carried in .gpu-extra/whl.
if [ -d "$ROOT/.gpu-extra/whl" ]; then
  [ -d /tmp/gpu-extra/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu-extra/site "$ROOT"/.gpu-extra/whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/gpu-extra/site"
fi
# Real FlashInfer (scripts/gpu-flashinfer.sh install put it in /tmp/gpu-flashinfer), for the runs that ask for it
# with ATTNFUZZ_FLASHINFER=real only: an importable FlashInfer changes what vLLM picks elsewhere (has_flashinfer()).
if [ "${ATTNFUZZ_FLASHINFER:-}" = real ]; then
  if [ ! -f "${GPU_FLASHINFER_HOST:-/tmp/gpu-flashinfer}/env.sh" ]; then
    echo "gpu-host.sh: ATTNFUZZ_FLASHINFER=real, but FlashInfer is not installed (scripts/gpu-flashinfer.sh install)" >&2
    exit 2
  fi
  source "${GPU_FLASHINFER_HOST:-/tmp/gpu-flashinfer}/env.sh"
fi
# The CuTe-DSL stack (scripts/gpu-kernels.sh install cutedsl), for the runs that ask with ATTNFUZZ_CUTEDSL=real:
# vLLM's has_cutedsl() (is `cutlass` importable) then routes DeepSeek-V4's dequant-gather to its CuTe-DSL kernel.
if [ "${ATTNFUZZ_CUTEDSL:-}" = real ]; then
  KH=${GPU_KERNELS_HOST:-/tmp/gpu-kernels}
  [ -f "$KH/cutedsl/.ready" ] || { echo "gpu-host.sh: ATTNFUZZ_CUTEDSL=real, but CuTe-DSL is not installed (scripts/gpu-kernels.sh install cutedsl)" >&2; exit 2; }
  export PYTHONPATH="$PYTHONPATH:$KH/cutedsl/site:$KH/cutedsl/site/nvidia_cutlass_dsl/dsl_packages"
fi
if [ "${1:-}" = "attnfuzz" ]; then shift; exec python3 -m fuzzer.cli "$@"; fi
exec "$@"
