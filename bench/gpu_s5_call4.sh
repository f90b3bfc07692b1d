#!/usr/bin/env bash
# One H200 (nvidia-h200), session 5's last call (about 9 minutes):
#   1. alone: throughput of vllm.flashmla_sparse on the gpu-bench profile, after a warm-up by 8 workers that
#      compiles the Triton variants these cases reach: 1 worker, then 8 workers on the one GPU;
#   2. together: initcheck campaigns (the parser now names kernels built without line info): vllm.triton_sparse
#      (3 workers), vllm.flashmla_sparse bf16 (3 workers), vllm.flashmla_sparse fp8_ds_mla (1 worker); seed bug
#      A on the layer target under --sanitizer auto, then its repro.py plainly and under memcheck.
# Results: $OUT/r/* and one tarball $OUT/s5-call4.tgz.
export OMP_NUM_THREADS=2
source bench/gpu_lib.sh
T0=$(date +%s)
trap 'cd "$R" && tar czf "$OUT/s5-call4.tgz" . 2>/dev/null' EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$R/gpu.txt" 2>&1; nproc --all >> "$R/gpu.txt"
B="--target vllm.flashmla_sparse --profile gpu-bench --no-shrink --reruns 1"
run bench-warm8 100 $A $B --seed 101 --time-budget 30s --workers 8 --db /tmp/warm-db
run bench-w1 80 $A $B --seed 3 --time-budget 30s --db /tmp/w1-db
run bench-w8 120 $A $B --seed 3 --time-budget 60s --workers 8 --db /tmp/bench-db
echo "phase 1 ended at $(( $(date +%s) - T0 )) s" >> "$R/gpu.txt"
DEADLINE=${DEADLINE:-565}
pids=()
( export ATTNFUZZ_STATE=/tmp/st-init-triton
  run initcheck-triton 300 $A --target vllm.triton_sparse --sanitizer initcheck --workers 3 --db /tmp/it-db --seed 31 \
      --time-budget 210s --no-shrink --reruns 1 ) & pids+=($!)
( export ATTNFUZZ_STATE=/tmp/st-init-bf16
  run initcheck-flashmla-bf16 300 $A --target vllm.flashmla_sparse --kv-cache-dtype bfloat16 --sanitizer initcheck \
      --workers 3 --db /tmp/ib-db --seed 41 --time-budget 210s --no-shrink --reruns 1
  $G -- python3 bench/sanitizer_log_summary.py initcheck $(find /tmp/st-init-bf16 -name '*.log' -size -200M) \
      2>&1 | head -c 400000 > "$R/initcheck-flashmla-bf16.summary" ) & pids+=($!)
( export ATTNFUZZ_STATE=/tmp/st-init-fp8
  run initcheck-flashmla-fp8 300 $A --target vllm.flashmla_sparse --kv-cache-dtype fp8_ds_mla --sanitizer initcheck \
      --seed 51 --time-budget 200s --no-shrink --reruns 1
  $G -- python3 bench/sanitizer_log_summary.py initcheck $(find /tmp/st-init-fp8 -name '*.log' -size -200M) \
      2>&1 | head -c 400000 > "$R/initcheck-flashmla-fp8.summary" ) & pids+=($!)
( export ATTNFUZZ_STATE=/tmp/st-A
  run mutant-A-layer 220 $A --target vllm.flashmla_sparse.layer --inject remap-full-batch-req-id --sanitizer auto --no-shrink \
      --max-findings 1 --reruns 1 --seed 5
  f=$(ls -d /tmp/repros-mutant-A-layer/*/ 2>/dev/null | head -1)
  if [ -n "$f" ]; then cp "$f/repro.py" "$R/mutant-A-repro.py"
    timeout 45 $G -- python3 "$f/repro.py" > "$R/mutant-A-repro-plain.log" 2>&1; echo "exit=$?" >> "$R/mutant-A-repro-plain.log"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 110 $G -- compute-sanitizer --tool memcheck --print-limit 5 python3 "$f/repro.py" \
      > "$R/mutant-A-repro-memcheck.log" 2>&1; echo "exit=$?" >> "$R/mutant-A-repro-memcheck.log"; fi ) & pids+=($!)
( sleep $(( DEADLINE - ($(date +%s) - T0) )); pkill -ABRT -f fuzzer.cli; pkill -f compute-sanitizer ) & watchdog=$!
wait "${pids[@]}"; kill $watchdog 2>/dev/null
echo "all ended at $(( $(date +%s) - T0 )) s" >> "$R/gpu.txt"
cd "$R"; for f in gpu.txt bench-*.log initcheck-*.log mutant-A*.log; do [ -f "$f" ] && { echo "== $f"; tail -7 "$f"; }; done
