#!/usr/bin/env bash
# GPU host, the last call of the session: what failed in gpu_issue4.sh, fixed. Results: $OUT/results.tgz.
set -uo pipefail
R=${OUT:-/tmp/out}/r; mkdir -p "$R"
trap 'tar czf "${OUT:-/tmp/out}/results.tgz" -C "$R" .' EXIT
G=scripts/gpu-host.sh
export PYTHONUNBUFFERED=1 ATTNFUZZ_STATE=/tmp/attnfuzz-state OMP_NUM_THREADS=2
$G -- true
run() { local name=$1 limit=$2; shift 2
  ( /usr/bin/time -f "%e s wall" timeout -s ABRT "$limit" env PYTHONFAULTHANDLER=1 $G "$@" --json "$R/$name.json" \
      --repros "$R/repros-$name" --quiet > "$R/$name.log" 2>&1; echo "exit=$?" >> "$R/$name.log" ); }
A="attnfuzz --device cuda run"
( ATTNFUZZ_TEST_DEVICE=cuda timeout 300 $G -- python3 -m pytest -q -rs -s -p no:cacheprovider tests/gpu > "$R/pytest-gpu.log" 2>&1; echo "exit=$?" >> "$R/pytest-gpu.log" ) &
ATTNFUZZ_STATE=/tmp/attnfuzz-fault ATTNFUZZ_FAULT=illegal-address:3 run fault-illegal-address 300 $A --target selftest.fault --max-examples 100 --reruns 1 &
ATTNFUZZ_STATE=/tmp/attnfuzz-A run m-layer-A-auto 320 $A --target vllm.flashmla_sparse.layer --inject remap-full-batch-req-id --sanitizer auto --no-shrink --time-budget 150s --reruns 1 &
run initcheck-flashmla 320 $A --target vllm.flashmla_sparse --sanitizer initcheck --seed 7 --max-examples 200 &
wait
cp -r /tmp/attnfuzz-A/workers "$R/workers-A" 2>/dev/null
