#!/usr/bin/env bash
# 2-GPU host (nvidia-h200-x2): a nightly-style fleet, one campaign per GPU on one shared example database.
# Run 1 (seeds 0, 1) finds the injected bug on both GPUs: one repro per signature, the duplicate merged.
# Run 2 (seeds 100, 101, same database) replays the stored failure on each worker's first case: counted as
# already saved, not saved again. Results: $OUT/r (merged JSON summaries and short logs; no tensors).
set -uo pipefail
R=${OUT:-/tmp/out}/r; mkdir -p "$R"
G=scripts/gpu-host.sh
D=/tmp/attnfuzz-fleet  # the database, the repros and the workers' state: outside $OUT (tensors stay here)
rm -rf "$D"; mkdir -p "$D"
export PYTHONUNBUFFERED=1 ATTNFUZZ_STATE=$D/state OMP_NUM_THREADS=4
$G -- true
nvidia-smi --query-gpu=index,name --format=csv,noheader > "$R/gpus.txt" 2>&1
fleet() { local name=$1; shift
  ( /usr/bin/time -f "%e s wall" timeout -s TERM ${FLEET_LIMIT:-280} $G attnfuzz --device cuda run --target vllm.flashmla_sparse \
      --inject flashmla-topk-length-dropped --workers auto --db "$D/db" --repros "$D/repros" --max-examples ${FLEET_EXAMPLES:-200} \
      --no-shrink --reruns 1 --json "$R/$name.json" "$@" > "$R/$name.log" 2>&1; echo "exit=$?" >> "$R/$name.log" )
  for w in "$D"/state/fleet/vllm.flashmla_sparse/w*; do
    grep -v "^  File\|^    " "$w/run.log" | tail -8 > "$R/$name-$(basename "$w").log"; done
  python3 - "$R/$name.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"{sys.argv[1]}: {s['examples']} cases in {s['seconds']} s ({s['cases_per_second']}/s), "
      f"{s['duplicates_merged']} duplicate(s) merged")
for w in s["workers"]:
    print(f"  worker {w['worker']}: seed {w['seed']}, GPU {w['gpu']}, exit {w['exit']}, {w['examples']} cases")
for kind in ("findings", "known", "pending"):
    for f in s[kind]:
        print(f"  {kind}: {f['signature']} (id {f['id']}) by worker(s) {f['workers']}, first after "
              f"{f['examples_to_find']} case(s)" + (f", saved as {f['saved_as']['id']}" if kind == "known" else ""))
EOF
}
fleet run1 --seed 0
fleet run2 --seed 100
ls "$D/repros" > "$R/repros.txt"; ls "$D/db/attnfuzz-signatures" > "$R/signatures.txt"
