#!/usr/bin/env bash
# GPU host, issue 4: the sanitizer's allocator test, a fault on the 3rd of 100 cases, the seed-bug mutant on
# the FlashMLA layer under `--sanitizer auto`, clean memcheck and initcheck campaigns against the same cases
# native (and native without guard regions), then the throughput benchmark. Results: $OUT/results.tgz.
set -uo pipefail
R=${OUT:-/tmp/out}/r; mkdir -p "$R"
trap 'tar czf "${OUT:-/tmp/out}/results.tgz" -C "$R" .' EXIT
G=scripts/gpu-host.sh
export PYTHONUNBUFFERED=1 ATTNFUZZ_STATE=/tmp/attnfuzz-state OMP_NUM_THREADS=2
$G -- true  # unpack the bundle once, before anything runs in parallel
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/gpu.txt" 2>&1
$G -- compute-sanitizer --version >> "$R/gpu.txt" 2>&1
run() { local name=$1 limit=$2; shift 2
  ( /usr/bin/time -f "%e s wall" timeout -s ABRT "$limit" env PYTHONFAULTHANDLER=1 $G "$@" --json "$R/$name.json" \
      --repros "$R/repros-$name" --quiet > "$R/$name.log" 2>&1; echo "exit=$?" >> "$R/$name.log" ); }
A="attnfuzz --device cuda run"
( ATTNFUZZ_TEST_DEVICE=cuda timeout 300 $G -- python3 -m pytest -q -rs -p no:cacheprovider tests/gpu > "$R/pytest-gpu.log" 2>&1; echo "exit=$?" >> "$R/pytest-gpu.log" ) &
ATTNFUZZ_STATE=/tmp/attnfuzz-fault ATTNFUZZ_FAULT=illegal-address:3 run fault-illegal-address 300 $A --target selftest.fault --max-examples 100 --reruns 1 &
ATTNFUZZ_STATE=/tmp/attnfuzz-A run m-layer-A-auto 330 $A --target vllm.flashmla_sparse.layer --inject remap-full-batch-req-id --sanitizer auto --no-shrink --time-budget 200s --reruns 1 &
run memcheck-flashmla 330 $A --target vllm.flashmla_sparse --sanitizer memcheck --seed 7 --max-examples 200 &
run initcheck-flashmla 330 $A --target vllm.flashmla_sparse --sanitizer initcheck --seed 7 --max-examples 200 &
run native-flashmla 330 $A --target vllm.flashmla_sparse --seed 7 --max-examples 200 &
ATTNFUZZ_GUARDS=0 run native-noguard-flashmla 330 $A --target vllm.flashmla_sparse --seed 7 --max-examples 200 &
wait
# Alone on the machine: the throughput benchmark (kernel cache warm).
run bench-flashmla 80 $A --target vllm.flashmla_sparse --profile gpu-bench --seed 3 --max-examples 150 --case-timeout 40s
run bench-layer 80 $A --target vllm.flashmla_sparse.layer --profile gpu-bench --seed 3 --max-examples 150 --case-timeout 40s
cp -r /tmp/attnfuzz-state/workers "$R/workers-state" 2>/dev/null
cp -r /tmp/attnfuzz-A/workers "$R/workers-A" 2>/dev/null
