#!/usr/bin/env bash
# GPU-host session for vllm.flashmla_sparse: vLLM's real FlashMLA kernels, cache ops as stand-ins (the bundle
# has no _C_stable_libtorch). Results go to $OUT/results.tgz.
set -uo pipefail
R=${OUT:-/tmp/out}/r; mkdir -p "$R"
trap 'tar czf "${OUT:-/tmp/out}/results.tgz" -C "$R" .' EXIT
export PYTHONUNBUFFERED=1 ATTNFUZZ_STATE=/tmp/attnfuzz-state
( timeout 330 scripts/gpu-host.sh -- attnfuzz --device cuda run --target vllm.flashmla_sparse --seed 0 \
    --max-examples 300 --json "$R/clean-flashmla_sparse.json" --repros "$R/repros" --quiet > "$R/clean-flashmla_sparse.log" 2>&1
  echo "exit=$?" >> "$R/clean-flashmla_sparse.log" )
