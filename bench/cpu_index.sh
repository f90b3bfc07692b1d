#!/usr/bin/env bash
# CPU figures for the index targets (docs/benchmarks.md): clean campaigns, time to find each mutant, and
# campaigns against older releases (their venvs: scripts/setup-venv.sh .venv-0.26.0 0.26.0).
#   bench/cpu_index.sh [RESULTS_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
R=${1:-docs/results/cpu-$(date +%F)}; mkdir -p "$R"
export ATTNFUZZ_STATE=$(mktemp -d)  # a fresh example database: no replayed failures in the figures
run() { # venv name args...
  local venv=$1 name=$2; shift 2
  "$venv/bin/attnfuzz" run "$@" --json "$R/$name.json" --repros "$R/repros" --quiet > "$R/$name.log" 2>&1
  echo "exit=$?" >> "$R/$name.log"
}
for t in index_remap dcp_filter; do run .venv clean-$t --target vllm.$t --seed 0 --max-examples 500; done
run .venv seed-bug --target vllm.index_remap --inject remap-no-length-check --seed 1 --max-examples 300
for spec in "index_remap remap-count-past-table" "index_remap remap-past-table-not-invalid" \
            "dcp_filter dcp-owner-ignores-interleave" "dcp_filter remap-count-past-table"; do
  set -- $spec; run .venv "m-$1-$2" --target vllm.$1 --inject $2 --seed 0 --max-examples 300
done
for v in 0.23.0 0.26.0; do
  [ -x .venv-$v/bin/attnfuzz ] || continue
  for t in index_remap dcp_filter; do run .venv-$v v$v-$t --target vllm.$t --seed 0 --max-examples 300; done
done
python3 bench/summarize.py "$R"
