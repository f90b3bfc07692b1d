#!/usr/bin/env bash
# What an older release needs on the GPU host beyond the bundle and fits only in a call of its own (64 MiB per
# upload): its vllm._C and the pure-Python packages it imports that the bundle lacks. Fills .gpu-extra/:
#   .gpu-extra/so-VER/_C.abi3.so   (0.23.0: 43 MB; its FlashMLA module imports vllm._C)
#   .gpu-extra/whl/*.whl           (0.23.0: gguf)
# Send it with `carry: [".gpu-extra"]` on a machine that a call with `.gpu-bundle` left warm;
# scripts/gpu-host.sh --vllm VER copies both in (bench/scenarios/gpu-old-releases runs 0.23.0 so).
#
#   scripts/gpu-extra.sh 0.23.0
set -euo pipefail
VER=${1:?vLLM version}
DEST=$(cd "$(dirname "$0")/.." && pwd)/.gpu-extra
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$DEST/so-$VER" "$DEST/whl"
python3 -m pip download -q --no-deps "vllm==$VER" -d "$TMP"
unzip -q -o -j "$TMP"/vllm-*.whl 'vllm/_C.abi3.so' -d "$DEST/so-$VER"
GGUF=$(unzip -p "$TMP"/vllm-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: gguf\([^;]*\).*/gguf\1/p' | tr -d ' ')
[ -z "$GGUF" ] || python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$DEST/whl" "$GGUF"
du -sh "$DEST/so-$VER" "$DEST/whl"
