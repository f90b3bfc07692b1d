#!/usr/bin/env bash
# Kernels the GPU bundle leaves out, brought to the GPU test host on demand, each a pack of its own:
#
#   fa3      vLLM 0.33.0's own vllm_flash_attn package with its compiled FA3 extension (_vllm_fa3_C.abi3.so,
#            172.6 MB, torch's stable ABI only, so it loads on the host's torch 2.11; 11.6 MB as tar.xz). FA2's
#            extension (308 MB) stays behind: vllm_flash_attn imports either. FLASH_ATTN_MLA_SPARSE then runs FA3's
#            sparse kernel instead of attnfuzz's stand-in (vllm.flashattn_sparse and its layer target name which).
#   cutedsl  the CuTe-DSL stack vLLM 0.33.0 pins (nvidia-cutlass-dsl[cu13] 4.8.0 with its libs-base, libs-core and
#            libs-cu13 wheels, quack-kernels 0.6.5): 250 MB unpacked, 66 MB as tar.xz, so two parts in two calls.
#            With `cutlass` importable, vLLM's DeepSeek-V4 code takes its CuTe-DSL kernels
#            (models/deepseek_v4/nvidia/ops/*_cutedsl.py: the K-cache dequant-gather on the prefill route) where
#            it would take the Triton ones.
#
# Either is used only by runs that ask (scripts/gpu-host.sh): ATTNFUZZ_FA3=real, ATTNFUZZ_CUTEDSL=real; both change
# what vLLM picks elsewhere, so a run without them sees the host as before.
#
#   here, once:   scripts/gpu-kernels.sh build fa3|cutedsl        (from .venv's vLLM, and pip downloads)
#   call N:       carry [".gpu-cutedsl/p1"]              bash scripts/gpu-kernels.sh stash cutedsl
#   call N+1:     carry [".gpu-cutedsl/p2", ".gpu-fa3"]  bash scripts/gpu-kernels.sh install cutedsl && bash scripts/gpu-kernels.sh install fa3 && ...
#                 (a pack whose parts all travel in one call installs at once). The bundle must have been carried
#                 in an earlier call of the same machine (scripts/gpu-host.sh keeps it in /tmp/gpu-bundle).
#   then:         bash scripts/gpu-kernels.sh check fa3|cutedsl    (exit 0 usable, 1 broken, 2 not installed)
#
#   scripts/gpu-kernels.sh build NAME | split NAME | sizes | stash NAME | install NAME | check NAME | dir NAME
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
HOST=${GPU_KERNELS_HOST:-/tmp/gpu-kernels}
PACKS=${GPU_KERNELS_PACKS:-$ROOT}  # where .gpu-NAME lives (another folder only to try the travel out: tests/)
PY=${PYTHON:-$ROOT/.venv/bin/python}
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform any)
CUTEDSL_WHEELS=("nvidia-cutlass-dsl==4.8.0" "nvidia-cutlass-dsl-libs-base==4.8.0" "nvidia-cutlass-dsl-libs-core==4.8.0"
                "nvidia-cutlass-dsl-libs-cu13==4.8.0" "quack-kernels==0.6.5")
usage() { echo "usage: scripts/gpu-kernels.sh build NAME | split NAME | sizes | stash NAME | install NAME | check NAME | dir NAME  (NAME: fa3, cutedsl)" >&2; exit 2; }
parts_of() { case $1 in fa3) echo 1;; cutedsl) echo 2;; esac; }  # cutedsl's 69.6 MB do not fit one call
pack_name() { case ${1:-} in fa3|cutedsl) echo "$1";; *) usage;; esac; }

