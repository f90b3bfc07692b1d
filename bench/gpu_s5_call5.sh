#!/usr/bin/env bash
# One H200, session 5's fifth call (about 2.5 minutes, the device time left): campaigns with the caching
# allocator's free memory poisoned (ATTNFUZZ_POISON_ALLOCATOR=1), so that what vLLM or FlashMLA allocates and
# never writes reads as NaN natively (what initcheck reported in calls 2 and 4), and the poisoning's GPU test.
# Also seed bug A's GPU reproducer: the finding a CPU campaign made (layer target, remap-full-batch-req-id,
# carried in .gpu-extra/seedA) replayed here with --save-repro, and that repro.py run plainly and under memcheck.
# Results: $OUT/r/* and one tarball $OUT/s5-call5.tgz.
export OMP_NUM_THREADS=2
source bench/gpu_lib.sh
trap 'cd "$R" && tar czf "$OUT/s5-call5.tgz" . 2>/dev/null' EXIT
export ATTNFUZZ_POISON_ALLOCATOR=1
pids=()
# When this call ran, the next line lacked ATTNFUZZ_TEST_DEVICE=cuda and the test was skipped (added since).
( ATTNFUZZ_TEST_DEVICE=cuda timeout 100 $G -- python3 -m pytest -q tests/gpu/test_poison_gpu.py > "$R/pytest-poison.log" 2>&1; echo "exit=$?" >> "$R/pytest-poison.log" ) & pids+=($!)
for d in bfloat16 fp8_ds_mla; do
  ( export ATTNFUZZ_STATE=/tmp/st-p-$d
    run poisoned-flashmla-$d 140 $A --target vllm.flashmla_sparse --kv-cache-dtype $d --max-examples 60 --no-shrink --reruns 1 ) & pids+=($!)
done
( export ATTNFUZZ_STATE=/tmp/st-p-triton
  run poisoned-triton 140 $A --target vllm.triton_sparse --max-examples 40 --no-shrink --reruns 1 ) & pids+=($!)
( export ATTNFUZZ_STATE=/tmp/st-p-layer
  run poisoned-layer 140 $A --target vllm.flashmla_sparse.layer --max-examples 30 --no-shrink --reruns 1 ) & pids+=($!)
( unset ATTNFUZZ_POISON_ALLOCATOR; export ATTNFUZZ_STATE=/tmp/st-A
  timeout 60 $G -- attnfuzz --device cuda replay .gpu-extra/seedA/layer-2272ce00 --save-repro /tmp/A-gpu > "$R/A-replay.log" 2>&1
  echo "exit=$?" >> "$R/A-replay.log"
  f=$(ls -d /tmp/A-gpu/*/ 2>/dev/null | head -1)
  if [ -n "$f" ]; then cp "$f/repro.py" "$R/A-gpu-repro.py"
    timeout 40 $G -- python3 "$f/repro.py" > "$R/A-repro-plain.log" 2>&1; echo "exit=$?" >> "$R/A-repro-plain.log"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 100 $G -- compute-sanitizer --tool memcheck --print-limit 5 python3 "$f/repro.py" \
      > "$R/A-repro-memcheck.log" 2>&1; echo "exit=$?" >> "$R/A-repro-memcheck.log"; fi ) & pids+=($!)
wait "${pids[@]}"
cd "$R"; for f in pytest-poison.log poisoned-*.log A-*.log; do echo "== $f"; tail -9 "$f"; done
