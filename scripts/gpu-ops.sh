#!/usr/bin/env bash
# vLLM's compiled cache ops (_C_stable_libtorch: concat_and_cache_mla, cp_gather_and_upconvert_fp8_kv_cache,
# gather_and_maybe_dequant_cache, cp_gather_cache, concat_mla_q) on the GPU test host. The ops (61 MB compressed),
# the bundle (33 MB) and the working tree (about 6 MB) do not fit one call's 64 MiB, nor do the ops and the tree
# alone, so `build` splits the compressed ops in two: part a travels alone, part b with the bundle, and
# the second call comes within the ~30 s the machine stays warm:
#
#   here, once:   scripts/gpu-ops.sh build                          (../shared/gpu-host/build-ops.sh -> .gpu-ops)
#   call 1:       carry [".gpu-ops/a"],                 command `bash scripts/gpu-ops.sh stash`
#   call 2:       carry [".gpu-ops/b", ".gpu-bundle"],  command `bash scripts/gpu-ops.sh unpack && bash scripts/gpu-ops.sh check && bash bench/scenario.sh ...`
#   later calls:  carry [".gpu-bundle"],                command `bash scripts/gpu-ops.sh check && ...`
#
# From then on scripts/gpu-host.sh (every scenario run) has vLLM load the real ops, and every result's
# `emulated` list leaves them out. `check` exits 1 when they are not loaded (the machine went back between the
# calls: start again at call 1).
#
# Part b also carries vLLM's vendored DeepGEMM (vllm/third_party/deep_gemm: its stable-ABI extension and the headers
# its JIT compiles against; 6 MB compressed), which the indexer's CUDA route calls; scripts/gpu-host.sh puts it in
# place of the bundle's Python-only copy.
#
#   scripts/gpu-ops.sh build [VLLM_VERSION=0.33.0] | split | stash | unpack | check
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OPS=$ROOT/.gpu-ops
STASH=/tmp/gpu-bundle-ops
XZ=_C_stable_libtorch.abi3.so.xz
deep_gemm_pack() {  # VERSION DEST: vllm/third_party/deep_gemm of that release's wheel, as a tar.xz
  local tmp; tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps "vllm==$1" -d "$tmp/w"
  unzip -q "$tmp"/w/vllm-*.whl 'vllm/third_party/deep_gemm/*' -d "$tmp/x"
  tar cJf "$2" -C "$tmp/x/vllm/third_party" deep_gemm
  rm -rf "$tmp"
}

case ${1:-} in
  build) bash "$ROOT/../shared/gpu-host/build-ops.sh" "$OPS" "${2:-0.33.0}" && "$0" split;;
  split)  # part a: the first 48 MiB; part b: the rest, the checksum of the whole and the version
    rm -rf "$OPS/a" "$OPS/b" && mkdir -p "$OPS/a" "$OPS/b"
    head -c $((48 << 20)) "$OPS/$XZ" > "$OPS/a/$XZ.part-a"
    tail -c +$(((48 << 20) + 1)) "$OPS/$XZ" > "$OPS/b/$XZ.part-b"
    (cd "$OPS" && sha256sum "$XZ") > "$OPS/b/SHA256SUMS"
    cp "$OPS/VERSION" "$OPS/b/"
    deep_gemm_pack "$(cat "$OPS/VERSION")" "$OPS/b/deep_gemm.tar.xz"
    "$0" fa-interface
    du -b "$OPS/a/$XZ.part-a" "$OPS/b/$XZ.part-b" "$OPS/b/deep_gemm.tar.xz";;
  deep-gemm)  # (re)pack DeepGEMM alone into part b
    deep_gemm_pack "$(cat "$OPS/VERSION")" "$OPS/b/deep_gemm.tar.xz" && du -b "$OPS/b/deep_gemm.tar.xz";;
  fa-interface)  # vLLM's vllm_flash_attn/flash_attn_interface.py (pure Python; the bundle leaves the package out), for FA4's target
    "${PYTHON:-$ROOT/.venv/bin/python}" -c "import vllm, os, shutil, sys; assert vllm.__version__ == sys.argv[1], vllm.__version__; shutil.copy(os.path.join(os.path.dirname(vllm.__file__), 'vllm_flash_attn', 'flash_attn_interface.py'), sys.argv[2])" "$(cat "$OPS/VERSION")" "$OPS/b/flash_attn_interface.py";;
  stash)  # call 1, on the GPU host
    mkdir -p "$STASH" && cp "$OPS/a/$XZ.part-a" "$STASH/"
    echo "gpu-ops: part a stashed in $STASH ($(du -b "$STASH/$XZ.part-a" | cut -f1) bytes)";;
  unpack)  # call 2, on the GPU host: part a from the stash, part b carried
    if [ ! -f "$STASH/$XZ.part-a" ]; then
      echo "gpu-ops: part a is not stashed (the machine went back after call 1): start again at call 1" >&2; exit 1
    fi
    cat "$STASH/$XZ.part-a" "$OPS/b/$XZ.part-b" > "$STASH/$XZ"
    (cd "$STASH" && sha256sum -c "$OPS/b/SHA256SUMS" >/dev/null) || { echo "gpu-ops: checksum mismatch" >&2; exit 1; }
    xz -dc "$STASH/$XZ" > "$STASH/_C_stable_libtorch.abi3.so" && rm -f "$STASH/$XZ" "$STASH/$XZ.part-a"
    cp "$OPS/b/VERSION" "$STASH/"
    [ ! -f "$OPS/b/deep_gemm.tar.xz" ] || cp "$OPS/b/deep_gemm.tar.xz" "$STASH/"
    [ ! -f "$OPS/b/flash_attn_interface.py" ] || cp "$OPS/b/flash_attn_interface.py" "$STASH/"
    echo "gpu-ops: ops for vLLM $(cat "$STASH/VERSION") unpacked in $STASH";;
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
  *) echo "usage: scripts/gpu-ops.sh build [VERSION] | split | deep-gemm | stash | unpack | check" >&2; exit 2;;
esac
