#!/usr/bin/env bash
# The gateway's capacity runs on the lent H200, one command per device call (tools/device/stage_kit.sh
# staged the repo this runs from; see docs/benchmarks.md for the calls made and what they measured).
#
#   bash tools/device/h200_run.sh engine    # engine process + front-end processes: 500 and 2000 calls
#   bash tools/device/h200_run.sh gateway   # ttg serve + redis + ttg replay at fixed levels
#   bash tools/device/h200_run.sh profile 1000   # engine process at N calls: per-thread CPU, py-spy
#   bash tools/device/h200_run.sh encoder   # the encoder step alone: wall time per B, B=512 under ncu
#   bash tools/device/h200_run.sh dispatch  # the step's wall time per B under MLX's CUDA-graph settings
#   bash tools/device/h200_run.sh decoder   # the device decoder alone under MLX's CUDA-graph settings
#   bash tools/device/h200_run.sh parity    # each kit clip alone and as a row of 512: tokens, frames, decoder
#   bash tools/device/h200_run.sh share     # engine processes side by side, no SIP/RTP: what sharing costs
#   bash tools/device/h200_run.sh probe     # only the machine's fingerprint every phase starts with
#
# Every phase: MLX + wheels (device_env.sh), the kit's redis-server, a full-size f16 bundle generated
# into /tmp/full (random weights, calibrated as `ttg make-bundle` does). Results go to $OUT (at most 8
# files come back): the JSON/markdown summaries, the daemon's log, this script's log.
set -uo pipefail
phase=${1:?usage: h200_run.sh engine|gateway|profile|encoder|dispatch|decoder|parity|share|probe [levels]}
levels=${2:-500,1000,2000}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/run.log") 2>&1
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
# The calls the gateway under test carries now (0 while its metrics do not answer).
active_calls() {
  python3 -c 'import re, urllib.request as u
text = u.urlopen("http://127.0.0.1:9108/metrics", timeout=2).read().decode()
m = re.search(r"^ttg_active_calls (\S+)", text, re.M)
print(int(float(m.group(1))) if m else 0)' 2> /dev/null || echo 0
}
source .whl/device_env.sh || exit 1
source tools/device/kit_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.used,utilization.gpu --format=csv
nproc
# Whether the cores are hyperthreads (two of the 16 sharing one core's units): the engines' dispatch threads
# then slow down when the media workers run on their siblings.
lscpu | grep -E "^(Model name|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|NUMA node\(s\)|CPU max MHz)" || true
# The machine's fingerprint: the GPU's clocks and what holds them down, the interpreter's speed, one
# synchronized MLX round trip (tools/device/machine_probe.py).
nvidia-smi --query-gpu=pstate,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active --format=csv
python3 -m tools.device.machine_probe
[ "$phase" = probe ] && exit 0
# py-spy for the profiles: the image's, or the kit's wheel (device_env.sh installs it under /tmp/site).
spy=$(command -v py-spy || echo /tmp/site/bin/py-spy)
# A warm machine keeps /tmp: a bundle an earlier call finished is used again (the same seed and code).
make_bundle() {
  [ -e /tmp/full.done ] && return 0
  stamp "make-bundle"
  python3 -m gateway.cli make-bundle --size full --dtype f16 --seed 0 --out /tmp/full > /tmp/make_bundle.log 2>&1 \
    || { tail -20 /tmp/make_bundle.log; return 1; }
  touch /tmp/full.done
  stamp "bundle ready"
}
warm_kernels() {
  python3 -m tools.bench.gpu_kernels --warm-buckets "${MAX_BATCH:-512}" 2>&1 | tail -3
  stamp "engine kernels compiled"
}
# The encoder phase builds its random weights in memory; it makes the bundle beside its kernel profile
# (CPU work beside GPU kernel timings), so that the next call on the warm machine starts a gateway at once.
# On a machine without the bundle, the engines' kernels compile beside it: their warm-ups (the encoder's
# and the device decoder's) on random weights of the same size fill MLX's kernel cache on disk (by kernel
# source), so the gateway's engines then find them instead of compiling for minutes after the bundle.
# The parity phase runs no gateway: it starts once the bundle is made, the kernels compiling on beside it
# for the next call (waited for at the end).
# The phases on random weights of their own (encoder, dispatch, decoder) start without the bundle.
case "$phase" in encoder|dispatch|decoder) uses_bundle=0 ;; *) uses_bundle=1 ;; esac
kernels=
if [ "$phase" = parity ] && [ ! -e /tmp/full.done ]; then
  warm_kernels &
  kernels=$!
