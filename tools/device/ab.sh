#!/usr/bin/env bash
# Two codes on one lent machine (lent machines differ by more than most changes move a step:
# docs/benchmarks.md): `h200_run.sh PHASE [ARG]` with the staged checkout's code, then with the code
# `BEFORE=COMMIT tools/device/stage_kit.sh` staged in .before/, then with the checkout's code again.
# From the staged repo:
#
#   OUT=$OUT BUDGET=585 SHARE_RUNS=1:750:0:0 SHARE_SECONDS=20 bash tools/device/ab.sh share
#
# $OUT/after, $OUT/before, $OUT/after2: each run's files (mind the 8 files a call brings back: the share
# phase writes two); $OUT/ab.log: the times and the code before's warm-up. BUDGET: seconds for all of it
# (the call's limit less a margin); each run is cut at what is left.
#
# The code before's kernels (the engine's warm-ups, tools.bench.gpu_kernels) compile beside the first
# run's preamble, into a PTX cache of their own (MLX_PTX_CACHE_DIR: two processes must not write one
# cache), which then takes in the first run's kernels; a kernel the two codes share compiles twice, on
# cores the preamble leaves idle.
set -uo pipefail
phase=${1:?usage: ab.sh PHASE [ARG]}
arg=${2:-}
OUT=${OUT:-/tmp/out}
[ -d .before/asr_core ] || { echo "no .before/: stage the kit with BEFORE=COMMIT" >&2; exit 1; }
t0=$(date +%s)
left() { echo $(( ${BUDGET:-585} - ($(date +%s) - t0) )); }
log() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/ab.log"; }
mkdir -p "$OUT/after" "$OUT/before" "$OUT/after2"
source .whl/device_env.sh > /dev/null || exit 1
# The carried tree has no links (a device call copies files): the code before runs through this kit.
ln -sfn ../.whl ../.kit ../tools .before/
before_cache=/tmp/ptx_before
(
  cd .before && export PYTHONPATH=/tmp/site:$PWD MLX_PTX_CACHE_DIR=$before_cache
  python3 -m tools.bench.gpu_kernels --warm-buckets "${MAX_BATCH:-512}" 2>&1 | tail -2 | sed 's/^/before: /'
) >> "$OUT/ab.log" &
warm=$!
run() {  # OUT of the run
  # shellcheck disable=SC2086  # arg: none or one word
  OUT=$1 timeout "$(left)" bash tools/device/h200_run.sh "$phase" $arg > /dev/null 2>&1
  log "$1: exit status $?"
}
log "after"
run "$OUT/after"
wait "$warm"
mkdir -p "$before_cache" && cp -n /tmp/mlx/*/ptx/* "$before_cache"/ 2>/dev/null
log "before"
(cd .before && export MLX_PTX_CACHE_DIR=$before_cache && run "$OUT/before")
log "after again"
run "$OUT/after2"
