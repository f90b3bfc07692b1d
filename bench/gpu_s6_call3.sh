#!/usr/bin/env bash
# One H200 (nvidia-h200), session 6's third call (about 8 minutes). Call 2: --check-bulk-copy is already on by
# default and changed nothing. So now, under initcheck, the FlashMLA targets fill FlashMLA's outputs with NaN
# before each call (a write initcheck sees; an element left unwritten stays NaN for the oracle), and FlashMLA's
# combine kernel (it reads only its split kernel's TMA-written accumulators) is not checked. All at once:
#   1. whether the tool takes the kernel filter; the triage cases under attnfuzz's own initcheck command;
#   2. initcheck campaigns, 2 workers x 110 cases: vllm.flashmla_sparse bf16 and fp8_ds_mla; the layer target,
#      1 worker x 60.
# Results: $OUT/r/* and one tarball $OUT/s6-call3.tgz.
export OMP_NUM_THREADS=2
source bench/gpu_lib.sh
T0=$(date +%s)
trap 'cd "$R" && tar czf "$OUT/s6-call3.tgz" . 2>/dev/null' EXIT
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc --all; $CS --version | tail -2
  $CS --tool initcheck --kernel-name-exclude kns=flash_fwd_mla_combine_kernel true; echo "kernel filter rc=$?"
  $G -- python3 -c "from fuzzer.sanitizer import sanitizer_command as c; print(' '.join(c('initcheck')))"
} > "$R/gpu.txt" 2>&1
pids=()
( export PYTORCH_NO_CUDA_MEMORY_CACHING=1
  export ATTNFUZZ_SANITIZER=initcheck ATTNFUZZ_SANITIZER_OPTIONS="--print-limit 2000 --show-backtrace host"
  CMD=$($G -- python3 -c "from fuzzer.sanitizer import sanitizer_command as c; print(' '.join(c('initcheck')))")
  /usr/bin/time -f "%e s wall" timeout 300 $G -- $CMD python3 bench/initcheck_triage.py > /tmp/triage.log 2>&1
  echo "exit=$?" >> /tmp/triage.log
  $G -- python3 bench/sanitizer_log_summary.py initcheck /tmp/triage.log 2>&1 | head -c 300000 > "$R/triage-summary.log"
  grep -E "^(CASE|emulated|exit=|=====.*ERROR SUMMARY)|s wall" /tmp/triage.log | cut -c1-400 > "$R/triage-cases.log" ) & pids+=($!)
campaign() { local name=$1; shift
  ( export ATTNFUZZ_STATE=/tmp/st-$name
    /usr/bin/time -f "%e s wall" timeout -s INT 430 $G -- python3 -m fuzzer.cli --device cuda run --sanitizer initcheck \
      "$@" --no-shrink --reruns 1 --db /tmp/db-$name --json "$R/$name.json" \
      --repros /tmp/repros-$name > /tmp/$name.log 2>&1; echo "exit=$?" >> /tmp/$name.log
    grep -v "deep_gemm\|Padding\|Warning\|warn(" /tmp/$name.log | tail -c 12000 > "$R/$name.log"
    find /tmp/st-$name -name '*.log' | sort | while read -r f; do echo "== $f"; head -c 1500 "$f"; echo ...
      grep -E "ATTNFUZZ-DEVICE-MEMORY|ERROR SUMMARY|returned an error" "$f" | tail -40; tail -c 1500 "$f"; done \
      | grep -v "^ATTNFUZZ-CASE" | head -c 150000 > "$R/$name-workers.log" ) & pids+=($!)
}
campaign initcheck-flashmla-bf16 --target vllm.flashmla_sparse --kv-cache-dtype bfloat16 --seed 82 --workers 2 --max-examples 110
campaign initcheck-flashmla-fp8 --target vllm.flashmla_sparse --kv-cache-dtype fp8_ds_mla --seed 92 --workers 2 --max-examples 110
campaign initcheck-layer --target vllm.flashmla_sparse.layer --seed 112 --max-examples 60
wait "${pids[@]}"
echo "all ended at $(( $(date +%s) - T0 )) s" >> "$R/gpu.txt"
cd "$R"; cat gpu.txt; echo "== triage"; cut -c1-160 triage-cases.log | grep -v "^CASE.*heads"
for f in initcheck-*.log; do case $f in *-workers.log) continue;; esac; echo "== $f"; tail -6 "$f"; done