elif [ "$uses_bundle" = 1 ] && [ ! -e /tmp/full.done ]; then
  make_bundle &
  bundle=$!
  warm_kernels
  wait "$bundle" || exit 1
fi
if [ "$uses_bundle" = 1 ]; then
  make_bundle || exit 1
fi
case "$phase" in
engine)
  python3 -m gateway.cli bench engine-procs --model /tmp/full --calls 500 2000 --feeders 8 --seconds 20 \
    --decoder-mode device --max-batch 512 --json "$OUT/engine_device.json"
  stamp "device decoding done"
  python3 -m gateway.cli bench engine-procs --model /tmp/full --calls 2000 --feeders 8 --seconds 20 \
    --decoder-mode batched --workers 8 --max-batch 512 --json "$OUT/engine_ort.json"
  stamp "ORT decoding done"
  python3 -m gateway.cli bench gateway --levels 20 --call-seconds 15 --audio "$KIT_AUDIO" \
    --redis-server "$KIT_REDIS" --env TTG_MODEL__DIR=/tmp/full --env TTG_DECODER__MODE=device \
    --env TTG_ENCODER__MAX_BATCH=64 --sip-port 5060 --http-port 9108 --redis-port 6379 \
    --rtp-ports 20000-29999 --replay-rtp-ports 30000-39999 --out /tmp/gw
  cp /tmp/gw/summary.md "$OUT/gateway_summary.md"
  tail -c 200000 /tmp/gw/serve.log > "$OUT/serve.log"
  ;;
