#!/usr/bin/env bash
# Prepared in session 5 for the next GPU session (not yet run): triage of what initcheck reports on the FlashMLA
# paths (docs/benchmarks.md, session 5), one H200, about 5 minutes, all at once:
#   1. the allocator poisoning's GPU test, then poisoned native campaigns (do unwritten outputs show as NaN?);
#   2. which host call makes the uninitialized cudaMemcpy: host-API reports only (device checks off for the
#      kernels named below), host backtraces, print limit 4;
#   3. the kernels' reports with FlashMLA's combine kernel left out, so the others are not drowned by it.
# The filter syntax (kns=substring, regex=...) is from compute-sanitizer's manual, not yet tried on the host.
# Results: $OUT/r/* and one tarball $OUT/initcheck-triage.tgz.
export OMP_NUM_THREADS=2
source bench/gpu_lib.sh
trap 'cd "$R" && tar czf "$OUT/initcheck-triage.tgz" . 2>/dev/null' EXIT
CS="compute-sanitizer --tool initcheck"
pids=()
( ATTNFUZZ_TEST_DEVICE=cuda timeout 100 $G -- python3 -m pytest -q -rs tests/gpu/test_poison_gpu.py > "$R/pytest-poison.log" 2>&1
  export ATTNFUZZ_POISON_ALLOCATOR=1 ATTNFUZZ_STATE=/tmp/st-p
  for d in bfloat16 fp8_ds_mla; do run poisoned-$d 150 $A --target vllm.flashmla_sparse --kv-cache-dtype $d --max-examples 200 --no-shrink --reruns 1; done
) & pids+=($!)
( export PYTORCH_NO_CUDA_MEMORY_CACHING=1
  timeout 250 $G -- $CS --print-limit 4 --show-backtrace host --kernel-name-exclude 'regex=.*' \
    python3 bench/initcheck_stages.py vllm.flashmla_sparse 20 > /tmp/api.log 2>&1
  $G -- python3 bench/sanitizer_log_summary.py initcheck /tmp/api.log > "$R/api-summary.log" 2>&1 ) & pids+=($!)
( export PYTORCH_NO_CUDA_MEMORY_CACHING=1
  timeout 250 $G -- $CS --print-limit 2000 --check-api-memory-access no --kernel-name-exclude kns=flash_fwd_mla_combine \
    python3 bench/initcheck_stages.py vllm.flashmla_sparse 12 > /tmp/kern.log 2>&1
  $G -- python3 bench/sanitizer_log_summary.py initcheck /tmp/kern.log > "$R/kernels-summary.log" 2>&1 ) & pids+=($!)
wait "${pids[@]}"
cd "$R"; tail -5 pytest-poison.log; for f in poisoned-*.log; do echo "== $f"; tail -6 "$f"; done; head -40 api-summary.log kernels-summary.log
