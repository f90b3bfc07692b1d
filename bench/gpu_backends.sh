#!/usr/bin/env bash
# GPU-host session for the whole-backend targets: a clean campaign, each mutant, the reproducers replayed.
# Results go to $OUT/results.tgz.
set -uo pipefail
R=${OUT:-/tmp/out}/r; mkdir -p "$R"
trap 'tar czf "${OUT:-/tmp/out}/results.tgz" -C "$R" .' EXIT
G=scripts/gpu-host.sh
export PYTHONUNBUFFERED=1 ATTNFUZZ_STATE=/tmp/attnfuzz-state
run() { local name=$1; shift
  ( /usr/bin/time -f "%e s wall" timeout 420 $G "$@" --json "$R/$name.json" --repros "$R/repros-$name" --quiet > "$R/$name.log" 2>&1; echo "exit=$?" >> "$R/$name.log" ); }
run clean-triton_sparse attnfuzz --device cuda run --target vllm.triton_sparse --seed 0 --max-examples 300 &
run m-triton_sparse-masked-tile attnfuzz --device cuda run --target vllm.triton_sparse --inject softmax-masked-tile-nan --max-examples 100 &
wait
for d in "$R"/repros-*/*/; do
  [ -f "$d/repro.py" ] && (cd "$d" && $OLDPWD/$G -- python3 repro.py > repro.log 2>&1; echo "exit=$?" >> repro.log) &
done
wait
