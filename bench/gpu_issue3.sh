#!/usr/bin/env bash
# GPU host, issue 3: clean campaigns per backend target and kv_cache_dtype, the seed-bug mutants on the layer
# target (and their reproducers), the Triton backend against older releases, then the throughput benchmark
# alone on the machine. Results go to $OUT/results.tgz.
set -uo pipefail
R=${OUT:-/tmp/out}/r; mkdir -p "$R"
trap 'tar czf "${OUT:-/tmp/out}/results.tgz" -C "$R" .' EXIT
G=scripts/gpu-host.sh
export PYTHONUNBUFFERED=1 ATTNFUZZ_STATE=/tmp/attnfuzz-state OMP_NUM_THREADS=2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/gpu.txt" 2>&1
run() { local name=$1 limit=$2; shift 2
  ( cd "$PWD"; /usr/bin/time -f "%e s wall" timeout "$limit" $G "$@" --json "$R/$name.json" --repros "$R/repros-$name" --quiet \
      > "$R/$name.log" 2>&1; echo "exit=$?" >> "$R/$name.log" ); }
A="attnfuzz --device cuda run"
if [ "${PHASE1:-1}" = 1 ]; then
  run clean-flashmla-bf16 320 $A --target vllm.flashmla_sparse --kv-cache-dtype bfloat16 --max-examples 300 &
  run clean-flashmla-fp8 320 $A --target vllm.flashmla_sparse --kv-cache-dtype fp8_ds_mla --max-examples 300 &
  run clean-layer-bf16 320 $A --target vllm.flashmla_sparse.layer --kv-cache-dtype bfloat16 --max-examples 300 &
  run clean-layer-fp8 320 $A --target vllm.flashmla_sparse.layer --kv-cache-dtype fp8_ds_mla --max-examples 300 &
  run clean-triton-bf16 320 $A --target vllm.triton_sparse --max-examples 300 &
  run m-layer-A 320 $A --target vllm.flashmla_sparse.layer --inject remap-full-batch-req-id --max-examples 300 &
  run m-layer-E 320 $A --target vllm.flashmla_sparse.layer --inject mha-context-flat-fp8-gather --kv-cache-dtype fp8_ds_mla --max-examples 300 &
  run v0.23.0-triton 320 --vllm 0.23.0 -- $A --target vllm.triton_sparse --max-examples 100 &
  run v0.26.0-triton 320 --vllm 0.26.0 -- $A --target vllm.triton_sparse --max-examples 100 &
  run v0.26.0-flashmla 100 --vllm 0.26.0 -- $A --target vllm.flashmla_sparse --max-examples 10 &
  wait
fi
# The benchmark alone on the machine (kernel cache warm from phase 1).
run bench-flashmla 80 $A --target vllm.flashmla_sparse --profile gpu-bench --time-budget 60s
run bench-layer 80 $A --target vllm.flashmla_sparse.layer --profile gpu-bench --time-budget 60s
for d in "$R"/repros-m-*/*/; do
  [ -f "$d/repro.py" ] && (cd "$d" && timeout 60 $OLDPWD/$G -- python3 repro.py > repro.log 2>&1; echo "exit=$?" >> repro.log) &
done
wait
