#!/usr/bin/env bash
# GPU host: where a backend target's time goes (cProfile of a short campaign per target), plus a smoke run
# of the layer target. Results go to $OUT/results.tgz.
set -uo pipefail
R=${OUT:-/tmp/out}/r; mkdir -p "$R"
trap 'tar czf "${OUT:-/tmp/out}/results.tgz" -C "$R" .' EXIT
G=scripts/gpu-host.sh
export PYTHONUNBUFFERED=1 ATTNFUZZ_STATE=/tmp/attnfuzz-state
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/gpu.txt" 2>&1
for t in ${TARGETS:-vllm.flashmla_sparse vllm.flashmla_sparse.layer}; do
  timeout ${LIMIT:-200} $G -- python3 -m cProfile -o "$R/prof-$t.out" -m fuzzer.cli --device cuda run --target "$t" \
    --max-examples ${N:-60} --repros "$R/repros-$t" --json "$R/$t.json" --quiet > "$R/$t.log" 2>&1
  echo "exit=$?" >> "$R/$t.log"
  $G -- python3 -c "import pstats,sys; p=pstats.Stats(sys.argv[1]); p.sort_stats('cumulative').print_stats(45); p.sort_stats('tottime').print_stats(30)" "$R/prof-$t.out" > "$R/prof-$t.txt" 2>&1
done
