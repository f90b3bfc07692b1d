#!/usr/bin/env bash
# vLLM's compiled cache ops (_C_stable_libtorch: concat_and_cache_mla, cp_gather_and_upconvert_fp8_kv_cache,
# gather_and_maybe_dequant_cache, cp_gather_cache, concat_mla_q) on the GPU test host. They and the bundle do not
# fit one call (64 MiB: the ops 61 MB compressed, the bundle 33 MB), so it takes two, the second within the
# ~30 s the machine stays warm:
#
#   here, once:   scripts/gpu-ops.sh build                          (../shared/gpu-host/build-ops.sh -> .gpu-ops)
#   call 1:       carry [".gpu-ops"],    command `bash scripts/gpu-ops.sh unpack`
#   call 2 on:    carry [".gpu-bundle"], command `bash scripts/gpu-ops.sh check && bash bench/scenario.sh ...`
#
# From then on scripts/gpu-host.sh (every scenario run) has vLLM load the real ops, and every result's
# `emulated` list leaves them out. `check` exits 1 when they are not loaded (the machine went back between the
# calls: start again at call 1).
#
#   scripts/gpu-ops.sh build [VLLM_VERSION=0.33.0] | unpack | check
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
case ${1:-} in
  build) bash "$ROOT/../shared/gpu-host/build-ops.sh" "$ROOT/.gpu-ops" "${2:-0.33.0}";;
  unpack) bash "$ROOT/.gpu-ops/unpack-ops.sh";;
  check)
    "$ROOT/scripts/gpu-host.sh" python3 -c "
import torch, vllm.platforms.cuda  # noqa: F401  (cuda.py imports _C_stable_libtorch)
names = ('concat_and_cache_mla', 'cp_gather_and_upconvert_fp8_kv_cache', 'gather_and_maybe_dequant_cache',
         'cp_gather_cache', 'concat_mla_q')
def has(name):
    try:
        getattr(torch.ops._C_cache_ops, name)
        return True
    except (AttributeError, RuntimeError):
        return False
missing = [n for n in names if not has(n)]
print('gpu-ops: vLLM cache ops', 'missing: ' + ', '.join(missing) if missing else 'loaded: ' + ', '.join(names))
raise SystemExit(1 if missing else 0)" 2>&1 | grep '^gpu-ops:'
    exit "${PIPESTATUS[0]}";;
  *) echo "usage: scripts/gpu-ops.sh build [VERSION] | unpack | check" >&2; exit 2;;
esac
