#!/usr/bin/env bash
# Runs a scenario: a named list of bounded runs (bench/scenarios/NAME), on the GPU host through
# scripts/gpu-host.sh or on a CPU through a venv, and collects what each run leaves in one results folder.
#
#   bench/scenario.sh [--device cpu|cuda] [--jobs N] [--deadline S] [--work DIR] [--pack DIR] SCENARIO [RUN...]
#
#   SCENARIO     a file name under bench/scenarios/ (or a path)
#   RUN...       only the runs whose names match these shell patterns (`v023-*`)
#   --device     default: cuda where nvidia-smi and the GPU bundle (carried, or kept from an earlier call) exist, else cpu
#   --jobs N     runs at a time, started in file order (default 1: a figure is measured alone on the machine)
#   --deadline S no run starts after S seconds, and a run's limit is cut to what is left (a device call has
#                a limit of its own, and what was not packed by then is lost)
#   --dry-run    print each run's command (placeholders of findings left as they are), run nothing
#   --work DIR   where the runs write (default /tmp/attnfuzz-scenario/SCENARIO, emptied first)
#   --pack DIR   where SCENARIO.tgz (the results folder) and SCENARIO.md (its summary) go; default $OUT when
#                set: the GPU host returns at most 8 files from $OUT, so the results travel as one tarball
#
# A scenario file holds one run a line (`#` starts a comment line):
#
#   NAME  LIMIT_S  [VAR=VALUE ...]  COMMAND [ARG ...]
#
# VAR=VALUE sets the run's environment; VLLM=0.26.0 runs it against that release (scripts/gpu-host.sh --vllm
# on the GPU host, .venv-0.26.0 on a CPU). Arguments are split as xargs splits them (quotes group, nothing is
# expanded) with three substitutions: {work} (the work folder), {log:RUN} (RUN's whole output) and
# {finding:RUN} (the first finding RUN saved; the run is skipped when there is none). COMMAND `attnfuzz SUB`
# gets `--device`; `attnfuzz run` also gets --json, --repros and --quiet, `gate` and `selftest` --json, --junit
# and --out (each unless the line gives it). Each run gets its own ATTNFUZZ_STATE (a fresh example database)
# unless the line sets one. A run is stopped with SIGINT at its limit (a campaign winds down and writes its
# summary), killed 60 s later.
#
# Results, in WORK/results: host.txt; per run NAME.log (the end of its output, then exit= and wall_s=),
# NAME.json (attnfuzz's --json summary), NAME.xml (JUnit), NAME.md (selftest's table), up to three
# NAME-<id>.finding.json with its NAME-<id>.case.json (in a folder of both, `attnfuzz replay` re-runs it); runs.tsv and summary.md (bench/summarize.py: one row per run).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

DEVICE="" JOBS=1 DEADLINE=0 WORK="" PACK=${OUT:-} DRY=0
while [ $# -gt 0 ]; do
  case $1 in
    --device) DEVICE=$2; shift 2;;
    --jobs) JOBS=$2; shift 2;;
    --deadline) DEADLINE=$2; shift 2;;
    --work) WORK=$2; shift 2;;
    --pack) PACK=$2; shift 2;;
    --dry-run) DRY=1; shift;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0;;
    -*) echo "scenario.sh: unknown option $1" >&2; exit 2;;
    *) break;;
  esac
