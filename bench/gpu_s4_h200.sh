#!/usr/bin/env bash
# One H200 (nvidia-h200), session 4's last call (about 9 minutes):
#   1. alone: throughput of `vllm.flashmla_sparse` on the gpu-bench profile (16 requests, 4K context, top-k up
#      to 2048), after a warm-up that fills Triton's kernel cache: 1 worker, then 4 workers on the one GPU;
#   2. together: an initcheck diagnosis (5 cases, host backtraces), an initcheck campaign (3 workers), a
#      memcheck campaign (1 worker), the FlashMLA target on vLLM 0.26.0 and 0.23.0 with their own FlashMLA
#      extensions (0.26.0: its top-k length bug on the real kernel, and that finding's repro.py on 0.26.0 and
#      0.33.0), the layer target on 0.26.0, and the seed-bug mutant's GPU reproducer under memcheck.
# Results: $OUT/r/*.log and one tarball $OUT/s4-h200.tgz (only 8 files come back from a call).
export OMP_NUM_THREADS=2
source bench/gpu_lib.sh  # (the prelude these ran with, moved there after the runs)
T0=$(date +%s)
$G --vllm 0.26.0 -- true; $G --vllm 0.23.0 -- true  # unpack these releases too before jobs start at once
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$R/gpu.txt" 2>&1; nproc >> "$R/gpu.txt"
B="--target vllm.flashmla_sparse --profile gpu-bench --no-shrink --reruns 1"
# 1. throughput, alone
run bench-warm 100 $A $B --seed 1 --max-examples 30
run bench-w1 90 $A $B --seed 3 --time-budget 50s
run bench-w4 100 $A $B --seed 3 --time-budget 50s --workers 4 --db /tmp/bench-db
echo "phase 1 ended at $(( $(date +%s) - T0 )) s" >> "$R/gpu.txt"
# 2. together, until DEADLINE s after the start: then what still runs is stopped and the results packed
DEADLINE=${DEADLINE:-545}
pids=()
( export ATTNFUZZ_STATE=/tmp/st-diag ATTNFUZZ_SANITIZER_OPTIONS="--show-backtrace host"
  run initcheck-diag 200 $A --target vllm.flashmla_sparse --sanitizer initcheck --seed 11 --max-examples 5 --no-shrink --reruns 0
  tar czf "$R/initcheck-diag-logs.tgz" -C /tmp/st-diag workers 2>/dev/null ) &
pids+=($!)
( export ATTNFUZZ_STATE=/tmp/st-init
  run initcheck-3w 250 $A --target vllm.flashmla_sparse --sanitizer initcheck --workers 3 --db /tmp/init-db --seed 21 \
      --time-budget 170s --no-shrink --reruns 1
  find /tmp/st-init -name 'worker-*.log' -size -50M | tar czf "$R/initcheck-3w-logs.tgz" -T - 2>/dev/null ) &
pids+=($!)
( export ATTNFUZZ_STATE=/tmp/st-mem
  run memcheck 170 $A --target vllm.flashmla_sparse --sanitizer memcheck --seed 7 --time-budget 110s --no-shrink ) &
pids+=($!)
( export ATTNFUZZ_STATE=/tmp/st-026
  run v026-flashmla-bf16 150 --vllm 0.26.0 -- $A --target vllm.flashmla_sparse --kv-cache-dtype bfloat16 --max-examples 40 \
      --max-findings 1 --reruns 2
  f=$(ls -d /tmp/repros-v026-flashmla-bf16/*/ 2>/dev/null | head -1)
  if [ -n "$f" ]; then cp "$f/finding.json" "$R/v026-finding.json"
    for v in 0.26.0 0.33.0; do
      if [ $v = 0.33.0 ]; then timeout 90 $G -- python3 "$f/repro.py" > "$R/v026-repro-on-$v.log" 2>&1
      else timeout 90 $G --vllm $v -- python3 "$f/repro.py" > "$R/v026-repro-on-$v.log" 2>&1; fi
      echo "exit=$?" >> "$R/v026-repro-on-$v.log"; done; fi
  run v026-layer 100 --vllm 0.26.0 -- $A --target vllm.flashmla_sparse.layer --max-examples 40 --no-shrink ) &
pids+=($!)
( export ATTNFUZZ_STATE=/tmp/st-023
  run v023-flashmla 150 --vllm 0.23.0 -- $A --target vllm.flashmla_sparse --max-examples 60 --no-shrink ) &
pids+=($!)
( export ATTNFUZZ_STATE=/tmp/st-A
  run mutant-A 150 $A --target vllm.flashmla_sparse --inject remap-full-batch-req-id --sanitizer auto --no-shrink \
      --max-findings 1 --reruns 1
  f=$(ls -d /tmp/repros-mutant-A/*/ 2>/dev/null | head -1)
  if [ -n "$f" ]; then cp "$f/finding.json" "$R/mutant-A-finding.json"
    timeout 60 $G -- python3 "$f/repro.py" > "$R/mutant-A-repro-plain.log" 2>&1; echo "exit=$?" >> "$R/mutant-A-repro-plain.log"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 $G -- compute-sanitizer --tool memcheck --print-limit 5 python3 "$f/repro.py" \
      > "$R/mutant-A-repro-memcheck.log" 2>&1; echo "exit=$?" >> "$R/mutant-A-repro-memcheck.log"; fi ) &
pids+=($!)
( sleep $(( DEADLINE - ($(date +%s) - T0) )); pkill -ABRT -f fuzzer.cli; pkill -f compute-sanitizer ) & watchdog=$!
wait "${pids[@]}"; kill $watchdog 2>/dev/null
echo "all ended at $(( $(date +%s) - T0 )) s" >> "$R/gpu.txt"
cd "$R" && tar czf "$OUT/s4-h200.tgz" . 2>/dev/null
for f in gpu.txt bench-*.log initcheck-*.log memcheck.log v02*.log mutant-A*.log; do [ -f "$f" ] && { echo "== $f"; tail -8 "$f"; }; done
