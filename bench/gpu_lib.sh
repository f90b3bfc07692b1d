# Sourced by the GPU-host session scripts (bench/gpu_s4_*.sh): results dir, vLLM from the bundle, the
# environment every run keeps, and `run NAME LIMIT ARGS...` (one attnfuzz campaign, bounded, short log,
# JSON summary and up to three finding.json files under $R). Only 8 files come back from a call: pack $R.
set -uo pipefail
R=${OUT:-/tmp/out}/r; mkdir -p "$R"
G=scripts/gpu-host.sh
export PYTHONUNBUFFERED=1 ATTNFUZZ_STATE=${ATTNFUZZ_STATE:-/tmp/attnfuzz-state} OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never multicast
A="attnfuzz --device cuda run"
$G -- true  # unpack the bundle once, before jobs start at once
quiet() { grep -v "deep_gemm\|Padding\|^  File\|^    \|Warning\|warn(\|^Failed to import"; }
run() { local name=$1 limit=$2; shift 2
  ( /usr/bin/time -f "%e s wall" timeout -s ABRT "$limit" $G "$@" --json "$R/$name.json" --repros "/tmp/repros-$name" --quiet \
      2>&1 | quiet | tail -14 > "$R/$name.log"; echo "exit=${PIPESTATUS[0]}" >> "$R/$name.log" )
  find "/tmp/repros-$name" -name finding.json -size -1M 2>/dev/null | head -3 | while read -r f; do
    cp "$f" "$R/$name-$(basename "$(dirname "$f")").finding.json"; done; }
