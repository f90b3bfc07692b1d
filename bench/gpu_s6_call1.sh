#!/usr/bin/env bash
# One H200 (nvidia-h200), session 6's first call (about 8 minutes), all at once:
#   1. initcheck triage: bench/initcheck_triage.py's hand-built cases (one question each: head padding, a row
#      with no valid index, fp8 split-KV decode, padding rows, the prefill gather) in one process under
#      initcheck, a marker around every stage and kernel-library call, host backtraces;
#   2. tests/gpu with ATTNFUZZ_TEST_DEVICE=cuda (allocator poisoning; the seed bug under memcheck, and blind
#      with the caching allocator on), then poisoned native campaigns of vllm.flashmla_sparse (200 cases each);
#   3. vllm.triton_sparse under initcheck, 3 workers, 220 cases, its full output and its workers' logs kept
#      (session 5's run of it ended at its limit with nothing written).
# Results: $OUT/r/* and one tarball $OUT/s6-call1.tgz.
export OMP_NUM_THREADS=2
source bench/gpu_lib.sh
T0=$(date +%s)
trap 'cd "$R" && tar czf "$OUT/s6-call1.tgz" . 2>/dev/null' EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$R/gpu.txt" 2>&1; nproc --all >> "$R/gpu.txt"
pids=()
( export PYTORCH_NO_CUDA_MEMORY_CACHING=1
  /usr/bin/time -f "%e s wall" timeout 300 $G -- compute-sanitizer --tool initcheck --print-limit 100000 --show-backtrace host \
    python3 bench/initcheck_triage.py > /tmp/triage.log 2>&1; echo "exit=$?" >> /tmp/triage.log
  $G -- python3 bench/sanitizer_log_summary.py initcheck /tmp/triage.log 2>&1 | head -c 600000 > "$R/triage-summary.log"
  grep -E "^(CASE|emulated|exit=|=====.*ERROR SUMMARY)|s wall" /tmp/triage.log > "$R/triage-cases.log"
  tail -c 20000 /tmp/triage.log > "$R/triage-tail.log" ) & pids+=($!)
( ATTNFUZZ_TEST_DEVICE=cuda timeout 300 $G -- python3 -m pytest -q -rs -p no:cacheprovider tests/gpu > "$R/pytest-gpu.log" 2>&1
  echo "exit=$?" >> "$R/pytest-gpu.log"
  export ATTNFUZZ_POISON_ALLOCATOR=1 ATTNFUZZ_STATE=/tmp/st-p
  for d in bfloat16 fp8_ds_mla; do
    run poisoned-$d 150 $A --target vllm.flashmla_sparse --kv-cache-dtype $d --max-examples 200 --no-shrink --reruns 1 --seed 61
  done ) & pids+=($!)
( export ATTNFUZZ_STATE=/tmp/st-it
  /usr/bin/time -f "%e s wall" timeout -s INT 420 $G -- python3 -m fuzzer.cli --device cuda run --target vllm.triton_sparse \
    --sanitizer initcheck --workers 3 --max-examples 220 --no-shrink --reruns 1 --seed 71 --db /tmp/it-db \
    --json "$R/initcheck-triton.json" --repros /tmp/repros-it > /tmp/it.log 2>&1; echo "exit=$?" >> /tmp/it.log
  grep -v "deep_gemm\|Padding\|Warning\|warn(" /tmp/it.log | tail -c 30000 > "$R/initcheck-triton.log"
  mkdir -p "$R/it-workers"; find /tmp/st-it -type f -name '*.log' | head -12 | while read -r f; do
    tail -c 40000 "$f" > "$R/it-workers/$(echo "${f#/tmp/st-it/}" | tr / _)"; done
  find /tmp/st-it -maxdepth 4 -ls > "$R/it-state.txt" 2>&1 ) & pids+=($!)
wait "${pids[@]}"
echo "all ended at $(( $(date +%s) - T0 )) s" >> "$R/gpu.txt"
cd "$R"; cat gpu.txt; tail -4 pytest-gpu.log; for f in poisoned-*.log; do echo "== $f"; tail -4 "$f"; done
echo "== triage"; cat triage-cases.log | cut -c1-300; grep -c . triage-summary.log
echo "== triton initcheck"; tail -8 initcheck-triton.log
