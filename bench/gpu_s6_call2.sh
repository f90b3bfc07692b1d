#!/usr/bin/env bash
# One H200 (nvidia-h200), session 6's second call (about 8 minutes). Call 1 showed every initcheck report on
# the FlashMLA paths to be a read of memory that FlashMLA's kernels had written through TMA bulk copies (the
# oracle's copy of the output, the combine kernel's read of the split accumulators, a cudaMemcpy of the output),
# while allocator-poisoned native runs of the same paths saw no unwritten value. attnfuzz now gives initcheck
# --check-bulk-copy yes where the tool has it. All at once:
#   1. the tool's version and options; bench/initcheck_triage.py under initcheck with that option;
#   2. initcheck campaigns, 2 workers x 110 cases each: vllm.flashmla_sparse bf16 and fp8_ds_mla,
#      vllm.triton_sparse; their workers' device-memory lines (call 1: an OOM every ~540 sanitized cases).
# Results: $OUT/r/* and one tarball $OUT/s6-call2.tgz.
export OMP_NUM_THREADS=2
source bench/gpu_lib.sh
T0=$(date +%s)
trap 'cd "$R" && tar czf "$OUT/s6-call2.tgz" . 2>/dev/null' EXIT
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc --all; $CS --version | tail -2
  $CS --help | grep -i -A2 "bulk-copy\|warpgroup"; $G -- python3 -c "import hypothesis; print('hypothesis', hypothesis.__version__)"
} > "$R/gpu.txt" 2>&1
pids=()
( export PYTORCH_NO_CUDA_MEMORY_CACHING=1
  /usr/bin/time -f "%e s wall" timeout 300 $G -- $CS --tool initcheck --check-bulk-copy yes --print-limit 2000 \
    --show-backtrace host python3 bench/initcheck_triage.py > /tmp/triage.log 2>&1; echo "exit=$?" >> /tmp/triage.log
  $G -- python3 bench/sanitizer_log_summary.py initcheck /tmp/triage.log 2>&1 | head -c 300000 > "$R/triage-summary.log"
  grep -E "^(CASE|emulated|exit=|=====.*ERROR SUMMARY)|s wall" /tmp/triage.log | cut -c1-400 > "$R/triage-cases.log" ) & pids+=($!)
campaign() { local name=$1; shift
  ( export ATTNFUZZ_STATE=/tmp/st-$name
    /usr/bin/time -f "%e s wall" timeout -s INT 470 $G -- python3 -m fuzzer.cli --device cuda run --sanitizer initcheck \
      --workers 2 --max-examples 110 --no-shrink --reruns 1 --db /tmp/db-$name --json "$R/$name.json" \
      --repros /tmp/repros-$name "$@" > /tmp/$name.log 2>&1; echo "exit=$?" >> /tmp/$name.log
    grep -v "deep_gemm\|Padding\|Warning\|warn(" /tmp/$name.log | tail -c 12000 > "$R/$name.log"
    find /tmp/st-$name -name '*.log' | sort | while read -r f; do echo "== $f"; head -c 1500 "$f"; echo ...
      grep -E "ATTNFUZZ-DEVICE-MEMORY|ERROR SUMMARY|returned an error" "$f" | tail -40; tail -c 1500 "$f"; done \
      | grep -v "^ATTNFUZZ-CASE" | head -c 150000 > "$R/$name-workers.log" ) & pids+=($!)
}
campaign initcheck-flashmla-bf16 --target vllm.flashmla_sparse --kv-cache-dtype bfloat16 --seed 81
campaign initcheck-flashmla-fp8 --target vllm.flashmla_sparse --kv-cache-dtype fp8_ds_mla --seed 91
campaign initcheck-triton --target vllm.triton_sparse --seed 101
wait "${pids[@]}"
echo "all ended at $(( $(date +%s) - T0 )) s" >> "$R/gpu.txt"
cd "$R"; cat gpu.txt; echo "== triage"; cut -c1-160 triage-cases.log | grep -v "^CASE.*heads"
for f in initcheck-*.log; do case $f in *-workers.log) continue;; esac; echo "== $f"; tail -6 "$f"; done
