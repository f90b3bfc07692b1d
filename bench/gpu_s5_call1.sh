#!/usr/bin/env bash
# One H200 (nvidia-h200), session 5's first call (about 4 minutes), all jobs at once:
#   1. initcheck diagnosis: 5 cases of each backend target with host and device backtraces, worker logs back;
#   2. where one worker's time goes: cProfile of an in-process gpu-bench campaign of vllm.flashmla_sparse;
#   3. seed bug A (remap-full-batch-req-id) on the layer target under --sanitizer auto, then its repro.py
#      plainly and under compute-sanitizer memcheck with the caching allocator off;
#   4. the layer target on vLLM 0.26.0 (FlashAttention varlen stand-in bound since session 4).
# Results: $OUT/r/*.log and one tarball $OUT/s5-call1.tgz.
export OMP_NUM_THREADS=2
source bench/gpu_lib.sh
T0=$(date +%s)
$G --vllm 0.26.0 -- true
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$R/gpu.txt" 2>&1; nproc >> "$R/gpu.txt"
DEADLINE=${DEADLINE:-300}
pids=()
for t in vllm.flashmla_sparse vllm.triton_sparse vllm.flashmla_sparse.layer; do
  ( export ATTNFUZZ_STATE=/tmp/st-diag-$t ATTNFUZZ_SANITIZER_OPTIONS="--show-backtrace yes --print-limit 4000"
    run "initcheck-diag-$t" 200 $A --target $t --sanitizer initcheck --seed 11 --max-examples 5 --no-shrink --reruns 0
    # worker logs, cut to their first 60,000 lines each
    mkdir -p /tmp/diag-logs/$t; for f in /tmp/st-diag-$t/workers/*; do head -60000 "$f" > /tmp/diag-logs/$t/$(basename "$f"); done
  ) & pids+=($!)
done
( run prof-warm 120 $A --target vllm.flashmla_sparse --profile gpu-bench --no-shrink --reruns 0 --seed 1 --max-examples 20
  timeout 150 $G -- python3 -m cProfile -o "$R/prof.out" -m fuzzer.cli --device cuda run --target vllm.flashmla_sparse \
    --profile gpu-bench --no-shrink --reruns 0 --seed 3 --time-budget 60s --isolation none --json "$R/prof-run.json" --quiet \
    > "$R/prof-run.log" 2>&1
  $G -- python3 -c "import pstats,sys; p=pstats.Stats(sys.argv[1]); p.sort_stats('cumulative').print_stats(70); p.sort_stats('tottime').print_stats(40)" \
    "$R/prof.out" > "$R/prof.txt" 2>&1 ) & pids+=($!)
( export ATTNFUZZ_STATE=/tmp/st-A
  run mutant-A-layer 200 $A --target vllm.flashmla_sparse.layer --inject remap-full-batch-req-id --sanitizer auto --no-shrink \
      --max-findings 1 --reruns 1 --seed 5
  f=$(ls -d /tmp/repros-mutant-A-layer/*/ 2>/dev/null | head -1)
  if [ -n "$f" ]; then cp "$f/finding.json" "$R/mutant-A-finding.json"; cp "$f/repro.py" "$R/mutant-A-repro.py"
    timeout 60 $G -- python3 "$f/repro.py" > "$R/mutant-A-repro-plain.log" 2>&1; echo "exit=$?" >> "$R/mutant-A-repro-plain.log"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 $G -- compute-sanitizer --tool memcheck --print-limit 5 python3 "$f/repro.py" \
      > "$R/mutant-A-repro-memcheck.log" 2>&1; echo "exit=$?" >> "$R/mutant-A-repro-memcheck.log"; fi ) & pids+=($!)
( export ATTNFUZZ_STATE=/tmp/st-026
  run v026-layer 150 --vllm 0.26.0 -- $A --target vllm.flashmla_sparse.layer --max-examples 40 --no-shrink --reruns 1 ) & pids+=($!)
( sleep $(( DEADLINE - ($(date +%s) - T0) )); pkill -ABRT -f fuzzer.cli; pkill -f compute-sanitizer ) & watchdog=$!
wait "${pids[@]}"; kill $watchdog 2>/dev/null
echo "all ended at $(( $(date +%s) - T0 )) s" >> "$R/gpu.txt"
tar czf "$R/diag-logs.tgz" -C /tmp diag-logs 2>/dev/null
cd "$R" && tar czf "$OUT/s5-call1.tgz" . 2>/dev/null
for f in gpu.txt initcheck-*.log prof-*.log mutant-A*.log v026*.log; do [ -f "$f" ] && { echo "== $f"; tail -8 "$f"; }; done
head -60 prof.txt