done
[ $# -ge 1 ] || { echo "usage: bench/scenario.sh [options] SCENARIO [RUN...] (--help)" >&2; exit 2; }
FILE=$1; shift
[ -f "$FILE" ] || FILE=bench/scenarios/$FILE
[ -f "$FILE" ] || { echo "scenario.sh: no scenario $FILE (bench/scenarios: $(ls bench/scenarios | tr '\n' ' '))" >&2; exit 2; }
SCENARIO=$(basename "$FILE")
PATTERNS=("$@")

if [ -z "$DEVICE" ]; then
  if command -v nvidia-smi >/dev/null && { [ -f .gpu-bundle/activate.sh ] || [ -f /tmp/gpu-bundle/activate.sh ]; }; then DEVICE=cuda; else DEVICE=cpu; fi
fi
if [ -z "$WORK" ]; then WORK=/tmp/attnfuzz-scenario/$SCENARIO; rm -rf "$WORK"
elif [ -n "$(ls -A "$WORK" 2>/dev/null)" ]; then echo "scenario.sh: --work $WORK is not empty" >&2; exit 2; fi
R=$WORK/results
mkdir -p "$R" "$WORK/out" "$WORK/state" "$WORK/repros"
: > "$R/runs.tsv"

export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
if [ "$DEVICE" = cuda ]; then
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
fi

# launcher VLLM_VERSION: LAUNCH=(the prefix that runs a command with vLLM importable: the bundle's or that
# release's on the GPU host, the venv's on a CPU, where `attnfuzz` and `python3` are the venv's).
launcher() {
  local ver=$1
  if [ "$DEVICE" = cuda ]; then LAUNCH=(scripts/gpu-host.sh ${ver:+--vllm "$ver"} --)
  else
    local venv=${VENV:-.venv}; [ -n "$ver" ] && venv=.venv-$ver
    [ -x "$venv/bin/python3" ] || { echo "scenario.sh: no venv $venv (scripts/setup-venv.sh $venv $ver)"; return 2; }
    LAUNCH=(env "PATH=$ROOT/$venv/bin:$PATH")
  fi
}

# Parse the scenario: every run line into NAMES / LIMITS / LINES (its remaining tokens, NUL-separated).
NAMES=() LIMITS=() LINES=() VERSIONS=()
while IFS= read -r line || [ -n "$line" ]; do
  [[ $line =~ ^[[:space:]]*(#|$) ]] && continue
  mapfile -d '' tok < <(printf '%s' "$line" | xargs printf '%s\0') ||
    { echo "scenario.sh: $SCENARIO: cannot split: $line" >&2; exit 2; }
  [ ${#tok[@]} -ge 3 ] && [[ ${tok[1]} =~ ^[0-9]+$ ]] ||
    { echo "scenario.sh: $SCENARIO: want NAME LIMIT_S [VAR=VALUE ...] COMMAND ...: $line" >&2; exit 2; }
  keep=$(( ${#PATTERNS[@]} == 0 ))
  for p in "${PATTERNS[@]}"; do [[ ${tok[0]} == $p ]] && keep=1; done  # shell patterns, unquoted on purpose
  [ "$keep" = 1 ] || continue
  ver=""; for t in "${tok[@]:2}"; do [[ $t == VLLM=* ]] && ver=${t#VLLM=}; done
  NAMES+=("${tok[0]}") LIMITS+=("${tok[1]}") VERSIONS+=("$ver")
  LINES+=("$(printf '%s\037' "${tok[@]:2}")")
done < "$FILE"
[ ${#NAMES[@]} -gt 0 ] || { echo "scenario.sh: no run of $SCENARIO matches ${PATTERNS[*]}" >&2; exit 2; }

T0=$(date +%s)
pack() {
  local py; py=$(command -v python3 || echo "$ROOT/.venv/bin/python3")
  "$py" bench/summarize.py "$R" > "$R/summary.md" 2>&1
  if [ -n "$PACK" ]; then
    mkdir -p "$PACK" && tar czf "$PACK/$SCENARIO.tgz" -C "$R" . && cp "$R/summary.md" "$PACK/$SCENARIO.md"
  fi
  echo "== $SCENARIO on $DEVICE, $(( $(date +%s) - T0 )) s: $R${PACK:+ (packed: $PACK/$SCENARIO.tgz)}"
  cat "$R/summary.md"
}
[ "$DRY" = 1 ] || { trap pack EXIT; trap 'exit 130' INT TERM; }

{ date -u +"%F %T UTC"; echo "scenario $SCENARIO, device $DEVICE, $(nproc --all) cores, $(uname -srm)"
  if [ "$DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
    (command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer) | xargs -I{} sh -c '{} --version 2>/dev/null | tail -1'
  fi
} > "$R/host.txt" 2>&1
# Unpack the bundle and each release used before runs start at once; versions of what runs.
for ver in "" $(printf '%s\n' "${VERSIONS[@]}" | sort -u); do
  [ "$DRY" = 1 ] && break
  launcher "$ver" && "${LAUNCH[@]}" python3 -c "import sys, torch, triton, hypothesis, vllm; print('vllm', vllm.__version__, 'torch', \
torch.__version__, 'triton', triton.__version__, 'hypothesis', hypothesis.__version__, 'python', sys.version.split()[0])" \
    2>&1 | grep -v "^Failed to import\|deep_gemm\|Warning\|warn(" | tail -1 >> "$R/host.txt"
done

NOISE='deep_gemm|Padding|^  File|^    |Warning|warn\(|^Failed to import'

# one_run INDEX: the run, bounded; its short log, summary and findings into $R.
one_run() {
  local i=$1 name=${NAMES[$i]} limit=${LIMITS[$i]} ver=${VERSIONS[$i]}
  local -a tok env=() cmd=()
  IFS=$'\037' read -r -a tok <<< "${LINES[$i]}"
  local t dep
  for t in "${tok[@]}"; do
    t=${t//\{work\}/$WORK}
    while [[ $t =~ \{log:([^}]+)\} ]]; do t=${t//"${BASH_REMATCH[0]}"/$WORK/out/${BASH_REMATCH[1]}.out}; done
    while [[ $t =~ \{finding:([^}]+)\} ]]; do
      dep=$(find "$WORK/repros/${BASH_REMATCH[1]}" -mindepth 1 -maxdepth 1 -type d -name '[!.]*' 2>/dev/null | sort | head -1)
      [ "$DRY" = 1 ] && dep=$WORK/repros/${BASH_REMATCH[1]}/ID
      if [ -z "$dep" ]; then
        printf 'skipped: %s saved no finding\nexit=skipped\n' "${BASH_REMATCH[1]}" > "$R/$name.log"
        printf '%s\tskipped\t0\t%s\n' "$name" "${tok[*]}" >> "$R/runs.tsv"; return; fi
      t=${t//"${BASH_REMATCH[0]}"/$dep}
    done
    if [ ${#cmd[@]} = 0 ] && [[ $t =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; then
      [[ $t == VLLM=* ]] || env+=("$t")
    else cmd+=("$t"); fi
  done
  local has=" ${cmd[*]} " filter=0
  [[ " ${env[*]} " == *" ATTNFUZZ_STATE="* ]] || env+=("ATTNFUZZ_STATE=$WORK/state/$name")
  if [ "${cmd[0]}" = attnfuzz ]; then
    local sub=${cmd[1]:-}
    cmd=(attnfuzz --device "$DEVICE" "${cmd[@]:1}")
    case $sub in
      run)
        [[ $has == *" --json "* ]] || cmd+=(--json "$R/$name.json")
        [[ $has == *" --repros "* ]] || cmd+=(--repros "$WORK/repros/$name")
        [[ $has == *" --quiet "* ]] || cmd+=(--quiet);;
      gate|selftest)
        [[ $has == *" --json "* ]] || cmd+=(--json "$R/$name.json")
        [[ $has == *" --junit "* ]] || cmd+=(--junit "$R/$name.xml")
        [[ $has == *" --out "* ]] || cmd+=(--out "$WORK/out/$name.d")
        [ "$sub" = selftest ] && { [[ $has == *" --markdown "* ]] || cmd+=(--markdown "$R/$name.md"); };;
    esac
    filter=1
  fi
  if [ "$DEADLINE" -gt 0 ]; then
    local left=$(( DEADLINE - ($(date +%s) - T0) ))
    if [ "$left" -le 10 ]; then
      printf 'skipped: past the deadline\nexit=skipped\n' > "$R/$name.log"
      printf '%s\tskipped\t0\t%s\n' "$name" "${cmd[*]}" >> "$R/runs.tsv"; return; fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "-- $name (limit ${limit} s): ${env[*]} ${ver:+[vLLM $ver] }${cmd[*]}"
  [ "$DRY" = 1 ] && return
  local start rc LAUNCH=()
  start=$(date +%s.%N)
  if launcher "$ver" > "$WORK/out/$name.out" 2>&1; then
    timeout -s INT -k 60 "$limit" env "${env[@]}" "${LAUNCH[@]}" "${cmd[@]}" >> "$WORK/out/$name.out" 2>&1 < /dev/null
    rc=$?
  else rc=2; fi
  local wall; wall=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  # attnfuzz's output without vLLM's import noise and traceback frames, its end; a tool's output as it is
  if [ "$filter" = 1 ]; then grep -Ev "$NOISE" "$WORK/out/$name.out" | tail -60; else tail -c 200000 "$WORK/out/$name.out"; fi > "$R/$name.log"
  printf 'exit=%s\nwall_s=%s\n' "$rc" "$wall" >> "$R/$name.log"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$wall" "${env[*]} ${cmd[*]}" >> "$R/runs.tsv"
  # a campaign's findings, and those of the campaigns a gate or selftest ran (their reproducers included)
  find "$WORK/repros/$name" "$WORK/out/$name.d" -path '*/.*' -prune -o -name finding.json -size -1000k -print 2>/dev/null | sort | head -3 | while read -r f; do
    local id; id=$(basename "$(dirname "$f")")
    cp "$f" "$R/$name-$id.finding.json"
    [ -f "$(dirname "$f")/case.json" ] && cp "$(dirname "$f")/case.json" "$R/$name-$id.case.json"; done
  echo "-- $name: exit $rc, $wall s"
}

declare -A PID=()
for i in "${!NAMES[@]}"; do
  # a run that reads another's finding or log waits for it
  for dep in $(grep -o '{\(finding\|log\):[^}]*}' <<< "${LINES[$i]}" | sed 's/^{[a-z]*://; s/}$//'); do
    [ -n "${PID[$dep]:-}" ] && wait "${PID[$dep]}"
  done
  if [ "$JOBS" -le 1 ]; then one_run "$i"
  else
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
    one_run "$i" & PID[${NAMES[$i]}]=$!
  fi
done
wait
