#!/usr/bin/env bash
# CPU (Triton interpreter + stand-ins), issue 3: clean campaigns per backend target and kv_cache_dtype, and the
# layer target's seed-bug mutants. Two streams (the machine has 2 cores). Results: JSON + logs under $1.
set -uo pipefail
R=${1:-docs/results/cpu-$(date +%F)-s2}; mkdir -p "$R"
export ATTNFUZZ_STATE=${ATTNFUZZ_STATE:-/tmp/attnfuzz-cpu-bench}
PY=${PY:-.venv/bin/python}
run() { local name=$1; shift
  /usr/bin/time -f "%e s wall" $PY -m fuzzer.cli --device cpu run "$@" --json "$R/$name.json" --repros "/tmp/cpu-repros/$name" \
    --quiet > "$R/$name.log" 2>&1; echo "exit=$?" >> "$R/$name.log"; }
( run clean-layer-bf16 --target vllm.flashmla_sparse.layer --kv-cache-dtype bfloat16 --max-examples 300
  run clean-layer-fp8 --target vllm.flashmla_sparse.layer --kv-cache-dtype fp8_ds_mla --max-examples 300
  run clean-flashmla-bf16 --target vllm.flashmla_sparse --kv-cache-dtype bfloat16 --max-examples 300
  run clean-flashmla-fp8 --target vllm.flashmla_sparse --kv-cache-dtype fp8_ds_mla --max-examples 300
  run m-layer-A --target vllm.flashmla_sparse.layer --inject remap-full-batch-req-id --max-examples 300 --seed 1
  run m-layer-E --target vllm.flashmla_sparse.layer --inject mha-context-flat-fp8-gather --max-examples 300 --seed 1 ) &
( run clean-triton-bf16 --target vllm.triton_sparse --max-examples 300 ) &
wait
