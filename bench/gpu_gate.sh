#!/usr/bin/env bash
# GPU host (session 3): `attnfuzz gate` (must end within 10 minutes on one H200) or `attnfuzz selftest`, with
# vLLM from the bundle. Results (JUnit, JSON, log, wall time) under $OUT/r.
#
#   bench/gpu_gate.sh gate|selftest [extra options for the command]
set -uo pipefail
R=${OUT:-/tmp/out}/r; mkdir -p "$R"
G=scripts/gpu-host.sh
export PYTHONUNBUFFERED=1 ATTNFUZZ_STATE=/tmp/attnfuzz-state
what=${1:?gate or selftest}; shift
$G -- true  # unpack the bundle before anything is timed
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$R/gpu.txt" 2>&1
/usr/bin/time -f "%e s wall" $G -- attnfuzz --device cuda "$what" --junit "$R/$what-gpu.xml" --json "$R/$what-gpu.json" \
  --out "/tmp/$what" "$@" > "$R/$what-gpu.log" 2>&1
echo "exit=$?" >> "$R/$what-gpu.log"
# The campaigns' summaries and short logs (not their state directories).
( cd "/tmp/$what" && find . \( -name summary.json -o -name '*.log' -o -name log.txt \) -size -2M -print0 |
  tar czf "$R/$what-campaigns.tgz" --null -T - ) 2>/dev/null
grep -v "deep_gemm\|^Failed to import" "$R/$what-gpu.log" | tail -40
