#!/usr/bin/env bash
# Build a CPU-only virtualenv that can run vLLM's sparse-MLA Python and Triton code under Triton's interpreter.
#
#   scripts/setup-venv.sh [VENV=.venv] [VLLM_VERSION=0.33.0]
#
# attnfuzz itself (editable) with its `standalone` extra (pyproject.toml: torch 2.13.0 CPU build, triton, the packages
# vLLM's import chain needs, the tests' tools), then vLLM installed with --no-deps (its declared deps pull a CUDA
# torch). Beside a vLLM of the user's own, `pip install .` alone is enough: it changes no torch, triton or vllm.
# Idempotent: re-running it on a finished venv only checks it.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-$ROOT/.venv}
VLLM_VERSION=${2:-0.33.0}
PY=${PYTHON:-python3}
if [ -x "$VENV/bin/python" ] && [ -f "$VENV/.attnfuzz-ready-$VLLM_VERSION" ]; then
  echo "setup-venv: $VENV is ready (vllm $VLLM_VERSION)"; exit 0
fi
"$PY" -m venv "$VENV"
PIP=(pip_quiet "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-compile)
# pip warns once per package about this machine's local index folders when they are absent: drop that.
pip_quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
"${PIP[@]}" --upgrade pip
"${PIP[@]}" -e "$ROOT[standalone]"
"${PIP[@]}" --no-deps "vllm==$VLLM_VERSION"
# Import check: the interpreter-mode environment the fuzzer uses (see fuzzer/env.py).
CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 "$VENV/bin/python" -c "import vllm, torch, triton; print('setup-venv: vllm', vllm.__version__, 'torch', torch.__version__, 'triton', triton.__version__)"
touch "$VENV/.attnfuzz-ready-$VLLM_VERSION"
