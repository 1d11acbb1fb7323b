#!/usr/bin/env bash
# Two codes, or two settings, on one lent machine (lent machines differ by more than most changes move a
# step, and two runs of one gateway level on one machine land up to ~1.4 s apart: docs/benchmarks.md),
# through `h200_run.sh PHASE [ARG]`, from the staged repo:
#
#   codes:    the kit staged with BEFORE=COMMIT (tools/device/stage_kit.sh): the checkout's code ($OUT/after),
#             the code in .before/ ($OUT/before), the checkout's code again ($OUT/after2)
#               OUT=$OUT BUDGET=585 SHARE_RUNS=1:750:0:0 SHARE_SECONDS=20 bash tools/device/ab.sh share
#   settings: AB_ENV="VAR=V ...": runs without and with those variables in turn, RUNS of each (default 2),
#             $OUT/a1 $OUT/b1 $OUT/a2 ... (the gateway and the engine benches pass their environment on)
#               OUT=$OUT BUDGET=585 AB_ENV=MLX_USE_CUDA_GRAPHS=1 KEEP="summary.md engines.log" \
#                 GATEWAY_ARGS=... CALL_SECONDS=20 ONE_PROCESS=0 bash tools/device/ab.sh gateway 2000
#
# $OUT/ab.log: what ran when, and each run's exit status. KEEP: the files each run keeps (a call brings back
# 8 files; default: all). BUDGET: seconds for all of it (the call's limit less a margin); each run is cut at
# what is left, and a run that would start with less than MIN_S (default 60) left does not start.
#
# Codes: the code before's kernels (the engine's warm-ups, tools.bench.gpu_kernels) compile after the first
# run, into a PTX cache of their own (MLX_PTX_CACHE_DIR: two processes must not write one cache) that starts
# as a copy of the first run's, so only the kernels the codes do not share compile. Not beside the first
# run: on an 80 GB card that warm-up beside the run's own warm-up or its engines runs the card out of memory.
set -uo pipefail
phase=${1:?usage: ab.sh PHASE [ARG]}
arg=${2:-}
OUT=${OUT:-/tmp/out}
t0=$(date +%s)
left() { echo $(( ${BUDGET:-585} - ($(date +%s) - t0) )); }
log() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/ab.log"; }
run() {  # the run's folder
  if [ "$(left)" -lt "${MIN_S:-60}" ]; then log "$1: not started, $(left) s left"; return; fi
  mkdir -p "$1"
  log "$1"
  # shellcheck disable=SC2086  # arg: none or one word
  OUT=$1 timeout "$(left)" bash tools/device/h200_run.sh "$phase" $arg > /dev/null 2>&1
  log "$1: exit status $?"
  if [ -n "${KEEP:-}" ]; then
    for f in "$1"/*; do
      case " $KEEP " in *" $(basename "$f") "*) ;; *) rm -f "$f" ;; esac
    done
  fi
}
mkdir -p "$OUT"
source .whl/device_env.sh > /dev/null || exit 1

if [ -n "${AB_ENV:-}" ]; then
  for i in $(seq "${RUNS:-2}"); do
    run "$OUT/a$i"
    # shellcheck disable=SC2086  # AB_ENV: VAR=V words
    (export $AB_ENV && run "$OUT/b$i")
  done
  exit 0
fi

[ -d .before/asr_core ] || { echo "no .before/ (stage the kit with BEFORE=COMMIT) and no AB_ENV" >&2; exit 1; }
# The carried tree has no links (a device call copies files): the code before runs through this kit.
ln -sfn ../.whl ../.kit ../tools .before/
before_cache=/tmp/ptx_before
run "$OUT/after"
mkdir -p "$before_cache" && cp -n /tmp/mlx/*/ptx/* "$before_cache"/ 2>/dev/null
log "before: kernel warm-up"
(
  cd .before && export PYTHONPATH=/tmp/site:$PWD MLX_PTX_CACHE_DIR=$before_cache
  s=$(left); [ "$s" -gt 1 ] || s=1
  timeout "$s" python3 -m tools.bench.gpu_kernels --warm-buckets "${MAX_BATCH:-512}" 2>&1 | tail -2 \
    | sed 's/^/before: /'
) >> "$OUT/ab.log"
(cd .before && export MLX_PTX_CACHE_DIR=$before_cache && run "$OUT/before")
# A gateway run names the checkout it ran (summary.json's "repo"): the code before's must be .before/.
if [ -f "$OUT/before/summary.json" ] && ! grep -q '"repo": "[^"]*/\.before"' "$OUT/before/summary.json"; then
  log "before: NOT the code before, summary.json names another checkout"
fi
run "$OUT/after2"
