#!/usr/bin/env bash
# 2-GPU host (nvidia-h200-x2), session 4, second call, everything at once (about 9 minutes):
#   GPUs 0+1: the collectives check with PyNccl enabled as the real-rank target enables it, then DCP with real
#             NCCL ranks, clean and with two DCP mutants;
#   GPU 0:    `attnfuzz selftest` (mutant campaigns stop at their first finding);
#   GPU 1:    a clean initcheck campaign (2 sanitized workers on the one GPU, one shared example database),
#             then a clean memcheck campaign (1 worker), then the emulated-rank DCP target clean.
# The machine is shared by all of them: rates are lower bounds of a machine alone.
# Results: $OUT/r/*.log and one tarball $OUT/s4-x2b.tgz (only 8 files come back from a call).
source bench/gpu_lib.sh  # (the prelude these ran with, moved there after the runs)
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader > "$R/gpus.txt" 2>&1
$G -- compute-sanitizer --version >> "$R/gpus.txt" 2>&1
( # real ranks: the check first, then the campaigns
  ( timeout 100 $G python3 bench/dcp_collectives_check.py --enable-pynccl 2>&1 | quiet > "$R/collectives.log"
    echo "exit=${PIPESTATUS[0]}" >> "$R/collectives.log" )
  run ranks-clean 220 $A --target vllm.flashmla_sparse.dcp.ranks --time-budget 150s --no-shrink
  for m in dcp-lse-base2-as-natural dcp-empty-shard-lse-zero; do
    run "ranks-$m" 100 $A --target vllm.flashmla_sparse.dcp.ranks --inject "$m" --max-examples 40 --reruns 2 --max-findings 1; done
  for d in /tmp/attnfuzz-state/dcp-ranks/*/; do
    [ -d "$d" ] && quiet < "$d/rank1.log" | tail -6 > "$R/rank1-$(basename "$d").log"; done ) &
( CUDA_VISIBLE_DEVICES=0 OUT=$R/selftest timeout 550 bash bench/gpu_gate.sh selftest --jobs 4 > "$R/selftest.txt" 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  run initcheck-2w 370 $A --target vllm.flashmla_sparse --sanitizer initcheck --workers 2 --db /tmp/initcheck-db \
      --seed 11 --time-budget 280s --no-shrink
  run memcheck 90 $A --target vllm.flashmla_sparse --sanitizer memcheck --seed 7 --time-budget 60s --no-shrink
  run dcp-clean 70 $A --target vllm.flashmla_sparse.dcp --time-budget 40s --no-shrink ) &
wait
cp -r /tmp/attnfuzz-state/fleet "$R/fleet-state-logs" 2>/dev/null; find "$R/fleet-state-logs" -type f ! -name '*.log' ! -name '*.json' -delete 2>/dev/null
cd "$R" && tar czf "$OUT/s4-x2b.tgz" . 2>/dev/null
for f in gpus.txt collectives.log ranks-*.log initcheck-2w.log memcheck.log dcp-clean.log; do [ -f "$f" ] && { echo "== $f"; tail -12 "$f"; }; done
echo "== selftest"; tail -34 selftest.txt
