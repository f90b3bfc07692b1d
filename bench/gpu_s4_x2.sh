#!/usr/bin/env bash
# 2-GPU host (nvidia-h200-x2), session 4, one call of at most 10 minutes, everything at once:
#   GPUs 0+1: the collectives check (bench/dcp_collectives_check.py), then DCP with real NCCL ranks, clean and
#             with two DCP mutants;
#   GPU 1:    `attnfuzz gate` (one H200; it must end within 10 minutes);
#   GPU 0:    `attnfuzz selftest`, then the emulated-rank DCP target clean (LSE tolerance 2e-2).
# The machine is shared by all of them, so the gate's wall time is an upper bound of its time alone.
# Results: $OUT/r/*.log and one tarball $OUT/s4-x2.tgz (only 8 files come back from a call).
source bench/gpu_lib.sh  # (the prelude these ran with, moved there after the runs)
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader > "$R/gpus.txt" 2>&1
( # real ranks: the check first, then the campaigns
  ( timeout 120 $G python3 bench/dcp_collectives_check.py 2>&1 | quiet > "$R/collectives.log"; echo "exit=${PIPESTATUS[0]}" >> "$R/collectives.log" )
  run ranks-clean 200 $A --target vllm.flashmla_sparse.dcp.ranks --max-examples 150 --no-shrink
  for m in dcp-lse-base2-as-natural dcp-empty-shard-lse-zero; do
    run "ranks-$m" 90 $A --target vllm.flashmla_sparse.dcp.ranks --inject "$m" --max-examples 60 --reruns 2; done
  for d in /tmp/attnfuzz-state/dcp-ranks/*/; do
    [ -d "$d" ] && quiet < "$d/rank1.log" | tail -6 > "$R/rank1-$(basename "$d").log"; done ) &
( CUDA_VISIBLE_DEVICES=1 OUT=$R/gate timeout 560 bash bench/gpu_gate.sh gate > "$R/gate.txt" 2>&1 ) &
( CUDA_VISIBLE_DEVICES=0 OUT=$R/selftest timeout 470 bash bench/gpu_gate.sh selftest --jobs 3 > "$R/selftest.txt" 2>&1
  CUDA_VISIBLE_DEVICES=0 run dcp-clean 80 $A --target vllm.flashmla_sparse.dcp --max-examples 400 --no-shrink ) &
wait
cd "$R" && tar czf "$OUT/s4-x2.tgz" . 2>/dev/null
for f in gpus.txt collectives.log ranks-*.log rank1-*.log dcp-clean.log; do [ -f "$f" ] && { echo "== $f"; tail -14 "$f"; }; done
echo "== gate"; tail -6 gate.txt; echo "== selftest"; tail -30 selftest.txt