split_pack() {  # $1 pack dir, $2 tarball, $3 parts: equal cuts into p1..pN, the checksum and version in the last
  local dir=$1 tar=$2 n=$3 size each i
  rm -rf "$dir"/p[0-9]*
  size=$(stat -c %s "$dir/$tar"); each=$(((size + n - 1) / n))
  for i in $(seq 1 "$n"); do
    mkdir -p "$dir/p$i"
    dd if="$dir/$tar" of="$dir/p$i/$tar.part-$i" iflag=skip_bytes,count_bytes skip=$(((i - 1) * each)) count="$each" bs=1M status=none
  done
  (cd "$dir" && sha256sum "$tar") > "$dir/p$n/SHA256SUMS"
  printf '%s\n' "$n" > "$dir/p$n/PARTS"
  cp "$dir/VERSION" "$dir/p$n/"
  du -b "$dir/$tar" "$dir"/p*/*.part-*
}

case ${1:-} in
  build)
    NAME=$(pack_name "${2:-}")
    DIR=$PACKS/.gpu-$NAME TMP=$(mktemp -d)
    trap 'rm -rf "$TMP"' EXIT
    mkdir -p "$DIR"
    if [ "$NAME" = fa3 ]; then
      FA=$("$PY" -c "import importlib.util as u; print(u.find_spec('vllm').submodule_search_locations[0])")/vllm_flash_attn
      VER=$("$PY" -c "import importlib.metadata as m; print(m.version('vllm'))")
      [ -f "$FA/_vllm_fa3_C.abi3.so" ] || { echo "gpu-kernels: no FA3 extension in $FA" >&2; exit 1; }
      (cd "$(dirname "$FA")" && tar cf - --owner=0 --group=0 --sort=name --exclude=__pycache__ \
        --exclude='_vllm_fa2_C*' vllm_flash_attn) | xz -6 -T2 > "$DIR/$NAME.tar.xz"
      echo "vllm $VER" > "$DIR/VERSION"
      split_pack "$DIR" "$NAME.tar.xz" "$(parts_of "$NAME")"
    else
      mkdir -p "$DIR/dl"
      "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
        -d "$DIR/dl" "${CUTEDSL_WHEELS[@]}"
      # Unzipped, not pip-installed: the wheels are the host's cp312, which this Python may not be (none has a .data).
      mkdir -p "$TMP/site" && for w in "$DIR"/dl/*.whl; do unzip -q -o "$w" -d "$TMP/site"; done
      # The meta wheel's .pth puts dsl_packages on sys.path at start-up; a --target folder's .pth files are never
      # read, so gpu-host.sh names that folder on PYTHONPATH itself.
      (cd "$TMP/site" && tar cf - --owner=0 --group=0 --sort=name --exclude=__pycache__ .) | xz -6 -T2 > "$DIR/$NAME.tar.xz"
      printf '%s\n' "${CUTEDSL_WHEELS[*]}" > "$DIR/VERSION"
      split_pack "$DIR" "$NAME.tar.xz" "$(parts_of "$NAME")"
    fi;;
  split)  # again, from .gpu-NAME/NAME.tar.xz and VERSION
    NAME=$(pack_name "${2:-}")
    split_pack "$PACKS/.gpu-$NAME" "$NAME.tar.xz" "$(parts_of "$NAME")";;
  sizes)  # what each call carries, against the 64 MiB limit
    tree=$(cd "$ROOT" && git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
    for d in .gpu-fa3/p1 .gpu-cutedsl/p1 .gpu-cutedsl/p2; do
      [ -e "$ROOT/$d" ] || { echo "$d: missing (build first)"; continue; }
      t=$((tree + $(du -sbL "$ROOT/$d" | cut -f1))); echo "[$d] with the working tree: $t bytes ($((t * 100 / (64 << 20)))% of 64 MiB)"
    done;;
  stash|install)
    NAME=$(pack_name "${2:-}")
    DIR=$PACKS/.gpu-$NAME PARTS=$HOST/$NAME/parts TAR=$NAME.tar.xz
    mkdir -p "$PARTS"
    for d in "$DIR"/p*/; do [ -d "$d" ] && cp "$d"* "$PARTS/"; done
    if [ "$1" = stash ]; then echo "gpu-kernels: $NAME stashed in $PARTS: $(ls "$PARTS" | tr '\n' ' ')"; exit 0; fi
    if [ ! -f "$PARTS/SHA256SUMS" ]; then
      if [ -f "$HOST/$NAME/.ready" ]; then echo "gpu-kernels: $NAME already installed"; exit 0; fi
      echo "gpu-kernels: $NAME's last part (with SHA256SUMS) not carried" >&2; exit 1
    fi
    n=$(cat "$PARTS/PARTS") sum=$(cut -d' ' -f1 "$PARTS/SHA256SUMS")
    if [ -f "$HOST/$NAME/.ready" ] && [ "$(cat "$HOST/$NAME/.ready")" = "$sum" ]; then echo "gpu-kernels: $NAME already installed"; exit 0; fi
    for i in $(seq 1 "$n"); do
      [ -f "$PARTS/$TAR.part-$i" ] || { echo "gpu-kernels: $NAME part $i of $n missing in $PARTS (the machine went back after it was stashed: start again)" >&2; exit 1; }
    done
    for i in $(seq 1 "$n"); do cat "$PARTS/$TAR.part-$i"; done > "$HOST/$NAME/$TAR"
    (cd "$HOST/$NAME" && sha256sum -c "$PARTS/SHA256SUMS" >/dev/null) || { echo "gpu-kernels: $NAME checksum mismatch" >&2; exit 1; }
    rm -rf "$HOST/$NAME/site" && mkdir -p "$HOST/$NAME/site"
    tar xJf "$HOST/$NAME/$TAR" -C "$HOST/$NAME/site" && rm -f "$HOST/$NAME/$TAR" "$PARTS"/*.part-*
    echo "$sum" > "$HOST/$NAME/.ready"
    echo "gpu-kernels: $NAME ($(cat "$PARTS/VERSION")) installed in $HOST/$NAME/site ($(du -sm "$HOST/$NAME/site" | cut -f1) MB)";;
  check)
    NAME=$(pack_name "${2:-}")
    [ -f "$HOST/$NAME/.ready" ] || { echo "gpu-kernels: $NAME not installed" >&2; exit 2; }
    if [ "$NAME" = fa3 ]; then
      ATTNFUZZ_FA3=real "$ROOT/scripts/gpu-host.sh" python3 "$ROOT/bench/fa3_check.py" "${@:3}"
    else
      ATTNFUZZ_CUTEDSL=real "$ROOT/scripts/gpu-host.sh" python3 "$ROOT/bench/cutedsl_check.py" "${@:3}"
    fi;;
  dir) echo "$HOST/$(pack_name "${2:-}")";;
  *) usage;;
esac
