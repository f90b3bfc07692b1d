#!/usr/bin/env bash
# Render a committed finding's reproducer again (after attnfuzz's support code or renderer changed), on the
# release it was found on: replays it there and, where it still fails, writes repro.py, attnfuzz_support.py and
# tensors.safetensors over the old ones (finding.json, case.json and report.md stay as recorded).
#
#   scripts/rerender-repro.sh repros/<id> [VENV=.venv-<its release>, or .venv for 0.33.0]
set -euo pipefail
dir=${1:?usage: scripts/rerender-repro.sh repros/<id> [venv]}
id=$(basename "$dir")
release=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['host']['vllm'])" "$dir/finding.json")
venv=${2:-$( [ "$release" = 0.33.0 ] && echo .venv || echo ".venv-$release" )}
out=$(mktemp -d)
OMP_NUM_THREADS=1 "$venv/bin/attnfuzz" replay "$dir" --save-repro "$out" | tail -2 || true  # exit 1: it still fails, as it must here
new=$(ls "$out")
[ -f "$out/$new/repro.py" ] || { echo "rerender-repro: $id no longer fails on vLLM $release: nothing written"; exit 1; }
for f in repro.py attnfuzz_support.py; do
  rm -f "$dir/$f"
  [ -f "$out/$new/$f" ] && sed "s/$new/$id/g" "$out/$new/$f" > "$dir/$f"
done
rm -f "$dir/tensors.safetensors"
[ -f "$out/$new/tensors.safetensors" ] && cp "$out/$new/tensors.safetensors" "$dir/"
rm -rf "$out"
wc -l "$dir"/*.py
