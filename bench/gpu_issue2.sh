#!/usr/bin/env bash
# One GPU-host session for the index targets: clean campaigns, every mutant, older releases.
# Results (JSON summaries, logs, reproducers) go to $OUT/results.tgz.
#   bench/gpu_issue2.sh [clean] [mutants] [releases] [repros]     (default: all phases)
set -uo pipefail
R=${OUT:-/tmp/out}/r; mkdir -p "$R"
PHASES=${*:-clean mutants releases repros}
trap 'tar czf "${OUT:-/tmp/out}/results.tgz" -C "$R" .' EXIT  # whatever finished comes back
G=scripts/gpu-host.sh
export PYTHONUNBUFFERED=1 ATTNFUZZ_STATE=/tmp/attnfuzz-state
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$R/gpu.txt"
python3 -c "import torch, triton, hypothesis; print(torch.__version__, triton.__version__, hypothesis.__version__)" >> "$R/gpu.txt"
run() { # name, args...
  local name=$1; shift
  ( /usr/bin/time -f "%e s wall" $G "$@" --json "$R/$name.json" --repros "$R/repros-$name" --quiet > "$R/$name.log" 2>&1; echo "exit=$?" >> "$R/$name.log" ) 
}
has() { [[ " $PHASES " == *" $1 "* ]]; }
$G attnfuzz --device cuda list > "$R/list.log" 2>&1
# Clean campaigns first (sequential: they are the throughput figures), then mutants in parallel.
if has clean; then
run clean-index_remap attnfuzz --device cuda run --target vllm.index_remap --seed 0 --max-examples 500
run clean-dcp_filter attnfuzz --device cuda run --target vllm.dcp_filter --seed 0 --max-examples 500
fi
if has mutants; then
run seed-bug attnfuzz --device cuda run --target vllm.index_remap --inject remap-no-length-check --seed 1 --max-examples 300 &
run m-count-remap attnfuzz --device cuda run --target vllm.index_remap --inject remap-count-past-table --max-examples 300 &
run m-pasttable-remap attnfuzz --device cuda run --target vllm.index_remap --inject remap-past-table-not-invalid --max-examples 300 &
run m-dcp-owner attnfuzz --device cuda run --target vllm.dcp_filter --inject dcp-owner-ignores-interleave --max-examples 300 &
wait
fi
if has releases; then
for v in 0.23.0 0.26.0; do
  run v$v-index_remap --vllm $v -- attnfuzz --device cuda run --target vllm.index_remap --seed 0 --max-examples 300 &
done
run v0.26.0-dcp_filter --vllm 0.26.0 -- attnfuzz --device cuda run --target vllm.dcp_filter --seed 0 --max-examples 300 &
wait
fi
# Reproducers found on the GPU, replayed as a stranger would: plain python, from their own folder.
for d in "$R"/repros-*/*/; do
  [ -f "$d/repro.py" ] || continue
  v=$(python3 -c "import json,sys; print(json.load(open('$d/finding.json'))['host']['vllm'])")
  flag=""; [ "$v" != "0.33.0" ] && flag="--vllm $v"
  has repros && (cd "$d" && $OLDPWD/$G $flag -- python3 repro.py > repro.log 2>&1; echo "exit=$?" >> repro.log) &
done
wait
