#!/usr/bin/env bash
# Add an older vLLM release to the GPU bundle (after ../shared/gpu-host/build-bundle.sh .gpu-bundle):
#   .gpu-bundle/old/vllm-VER.tgz   its Python sources (the bundle's wheels serve every release)
#   .gpu-bundle/old/so-VER/        its own FlashMLA extensions (_flashmla_C, _flashmla_extension_C), ~2 MB
#   .gpu-bundle/old/deep_gemm-VER.tar.xz   its vendored DeepGEMM (vllm/third_party/deep_gemm: the host's CPython
#                                  extension and the headers its JIT compiles), ~5 MB; with --deep-gemm only
# scripts/gpu-host.sh --vllm VER unpacks both on the host. 0.23-0.26 wheels are built for torch 2.11.
#
#   scripts/bundle-old-release.sh 0.26.0 [--deep-gemm]
set -euo pipefail
VER=${1:?vLLM version}
HOST_PY=cpython-312  # the GPU host's Python
DEST=$(cd "$(dirname "$0")/.." && pwd)/.gpu-bundle/old
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$DEST/so-$VER"
python3 -m pip download -q --no-deps "vllm==$VER" -d "$TMP/w"
WHL=$(ls "$TMP"/w/vllm-*.whl)
unzip -q "$WHL" -d "$TMP/x" -x 'vllm/vllm_flash_attn/*' 'vllm/vllm-rs' 'vllm/kernels/helion/configs/*' '*.so' '*.hpp' '*.h' '*.cuh' '*.cu' '*.cpp' '*.js' '*.css'
(cd "$TMP/x" && tar czf - vllm vllm-*.dist-info) > "$DEST/vllm-$VER.tgz"  # its metadata too: vLLM detects its platform by it
unzip -q -o -j "$WHL" 'vllm/_flashmla_C.abi3.so' 'vllm/_flashmla_extension_C.abi3.so' -d "$DEST/so-$VER"
if [ "${2:-}" = --deep-gemm ]; then
  # Releases before 0.33 ship one extension per CPython (_C.cpython-3XX); the host needs its own only.
  unzip -q "$WHL" 'vllm/third_party/deep_gemm/*' -x "vllm/third_party/deep_gemm/_C.cpython-3*" -d "$TMP/dg"
  unzip -q "$WHL" "vllm/third_party/deep_gemm/_C.$HOST_PY-*" "vllm/third_party/deep_gemm/*.abi3.so" -d "$TMP/dg" || true
  tar cJf "$DEST/deep_gemm-$VER.tar.xz" -C "$TMP/dg/vllm/third_party" deep_gemm
  du -sh "$DEST/deep_gemm-$VER.tar.xz"
fi
du -sh "$DEST/vllm-$VER.tgz" "$DEST/so-$VER"
