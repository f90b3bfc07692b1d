#!/usr/bin/env bash
# GPU host (session 3, issue 5 and the rest of issue 4): DCP on the GPU. Emulated ranks (one process, real
# FlashMLA kernels) clean and with each DCP mutant; real ranks (one process per GPU over NCCL) when the host has
# two or more GPUs; vLLM's DCP LSE correction for sizes 2-8 compiled; a clean initcheck campaign.
# Results: $OUT/r (JSON and short logs only).
set -uo pipefail
R=${OUT:-/tmp/out}/r; mkdir -p "$R"
G=scripts/gpu-host.sh
export PYTHONUNBUFFERED=1 ATTNFUZZ_STATE=/tmp/attnfuzz-state OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never multicast
$G -- true
nvidia-smi --query-gpu=index,name --format=csv,noheader > "$R/gpus.txt" 2>&1
NGPU=$(nvidia-smi -L | wc -l)
run() { local name=$1 limit=$2; shift 2
  ( /usr/bin/time -f "%e s wall" timeout -s ABRT "$limit" $G "$@" --json "$R/$name.json" --repros "/tmp/repros-$name" --quiet \
      2>&1 | grep -v "deep_gemm\|Padding\|^  File\|^    \|Warning\|warn(" | tail -12 > "$R/$name.log"; echo "exit=${PIPESTATUS[0]}" >> "$R/$name.log" ) }
A="attnfuzz --device cuda run"
$G python3 bench/dcp_world3.py 2>&1 | grep "DCP size" > "$R/dcp-world-sizes.txt"
run dcp-clean 330 $A --target vllm.flashmla_sparse.dcp --max-examples 300 --profile gpu &
( for m in dcp-empty-shard-lse-zero dcp-lse-base2-as-natural dcp-owner-ignores-interleave; do
    run "dcp-$m" 110 $A --target vllm.flashmla_sparse.dcp --inject "$m" --max-examples 100 --reruns 2; done ) &
if [ "$NGPU" -ge 2 ]; then
  ( run ranks-clean 220 $A --target vllm.flashmla_sparse.dcp.ranks --max-examples 200
    for m in dcp-lse-base2-as-natural dcp-owner-ignores-interleave; do
      run "ranks-$m" 100 $A --target vllm.flashmla_sparse.dcp.ranks --inject "$m" --max-examples 60 --reruns 2; done ) &
fi
run initcheck-flashmla 480 $A --target vllm.flashmla_sparse --sanitizer initcheck --max-examples 200 --reruns 0 &
wait
for d in /tmp/attnfuzz-state/dcp-ranks/*/; do [ -d "$d" ] && tail -5 "$d"/rank1.log > "$R/ranks-$(basename "$d")-rank1.log"; done
for f in "$R"/*.log "$R"/*.txt; do echo "== $f"; tail -6 "$f"; done