gateway)
  # The bench writes its summary after every level; copy it out as it grows, so that a run cut short
  # by the time limit still brings back the levels it finished (and only this run's: a summary left by
  # the run before must not pass for one).
  rm -rf /tmp/gw
  # DEFAULTS=1: the gateway's own defaults for precision, decoding, batch size and engines (what an
  # operator's plain `ttg serve` picks on this card) instead of the choices named here.
  if [ "${DEFAULTS:-0}" = 1 ]; then
    chosen=()
  else
    chosen=(--env TTG_MODEL__PRECISION=f16 --env TTG_DECODER__MODE=device
      --env TTG_ENCODER__MAX_BATCH="${MAX_BATCH:-512}")
  fi
  python3 -m gateway.cli bench gateway --levels "$levels" --call-seconds "${CALL_SECONDS:-20}" --cps 100 \
    --calls-per-replay 700 --audio "$KIT_AUDIO" --redis-server "$KIT_REDIS" \
    --env TTG_MODEL__DIR=/tmp/full "${chosen[@]}" --sip-port 5060 --http-port 9108 --redis-port 6379 \
    --rtp-ports 20000-29999 --replay-rtp-ports 30000-49999 --out /tmp/gw ${GATEWAY_ARGS:-} &
  bench=$!
  # Kernels MLX compiles live, after the warm-up (its PTX cache, /tmp/mlx/VERSION/ptx, gains a file
  # for each): listed at the end, as the first level on a fresh machine runs slower than on a warm one.
  rm -f /tmp/ready.marker
  ( until grep -q "gateway ready" "$OUT/run.log" 2>/dev/null; do sleep 1; done; touch /tmp/ready.marker ) &
  # PROFILE_AT_S: that long after the gateway first carries PROFILE_CALLS calls (its ttg_active_calls;
  # default: 95 % of the last level's, which a few refused calls must not keep from starting), sample
  # the engine process (py-spy, all threads, then only the interpreter lock's holder) while the calls
  # run; NATIVE=1 adds C frames.
  if [ -n "${PROFILE_AT_S:-}" ]; then
    (
      want=${PROFILE_CALLS:-$(( ${levels##*,} * 95 / 100 ))}
      until [ "$(active_calls)" -ge "$want" ]; do
        kill -0 "$bench" 2> /dev/null || { echo "no profile: the gateway never carried $want calls"; exit 0; }
        sleep 1
      done
      sleep "$PROFILE_AT_S"
      pid=$(pgrep -f "asr_core.host" | head -1)
      if [ -n "$pid" ] && [ -x "$spy" ]; then
        stamp "profiling the engine process $pid"
        # NATIVE=1: C/C++ frames too (MLX, CUDA), to tell its own work from waits for the lock.
        # One media worker at the same time (its own C frames: numpy, soxr, the sockets).
        media=$(pgrep -f "gateway.workers.media_worker" | head -1)
        if [ -n "$media" ]; then
          "$spy" record -p "$media" -d 8 -r 100 -f raw -o "$OUT/media.raw" --native > /tmp/spy3.log 2>&1 &
        fi
        "$spy" record -p "$pid" -d 8 -r 100 -f raw -o "$OUT/all.raw" --threads --idle ${NATIVE:+--native} \
          > /tmp/spy1.log 2>&1
        wait
        "$spy" record -p "$pid" -d 8 -r 100 -f raw -o "$OUT/gil.raw" --threads --gil > /tmp/spy2.log 2>&1
        tail -n 2 /tmp/spy1.log /tmp/spy2.log /tmp/spy3.log 2>/dev/null
      else
        echo "no profile: engine pid '$pid', py-spy '$spy'"
      fi
    ) &
  fi
  # RENICE_MEDIA=N: once the gateway is ready, its media workers at niceness N (the engines' MLX threads
  # first when the cores run short); ENGINE_CPUS=LIST / MEDIA_CPUS=LIST: the engine processes' / media
  # workers' threads on those cores only.
  if [ -n "${RENICE_MEDIA:-}${ENGINE_CPUS:-}${MEDIA_CPUS:-}" ]; then
    ( until grep -q "gateway ready" "$OUT/run.log" 2>/dev/null; do sleep 1; done
      if [ -n "${RENICE_MEDIA:-}" ]; then
        for pid in $(pgrep -f "gateway.workers.media_worker"); do renice -n "$RENICE_MEDIA" -p "$pid" > /dev/null; done
        stamp "media workers at niceness $RENICE_MEDIA: $(pgrep -f gateway.workers.media_worker | wc -l)"
      fi
      if [ -n "${ENGINE_CPUS:-}" ]; then
        for pid in $(pgrep -f "asr_core.host"); do taskset -a -cp "$ENGINE_CPUS" "$pid" > /dev/null; done
        stamp "engine processes on cores $ENGINE_CPUS: $(pgrep -f asr_core.host | wc -l)"
      fi
      if [ -n "${MEDIA_CPUS:-}" ]; then
        for pid in $(pgrep -f "gateway.workers.media_worker"); do taskset -a -cp "$MEDIA_CPUS" "$pid" > /dev/null; done
        stamp "media workers on cores $MEDIA_CPUS"
      fi ) &
  fi
  # Which processes hold the GPU, once the first level runs (with several engines: the gateway's MPS
  # server and its clients; GATEWAY_ARGS="--env TTG_DAEMON__CUDA_MPS=off" for the engines time-sliced).
  ( until grep -q "gateway ready" "$OUT/run.log" 2>/dev/null; do sleep 1; done; sleep 40
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv ) &
  while kill -0 "$bench" 2>/dev/null; do
    cp /tmp/gw/summary.json "$OUT/" 2>/dev/null
    tail -c 300000 /tmp/gw/serve.log > "$OUT/serve.log" 2>/dev/null
    sleep 5
  done
  wait "$bench"
  if [ -e /tmp/ready.marker ]; then
    # Into this log (at most 8 files come back, and the profiles take them all).
    find /tmp/mlx -name '*.ptx' -newer /tmp/ready.marker -printf '%TT %f\n' 2>/dev/null | sort > /tmp/live_kernels.txt
    stamp "kernels compiled after the gateway was ready: $(wc -l < /tmp/live_kernels.txt)"
    head -n 60 /tmp/live_kernels.txt
  fi
  cp /tmp/gw/summary.md /tmp/gw/summary.json "$OUT/" 2>/dev/null
  tail -c 300000 /tmp/gw/serve.log > "$OUT/serve.log"
  # The engines' step reports and any failure with its traceback (the per-call lines crowd them out
  # of the log's tail).
  grep -v "gateway.call.core\|gateway.sip\|call .* ended:" /tmp/gw/serve.log | tail -c 400000 > "$OUT/engines.log"
  # The calls named in the summary's `without_any_transcript_examples` (an utterance no partial or final
  # covered, of a sentence most calls got): every line of the full log about each of them.
  python3 - > "$OUT/uncovered.log" <<'PY'
import json, re
ids = {e["sip_call_id"] for lv in json.load(open("/tmp/gw/summary.json"))["levels"]
       for e in lv.get("without_any_transcript_examples", [])}
ours, lines = set(), []
for line in open("/tmp/gw/serve.log", errors="replace"):
    m = re.search(r"call (\w+) started: .*sip call-id (\S+?),", line)
    if m and m.group(2) in ids:
        ours.add(m.group(1))
    if any(i in line for i in ours) or any(i in line for i in ids):
        lines.append(line)
print(f"{len(ids)} calls, {len(ours)} found in the log", "".join(lines[-3000:]), sep="\n")
PY
  # What each daemon settled at start (the accelerator, its engines, decoder and batch): into this log, as
  # the log's tail above keeps only the levels' end at thousands of calls.
  grep -E "accelerator:|ASR engine up|media workers up|CUDA MPS:" /tmp/gw/serve.log | head -n 20
  stamp "gateway levels done"
  # The one-process model on CUDA too: start, one short call, SIGTERM; exit status and abort marks.
  # Device decoding, as in the levels above: its MLX thread must end cleanly there too.
  if [ "${ONE_PROCESS:-1}" = 1 ]; then
    python3 -m gateway.cli bench gateway --levels 1 --call-seconds 3 --audio "$KIT_AUDIO" \
      --redis-server "$KIT_REDIS" --env TTG_MODEL__DIR=/tmp/full --env TTG_DAEMON__MEDIA_WORKERS=0 \
      --env TTG_DECODER__MODE=device --env TTG_ENCODER__MAX_BATCH=8 --sip-port 5062 --http-port 9110 \
      --redis-port 6381 --rtp-ports 20000-20999 --replay-rtp-ports 21000-21999 --out /tmp/gw1 > /tmp/gw1.log 2>&1
    tail -3 /tmp/gw1.log
    cp /tmp/gw1/summary.md "$OUT/one_process_summary.md" 2>/dev/null
  fi
  ;;
encoder)
  # Random full-size weights (no bundle): the step's wall time at each B on one model, then two B=512
  # steps kernel by kernel under Nsight Compute (docs/benchmarks.md, "Kernel by kernel").
  python3 -m tools.bench.gpu_kernels --batch 512 256 128 32 1 | tee "$OUT/encoder_steps.txt"
  stamp "step times done"
  make_bundle &
  bundle=$!
  ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv --print-units base \
    --log-file "$OUT/ncu_ours_512.csv" python3 -m tools.bench.gpu_kernels --batch 512 > /tmp/ncu.log 2>&1 \
    || tail -20 /tmp/ncu.log
  python3 -m tools.bench.gpu_kernels --summarize "$OUT/ncu_ours_512.csv" --top 40 | tee "$OUT/ncu_ours_512.md"
  wait "$bundle"
  ;;
dispatch)
  # In the gateway an engine's step is bound by MLX's host work, not the GPU's (docs/benchmarks.md,
  # "where an engine's step goes at 2 000 calls"): MLX on CUDA records each step's ~1 300 kernel launches
  # into CUDA graphs of MLX_MAX_OPS_PER_BUFFER nodes (20 by default), instantiated anew or updated from an
  # LRU cache of MLX_CUDA_GRAPH_CACHE_SIZE graphs (100). The step's wall time per B under each setting
  # ("-": MLX's defaults; "A=1,B=2": both), alone and then interleaved as an engine alternates sizes (where
  # one size's graphs may fit the cache and several sizes' not); one model build per setting. The
  # thrashing check warns when the cache is too small. DISPATCH_SETTINGS: the list.
  # Beside it, on the other half of the cores, the bundle and then the engines' kernels for the next call.
  if [ ! -e /tmp/full.done ]; then
    ( taskset -cp 8-15 "$BASHPID" > /dev/null; make_bundle ) &
    bundle=$!
  fi
  for setting in ${DISPATCH_SETTINGS:-- MLX_CUDA_GRAPH_CACHE_SIZE=4000 \
      MLX_MAX_OPS_PER_BUFFER=200,MLX_CUDA_GRAPH_CACHE_SIZE=4000 MLX_MAX_OPS_PER_BUFFER=200 MLX_USE_CUDA_GRAPHS=0}; do
    extra=()
    [ "$setting" = - ] || IFS=, read -r -a extra <<< "$setting"
    stamp "setting: $setting" | tee -a "$OUT/dispatch.txt"
    env MLX_ENABLE_CACHE_THRASHING_CHECK=1 "${extra[@]}" taskset -c 0-7 python3 -m tools.bench.gpu_kernels \
      --batch 512 128 32 1 --interleave 5 2>&1 | grep -v "steps profiled" | tee -a "$OUT/dispatch.txt"
  done
  if [ -n "${bundle:-}" ]; then
    warm_kernels
    wait "$bundle"
  fi
  ;;
decoder)
  # The device decoder alone (tools/device/decoder_graphs.py: full-size random weights, 4 frames a row, the
  # rows of a decode alternating 128/256/448/192) under MLX's CUDA-graph settings, in f32 as the engine
  # decodes and in bf16, and at one row count (a graph met again with the same shapes); MLX reads its
  # settings once a process: a run each, "LABEL|VAR=V,VAR=V|ARGS" ("-": none). The first run compiles the
  # kernels in its warm-up.
  g200=MLX_MAX_OPS_PER_BUFFER=200,MLX_CUDA_GRAPH_CACHE_SIZE=4000
  for variant in "MLX's defaults|-|" "200 nodes, cache 4000|$g200|" "no graphs|MLX_USE_CUDA_GRAPHS=0|" \
      "200 nodes, cache 4000, bf16|$g200|--dtype bf16" "no graphs, bf16|MLX_USE_CUDA_GRAPHS=0|--dtype bf16" \
      "200 nodes, cache 4000, 256 rows|$g200|--rows 256" "no graphs, 256 rows|MLX_USE_CUDA_GRAPHS=0|--rows 256"; do
    IFS='|' read -r label setting extra <<< "$variant"
    vars=()
    [ "$setting" = - ] || IFS=, read -r -a vars <<< "$setting"
    # shellcheck disable=SC2086  # extra: the run's own arguments
    env "${vars[@]}" timeout 300 python3 -m tools.device.decoder_graphs --label "$label" $extra 2>&1 \
      | tail -1 | tee -a "$OUT/decoder.txt"
  done
  ;;
parity)
  # Whether a stream says the same alone and as one row of a large batch on this GPU, and where a
  # difference comes from (the encoder's frames; the device decoder against the reference decoder);
  # STREAMS: the batch, PRECISIONS: one run each.
  python3 -m gateway.cli bench batch-parity --model /tmp/full --audio "$KIT_AUDIO" --streams "${STREAMS:-512}" \
    --precision ${PRECISIONS:-f16 f32} --json "$OUT/parity.json" 2>&1 | grep -v "falls behind" | tee "$OUT/parity.txt"
  stamp "batch-parity exited with status ${PIPESTATUS[0]}"
  ;;
