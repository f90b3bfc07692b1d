#!/usr/bin/env bash
# One H200 (nvidia-h200), session 6's last call (about 4 minutes): the memcheck side with this session's
# changes (sanitized workers recycled every 150 cases, campaign stop rules), all at once:
#   1. tests/gpu (allocator poisoning; the seed bug under memcheck, and blind with the caching allocator on);
#   2. a vllm.flashmla_sparse memcheck campaign, 2 workers x 110 cases (bf16 and fp8_ds_mla drawn).
# Results: $OUT/r/* and one tarball $OUT/s6-call5.tgz.
export OMP_NUM_THREADS=2
source bench/gpu_lib.sh
T0=$(date +%s)
trap 'cd "$R" && tar czf "$OUT/s6-call5.tgz" . 2>/dev/null' EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$R/gpu.txt" 2>&1
pids=()
( ATTNFUZZ_TEST_DEVICE=cuda timeout 200 $G -- python3 -m pytest -q -rs -p no:cacheprovider tests/gpu > "$R/pytest-gpu.log" 2>&1
  echo "exit=$?" >> "$R/pytest-gpu.log" ) & pids+=($!)
( export ATTNFUZZ_STATE=/tmp/st-mc
  /usr/bin/time -f "%e s wall" timeout -s INT 200 $G -- python3 -m fuzzer.cli --device cuda run --sanitizer memcheck \
    --target vllm.flashmla_sparse --workers 2 --max-examples 110 --no-shrink --reruns 1 --seed 121 --db /tmp/db-mc \
    --json "$R/memcheck-flashmla.json" --repros /tmp/repros-mc > /tmp/mc.log 2>&1; echo "exit=$?" >> /tmp/mc.log
  grep -v "deep_gemm\|Padding\|Warning\|warn(" /tmp/mc.log | tail -c 8000 > "$R/memcheck-flashmla.log" ) & pids+=($!)
wait "${pids[@]}"
echo "all ended at $(( $(date +%s) - T0 )) s" >> "$R/gpu.txt"
cd "$R"; cat gpu.txt; tail -4 pytest-gpu.log; tail -5 memcheck-flashmla.log
