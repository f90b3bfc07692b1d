#!/usr/bin/env bash
# One H200 (nvidia-h200), session 6's fourth call (about 5 minutes). Call 3's probe of the kernel filter ran
# `true`, which makes no CUDA call, and so read as refused: the probe now passes --require-cuda-init no. All at once:
#   1. the layer target's cases under attnfuzz's initcheck command, host backtraces (call 3: every case reported);
#   2. the vllm.flashmla_sparse fp8_ds_mla initcheck campaign, 2 workers x 110 cases, with the filter.
# Results: $OUT/r/* and one tarball $OUT/s6-call4.tgz.
export OMP_NUM_THREADS=2
source bench/gpu_lib.sh
T0=$(date +%s)
trap 'cd "$R" && tar czf "$OUT/s6-call4.tgz" . 2>/dev/null' EXIT
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc --all; $CS --version | tail -2
  $CS --require-cuda-init no --tool initcheck --kernel-name-exclude kns=flash_fwd_mla_combine_kernel true; echo "kernel filter rc=$?"
  $G -- python3 -c "from fuzzer.sanitizer import sanitizer_command as c; print(' '.join(c('initcheck')))"
} > "$R/gpu.txt" 2>&1
pids=()
( export PYTORCH_NO_CUDA_MEMORY_CACHING=1
  export ATTNFUZZ_SANITIZER=initcheck ATTNFUZZ_SANITIZER_OPTIONS="--print-limit 300 --show-backtrace host" ATTNFUZZ_TRIAGE_TARGET=vllm.flashmla_sparse.layer
  CMD=$($G -- python3 -c "from fuzzer.sanitizer import sanitizer_command as c; print(' '.join(c('initcheck')))")
  /usr/bin/time -f "%e s wall" timeout 250 $G -- $CMD python3 bench/initcheck_triage.py layer-one-token-h16 layer-short-prefill-h16 layer-fp8-prefill-with-context-h16 > /tmp/triage.log 2>&1
  echo "exit=$?" >> /tmp/triage.log
  $G -- python3 bench/sanitizer_log_summary.py initcheck /tmp/triage.log 2>&1 | head -c 300000 > "$R/triage-summary.log"
  grep -E "^(CASE|emulated|exit=|=====.*ERROR SUMMARY)|s wall" /tmp/triage.log | cut -c1-400 > "$R/triage-cases.log" ) & pids+=($!)
campaign() { local name=$1; shift
  ( export ATTNFUZZ_STATE=/tmp/st-$name
    /usr/bin/time -f "%e s wall" timeout -s INT 290 $G -- python3 -m fuzzer.cli --device cuda run --sanitizer initcheck \
      "$@" --no-shrink --reruns 1 --db /tmp/db-$name --json "$R/$name.json" \
      --repros /tmp/repros-$name > /tmp/$name.log 2>&1; echo "exit=$?" >> /tmp/$name.log
    grep -v "deep_gemm\|Padding\|Warning\|warn(" /tmp/$name.log | tail -c 12000 > "$R/$name.log"
    find /tmp/st-$name -name '*.log' | sort | while read -r f; do echo "== $f"; head -c 1500 "$f"; echo ...
      grep -E "ATTNFUZZ-DEVICE-MEMORY|ERROR SUMMARY|returned an error" "$f" | tail -40; tail -c 1500 "$f"; done \
      | grep -v "^ATTNFUZZ-CASE" | head -c 150000 > "$R/$name-workers.log" ) & pids+=($!)
}
campaign initcheck-flashmla-fp8 --target vllm.flashmla_sparse --kv-cache-dtype fp8_ds_mla --seed 93 --workers 2 --max-examples 110
wait "${pids[@]}"
echo "all ended at $(( $(date +%s) - T0 )) s" >> "$R/gpu.txt"
cd "$R"; cat gpu.txt; echo "== triage"; cut -c1-160 triage-cases.log | grep -v "^CASE.*heads"
for f in initcheck-*.log; do case $f in *-workers.log) continue;; esac; echo "== $f"; tail -6 "$f"; done