share)
  # Why an engine's step grows ~0.5 ms a row in the gateway where the step alone grows ~0.06: K engine
  # processes (`ttg bench engine-procs`, device decoding, no SIP, RTP, media workers or replay) side by side,
  # each at CALLS calls from ceil(CALLS / 125) feeder processes, their levels started together (--barrier);
  # BURN busy-looping processes take cores as the gateway's other processes do; MPS=1 through an MPS
  # server of this run's own. One engine alone at 375 calls against four at 375 each (the gateway's
  # 1 500) tells sharing the GPU from sharing the cores from the engine's own work. SHARE_RUNS: the
  # runs, each K:CALLS:BURN:MPS[:thread] (CALLS may be a comma list: levels one after the other on one
  # engine; thread: the device decoder on a thread of its own, TTG_DECODER__DEVICE_THREAD=true). Each of the K
  # engines may use 1/K of the card's memory, as the gateway's do; SHARE_DEVICE=F: F each instead (the
  # spec's sixth field, K:CALLS:BURN:MPS:THREAD:F, for one run). Each run's nvidia-smi per process (memory
  # on the card, every 2 s) goes to $OUT/apps.csv: the card's memory as the driver counts it, which is more
  # than MLX's own count (its context, kernels, managed memory).
  for spec in ${SHARE_RUNS:-1:375:0:1 1:1500:0:1}; do
    IFS=: read -r k calls burn mps thread share <<< "$spec"
    share=${share:-${SHARE_DEVICE:-$(python3 -c "print(1 / $k)")}}
    stamp "share $spec: $k engine process(es) at $calls calls each, $burn busy processes, MPS $mps, $share of the card's memory each" | tee -a "$OUT/share.txt"
    if [ "$mps" = 1 ]; then
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
      nvidia-cuda-mps-control -d || stamp "no MPS control daemon"
    fi
    burners=()
    for _ in $(seq "$burn"); do timeout 400 python3 -c "while True: pass" & burners+=($!); done
    rm -rf /tmp/share_barrier
    benches=()
    rm -f /tmp/share_apps.csv
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader -l 2 \
      -f /tmp/share_apps.csv 2>/dev/null &
    smi=$!
    for i in $(seq "$k"); do
      timeout $(( 2 * ${SHARE_SECONDS:-40} + 150 )) python3 -m gateway.cli bench engine-procs --model /tmp/full \
        --precision f16 --calls ${calls//,/ } --feeders $(( (${calls##*,} + 124) / 125 )) \
        --seconds "${SHARE_SECONDS:-40}" --decoder-mode device ${thread:+--device-thread} --max-batch 512 \
        --device-share "$share" \
        --barrier "/tmp/share_barrier:$k" > "/tmp/share_$i.log" 2>&1 &
      benches+=($!)
    done
    wait "${benches[@]}"
    kill "$smi" 2>/dev/null
    sed "s/^/$spec, /" /tmp/share_apps.csv >> "$OUT/apps.csv" 2>/dev/null
    # (`wait` with no PIDs would wait for this script's log tee too)
    if [ "$burn" -gt 0 ]; then kill "${burners[@]}" 2>/dev/null; wait "${burners[@]}" 2>/dev/null; fi
    if [ "$mps" = 1 ]; then
      echo quit | nvidia-cuda-mps-control
      unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    fi
    for i in $(seq "$k"); do
      grep -E "engine ready|barrier|encoder: |^\{|exit status|Error|error|Traceback" "/tmp/share_$i.log" \
        | grep -v "falls behind" | sed "s/^/[$spec #$i] /" | tee -a "$OUT/share.txt"
    done
  done
  ;;
profile)
  # Where the engine process's time goes in steady state: the engine-procs bench at one level, and
  # while it runs, each thread's CPU (top -H) and py-spy samples (all threads; interpreter-lock holders).
  python3 -m gateway.cli bench engine-procs --model /tmp/full --calls "$levels" --feeders 8 --seconds 45 \
    --decoder-mode device --max-batch 512 --json "$OUT/engine.json" > /tmp/bench.log 2>&1 &
  bench=$!
  until grep -q "engine ready" /tmp/bench.log 2>/dev/null || ! kill -0 "$bench" 2>/dev/null; do sleep 2; done
  grep -q "engine ready" /tmp/bench.log && stamp "engine ready" || stamp "the bench ended before the engine was ready"
  sleep 25
  pid=$(pgrep -f "asr_core.host" | head -1)
  if [ -n "$pid" ]; then
    top -H -b -n 3 -d 3 -p "$pid" > "$OUT/threads.txt"
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv -l 1 > "$OUT/smi.csv" 2>&1 &
    smi=$!
    if [ -x "$spy" ]; then
      "$spy" record -p "$pid" -d 8 -r 100 -f raw -o "$OUT/all.raw" --threads --idle > /dev/null 2>&1
      "$spy" record -p "$pid" -d 8 -r 100 -f raw -o "$OUT/gil.raw" --threads --gil > /dev/null 2>&1
    else
      echo "py-spy not on this machine"
    fi
    kill "$smi"
  fi
  wait "$bench"
  grep -v "falls behind" /tmp/bench.log | tail -c 100000 > "$OUT/bench.log"
  ;;
esac
[ -n "$kernels" ] && wait "$kernels"
stamp "done"
