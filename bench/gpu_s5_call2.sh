#!/usr/bin/env bash
# One H200 (nvidia-h200), session 5's second call (about 8 minutes):
#   1. alone: throughput of vllm.flashmla_sparse on the gpu-bench profile after a warm-up: 1 worker, then 8
#      workers on the one GPU (Hypothesis's Pareto front now kept only for cases that score);
#   2. together: where initcheck's reports come from (bench/initcheck_stages.py under compute-sanitizer: one
#      run with host backtraces for the host-API reports, one without API checks for the kernels' reports),
#      20-case initcheck campaigns of both backend targets (per-case summaries of the worker logs), and a
#      memcheck campaign with 3 workers.
# Results: $OUT/r/* and one tarball $OUT/s5-call2.tgz.
export OMP_NUM_THREADS=2
source bench/gpu_lib.sh
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$R/gpu.txt" 2>&1; nproc --all >> "$R/gpu.txt"
trap 'cd "$R" && tar czf "$OUT/s5-call2.tgz" . 2>/dev/null' EXIT
B="--target vllm.flashmla_sparse --profile gpu-bench --no-shrink --reruns 1"
run bench-warm 100 $A $B --seed 1 --max-examples 20
run bench-w1 70 $A $B --seed 3 --time-budget 30s
run bench-w8 110 $A $B --seed 3 --time-budget 50s --workers 8 --db /tmp/bench-db
echo "phase 1 ended at $(( $(date +%s) - T0 )) s" >> "$R/gpu.txt"
DEADLINE=${DEADLINE:-470}
pids=()
CS="compute-sanitizer --tool initcheck"
( export PYTORCH_NO_CUDA_MEMORY_CACHING=1
  timeout 200 $G -- $CS --print-limit 12 --show-backtrace host python3 bench/initcheck_stages.py vllm.flashmla_sparse 2 \
    > /tmp/stages-host.log 2>&1; echo "exit=$?" >> /tmp/stages-host.log
  $G -- python3 bench/sanitizer_log_summary.py initcheck /tmp/stages-host.log > "$R/stages-host-summary.log" 2>&1
  head -c 3000000 /tmp/stages-host.log > "$R/stages-host.log" ) & pids+=($!)
( export PYTORCH_NO_CUDA_MEMORY_CACHING=1
  timeout 250 $G -- $CS --print-limit 6000 --show-backtrace no --check-api-memory-access no \
    python3 bench/initcheck_stages.py vllm.flashmla_sparse 6 > /tmp/stages-dev.log 2>&1; echo "exit=$?" >> /tmp/stages-dev.log
  $G -- python3 bench/sanitizer_log_summary.py initcheck /tmp/stages-dev.log > "$R/stages-dev-summary.log" 2>&1
  head -c 2000000 /tmp/stages-dev.log > "$R/stages-dev.log" ) & pids+=($!)
for t in vllm.flashmla_sparse vllm.triton_sparse; do
  ( export ATTNFUZZ_STATE=/tmp/st-init-$t ATTNFUZZ_SANITIZER_OPTIONS="--print-limit 8000"
    timeout 280 $G -- $A --target $t --sanitizer initcheck --seed 11 --max-examples 20 --time-budget 190s --no-shrink --reruns 0 \
      --json "$R/initcheck20-$t.json" --out "/tmp/out-$t" --repros "/tmp/repros-init-$t" > "$R/initcheck20-$t.log" 2>&1
    echo "exit=$?" >> "$R/initcheck20-$t.log"
    cp "/tmp/out-$t/campaign.json" "$R/initcheck20-$t.campaign.json" 2>/dev/null
    $G -- python3 bench/sanitizer_log_summary.py initcheck $(find /tmp/st-init-$t -name '*.log') > "$R/initcheck20-$t.summary" 2>&1
  ) & pids+=($!)
done
( export ATTNFUZZ_STATE=/tmp/st-mem
  run memcheck-3w 230 $A --target vllm.flashmla_sparse --sanitizer memcheck --workers 3 --db /tmp/mem-db --seed 7 \
      --time-budget 150s --no-shrink --reruns 1 ) & pids+=($!)
( sleep $(( DEADLINE - ($(date +%s) - T0) )); pkill -ABRT -f fuzzer.cli; pkill -f compute-sanitizer ) & watchdog=$!
wait "${pids[@]}"; kill $watchdog 2>/dev/null
echo "all ended at $(( $(date +%s) - T0 )) s" >> "$R/gpu.txt"
cd "$R"; for f in gpu.txt bench-*.log memcheck*.log initcheck20-*.log; do [ -f "$f" ] && { echo "== $f"; tail -6 "$f"; }; done
head -50 stages-dev-summary.log
