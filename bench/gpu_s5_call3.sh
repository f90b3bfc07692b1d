#!/usr/bin/env bash
# One H200, session 5's third call, on the machine the second call left warm (its .gpu-bundle stays there):
# this call carries only .gpu-extra/so-0.23.0/_C.abi3.so (0.23.0's vllm._C, 43 MB, too large to travel with
# the bundle), so that 0.23.0's FlashMLA module imports on the GPU host. All at once (about 3 minutes):
#   the FlashMLA sparse backend target on 0.23.0, per kv-cache dtype; the layer target and the Triton
#   sparse backend target on 0.23.0.
# Results: $OUT/r/* and one tarball $OUT/s5-call3.tgz.
export OMP_NUM_THREADS=2
source bench/gpu_lib.sh
trap 'cd "$R" && tar czf "$OUT/s5-call3.tgz" . 2>/dev/null' EXIT
ls -la .gpu-bundle .gpu-extra/so-0.23.0 > "$R/carried.txt" 2>&1
$G --vllm 0.23.0 -- python3 -c "import vllm._C, vllm; print('vllm', vllm.__version__, 'vllm._C loaded')" > "$R/v023-import.log" 2>&1
echo "exit=$?" >> "$R/v023-import.log"
pids=()
for d in bfloat16 fp8_ds_mla; do
  ( export ATTNFUZZ_STATE=/tmp/st-023-$d
    run v023-flashmla-$d 170 --vllm 0.23.0 -- $A --target vllm.flashmla_sparse --kv-cache-dtype $d \
        --time-budget 120s --no-shrink --reruns 1 ) & pids+=($!)
done
( export ATTNFUZZ_STATE=/tmp/st-023-layer
  run v023-layer 170 --vllm 0.23.0 -- $A --target vllm.flashmla_sparse.layer --time-budget 120s \
      --no-shrink --reruns 1 ) & pids+=($!)
( export ATTNFUZZ_STATE=/tmp/st-023-triton
  run v023-triton 170 --vllm 0.23.0 -- $A --target vllm.triton_sparse --time-budget 120s \
      --no-shrink --reruns 1 ) & pids+=($!)
wait "${pids[@]}"
cd "$R"; for f in v023*.log; do echo "== $f"; tail -8 "$f"; done
