#!/usr/bin/env bash
# 2-GPU host (nvidia-h200-x2), session 3: DCP with real ranks (one process per GPU, NCCL, vLLM's DCP group),
# clean and with two DCP mutants; the emulated-rank target clean again; and the nightly fleet
# (bench/gpu_fleet.sh: 2 workers, one shared example database) alongside. Results: $OUT/r.
set -uo pipefail
R=${OUT:-/tmp/out}/r; mkdir -p "$R"
G=scripts/gpu-host.sh
export PYTHONUNBUFFERED=1 ATTNFUZZ_STATE=/tmp/attnfuzz-state OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never multicast
$G -- true
run() { local name=$1 limit=$2; shift 2
  ( /usr/bin/time -f "%e s wall" timeout -s ABRT "$limit" $G "$@" --json "$R/$name.json" --repros "/tmp/repros-$name" --quiet \
      2>&1 | grep -v "deep_gemm\|Padding\|^  File\|^    \|Warning\|warn(" | tail -10 > "$R/$name.log"; echo "exit=${PIPESTATUS[0]}" >> "$R/$name.log" ) }
A="attnfuzz --device cuda run"
( run ranks-clean 200 $A --target vllm.flashmla_sparse.dcp.ranks --max-examples 150
  for m in dcp-lse-base2-as-natural dcp-owner-ignores-interleave; do
    run "ranks-$m" 90 $A --target vllm.flashmla_sparse.dcp.ranks --inject "$m" --max-examples 60 --reruns 2; done ) &
( CUDA_VISIBLE_DEVICES=0 run dcp-clean 150 $A --target vllm.flashmla_sparse.dcp --max-examples 300 ) &
( OUT=$R/fleet FLEET_LIMIT=150 FLEET_EXAMPLES=100 bash bench/gpu_fleet.sh > "$R/fleet.txt" 2>&1 ) &
wait
for d in /tmp/attnfuzz-state/dcp-ranks/*/; do [ -d "$d" ] && grep -v "deep_gemm\|Warning\|warn(" "$d"/rank1.log | tail -4 > "$R/rank1-$(basename "$d").log"; done
cd "$R" && tar czf summary.tgz *.log *.txt fleet 2>/dev/null; for f in *.log fleet.txt; do echo "== $f"; tail -5 "$f"; done
