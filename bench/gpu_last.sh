#!/usr/bin/env bash
# GPU host: the two clean target x dtype campaigns that never started in gpu_issue3.sh, and the Triton
# backend against vLLM 0.26.0. Results: $OUT/r (JSON and short logs only).
set -uo pipefail
R=${OUT:-/tmp/out}/r; mkdir -p "$R"
G=scripts/gpu-host.sh
export PYTHONUNBUFFERED=1 ATTNFUZZ_STATE=/tmp/attnfuzz-state OMP_NUM_THREADS=4
$G -- true; $G --vllm 0.26.0 -- true
run() { local name=$1 limit=$2; shift 2
  ( timeout -s ABRT "$limit" $G "$@" --json "$R/$name.json" --repros "/tmp/repros-$name" --quiet 2>&1 | grep -v "deep_gemm\|Padding\|^  File\|^    " | tail -15 > "$R/$name.log"; echo "exit=${PIPESTATUS[0]}" >> "$R/$name.log" ); }
A="attnfuzz --device cuda run"
run clean-flashmla-fp8 170 $A --target vllm.flashmla_sparse --kv-cache-dtype fp8_ds_mla --max-examples 300 &
run clean-layer-bf16 170 $A --target vllm.flashmla_sparse.layer --kv-cache-dtype bfloat16 --max-examples 300 &
run v0.26.0-triton 170 --vllm 0.26.0 -- $A --target vllm.triton_sparse --max-examples 100 --reruns 1 &
wait
