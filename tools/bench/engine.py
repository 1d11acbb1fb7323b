"""`ttg bench engine`: real-time-paced synthetic calls through the whole engine.

N calls start staggered over one chunk period (so their chunks complete spread out, as real calls
do), each pushes `--block-ms` of 16 kHz audio every block period on the wall clock for `--seconds`,
then finishes. The audio is synthetic speech-like sound (voiced harmonics at a syllable rate, in
phrases separated by pauses; a different voice per call), so the encoder sees realistic input sizes
and the assembler sees pauses; with random weights the text is meaningless, the work is not.

Reported: encoder step time and batch size distributions, queue waits, decoder cost (CPU seconds of
the decoder threads per call-second, i.e. how many calls one core can decode at real time; tokens per
call-second beside it, since random weights emit at their own rate), per-call lag (chunk
complete -> chunk decoded), transcript latency per kind, dropped chunks, and whether the pacer
itself kept real time (if it did not, the numbers describe a slower-than-real-time load).

Imports only asr_core, numpy and onnxruntime (through asr_core), so it runs on the GPU host:
    source .whl/device_env.sh && python -m tools.bench.engine --model DIR --calls 64 256 --json OUT
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np

from asr_core.config import DecoderMode

SAMPLE_RATE = 16_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model bundle directory")
    parser.add_argument(
        "--calls", type=int, nargs="+", default=[1], help="concurrent calls (one run per value)"
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="audio per call (real time)")
    parser.add_argument(
        "--decoder-mode",
        choices=["workers", "batched", "both"],
        default="both",
        help="decoder mode(s) to run",
    )
    parser.add_argument("--workers", type=int, default=2, help="decoder worker threads")
    parser.add_argument("--max-batch", type=int, default=256, help="most chunks per encoder step")
    parser.add_argument("--max-wait-ms", type=float, default=10.0, help="scheduler max wait")
    parser.add_argument("--lookahead", type=int, default=None, help="encoder lookahead (default: bundle's)")
    parser.add_argument("--language", default="en-US", help="language of every call")
    parser.add_argument("--precision", default="auto", choices=["auto", "f32", "f16", "bf16"])
    parser.add_argument("--block-ms", type=int, default=80, help="audio per push (the gateway pushes 80 ms)")
    parser.add_argument(
        "--warmup-s", type=float, default=2.0, help="steps in the first seconds are not counted"
    )
    parser.add_argument("--json", default=None, help="write the results here (JSON)")


# -- synthetic speech-like audio -----------------------------------------------------------------------


def synthetic_call(seconds: float, seed: int) -> np.ndarray:
    """Speech-like sound: 'syllables' (harmonics of a wandering f0 at ~4/s, each opened by a burst of
    high-passed noise like a consonant) in 1-4 s phrases separated by 0.4-1.2 s pauses."""
    rng = np.random.default_rng(seed)
    n = int(seconds * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    f0 = 110 + 60 * rng.random() + 15 * np.sin(2 * np.pi * 0.5 * t + rng.random() * 6)
    phase = 2 * np.pi * np.cumsum(f0) / SAMPLE_RATE
    voiced = sum(np.sin(k * phase) / k for k in range(1, 30))
    rate = 4 + rng.random()
    cycle = (t * rate) % 1.0
    syllables = np.where(cycle > 0.15, np.sin(np.pi * (cycle - 0.15) / 0.85) ** 2, 0.0)
    white = rng.standard_normal(n + 1)
    consonants = np.diff(white) * (cycle < 0.12)  # first difference: high-passed noise
    gate = np.zeros(n, np.float32)
    pos = int(rng.uniform(0.1, 0.5) * SAMPLE_RATE)
    while pos < n:
        length = int(rng.uniform(1.0, 4.0) * SAMPLE_RATE)
        gate[pos : pos + length] = 1.0
        pos += length + int(rng.uniform(0.4, 1.2) * SAMPLE_RATE)
    noise = rng.standard_normal(n) * 0.002
    x = (0.08 * voiced * syllables + 0.05 * consonants) * gate + noise
    return np.asarray(np.clip(x, -1, 1), np.float32)


# -- measurement -------------------------------------------------------------------------------------


@dataclass
class Recorder:
    """EngineHooks that keep every sample (with its time) for the report."""

    t0: float = field(default_factory=time.monotonic)
    steps: list[tuple[float, float, int]] = field(default_factory=list)  # (t, seconds, batch)
    waits: list[float] = field(default_factory=list)
    decodes: list[tuple[float, float, int]] = field(default_factory=list)  # (t, seconds, streams)
    dropped: int = 0
    latencies: dict[str, list[float]] = field(default_factory=lambda: {"partial": [], "final": []})
    lock: threading.Lock = field(default_factory=threading.Lock)

    def encoder_step(self, seconds: float, batch_size: int, queue_waits_s: Sequence[float]) -> None:
        with self.lock:
            self.steps.append((time.monotonic() - self.t0, seconds, batch_size))
            self.waits.extend(queue_waits_s)

    def decoder_step(self, seconds: float, n_streams: int) -> None:
        with self.lock:
            self.decodes.append((time.monotonic() - self.t0, seconds, n_streams))

    def chunk_dropped(self, stream_id: str) -> None:
        with self.lock:
            self.dropped += 1

    def transcript(self, kind: str, latency_s: float) -> None:
        with self.lock:
            self.latencies.setdefault(kind, []).append(latency_s)

    def time_to_final(self, seconds: float) -> None:
        with self.lock:
            self.latencies.setdefault("time_to_final", []).append(seconds)


def pct(values: Sequence[float], *qs: float) -> dict[str, float]:
    if not values:
        return {f"p{int(q)}": math.nan for q in qs}
    arr = np.asarray(values, np.float64)
    return {f"p{q:g}": float(np.percentile(arr, q)) for q in qs}


@dataclass
class RunResult:
    calls: int
    decoder_mode: str
    workers: int
    seconds: float
    lookahead: int
    steps: int
    step_ms: dict[str, float]
    batch: dict[str, float]
    batch_hist: dict[str, int]
    queue_wait_ms: dict[str, float]
    decoder_core_s_per_call_s: float
    decoder_wall_s_per_call_s: float
    decoder_calls_per_core: float
    decode_call_ms: dict[str, float]
    tokens_per_call_s: float
    lag_ms: dict[str, float]
    latency_ms: dict[str, dict[str, float]]
    dropped_chunks: int
    errors: int
    pacer_late_ms_max: float
    push_us: dict[str, float]
    push_core_share_per_call: float
    process_cores: float
    wall_s: float


def run_once(model: Any, calls: int, mode: DecoderMode, args: argparse.Namespace) -> RunResult:
    from asr_core.api import StreamEnded, StreamOptions, TranscriptEvent
    from asr_core.config import DecoderConfig, EndpointConfig, EngineConfig, SchedulerConfig
    from asr_core.engine import AsrEngine

    lookahead = args.lookahead if args.lookahead is not None else model.default_lookahead
    cfg = EngineConfig(
        scheduler=SchedulerConfig(
            max_batch=args.max_batch,
            max_wait_ms=args.max_wait_ms,
            max_queued_chunks=64,
            max_undecoded_chunks=2,
        ),
        decoder=DecoderConfig(mode=mode, workers=args.workers),
        endpoint=EndpointConfig(),
    )
    rec = Recorder()
    ended: list[StreamEnded] = []
    tokens = [0]
    done = threading.Event()
    lock = threading.Lock()

    def on_event(ev: Any) -> None:
        with lock:
            if isinstance(ev, StreamEnded):
                ended.append(ev)
                if len(ended) == calls:
                    done.set()
            elif isinstance(ev, TranscriptEvent) and ev.kind == "final":
                tokens[0] += len(ev.token_ids)

    block = int(SAMPLE_RATE * args.block_ms / 1000)
    audio = [synthetic_call(args.seconds, seed=i) for i in range(calls)]
    period_s = (lookahead + 1) * 0.08
    offsets = [period_s * i / calls for i in range(calls)]  # staggered starts within one chunk period
    n_blocks = -(-audio[0].size // block)
    engine = AsrEngine(model, cfg, rec).start()
    try:
        streams = [
            engine.open_stream(
                f"call-{i}", StreamOptions(language=args.language, lookahead=lookahead), on_event
            )
            for i in range(calls)
        ]
        cpu0, wall0 = time.process_time(), time.monotonic()
        rec.t0 = wall0
        # One pacer: each call's block k is due at offset_i + (k+1)*block_s (when its audio "arrived").
        schedule = sorted(
            (offsets[i] + (k + 1) * args.block_ms / 1000, i, k) for i in range(calls) for k in range(n_blocks)
        )
        late_max = 0.0
        push_s: list[float] = []
        for due, i, k in schedule:
            now = time.monotonic() - wall0
            if due > now:
                time.sleep(due - now)
            else:
                late_max = max(late_max, now - due)
            t_push = time.perf_counter()
            streams[i].push(audio[i][k * block : (k + 1) * block])
            push_s.append(time.perf_counter() - t_push)
            if k == n_blocks - 1:
                streams[i].finish()
        if not done.wait(timeout=60 + args.seconds):
            print(f"  warning: {calls - len(ended)} calls did not end in time", file=sys.stderr)
        wall = time.monotonic() - wall0
        cpu = time.process_time() - cpu0
    finally:
        engine.shutdown(timeout=10)

    steps = [(s, b) for t, s, b in rec.steps if t >= args.warmup_s] or [(s, b) for _, s, b in rec.steps]
    step_s = [s for s, _ in steps]
    batches = [b for _, b in steps]
    hist: dict[str, int] = {}
    for b in batches:
        lo = 1 << max(0, b.bit_length() - 1)
        key = f"{lo}-{2 * lo - 1}" if lo > 1 else "1"
        hist[key] = hist.get(key, 0) + 1
    # CPU time (thread time of the decoder workers): other load on the machine does not count.
    decode_cpu = sum(e.stats.get("decode_cpu_s", 0.0) for e in ended)
    decode_wall = sum(s for _, s, _ in rec.decodes)
    call_seconds = calls * args.seconds
    per_call = decode_cpu / call_seconds if call_seconds else math.nan
    lags = [e.stats.get("lag_p50_s", math.nan) for e in ended]
    lag_p95 = [e.stats.get("lag_p95_s", math.nan) for e in ended]
    lag_max = [e.stats.get("lag_max_s", math.nan) for e in ended]
    return RunResult(
        calls=calls,
        decoder_mode=mode,
        workers=args.workers,
        seconds=args.seconds,
        lookahead=lookahead,
        steps=len(step_s),
        step_ms={k: v * 1000 for k, v in pct(step_s, 50, 90, 99, 100).items()},
        batch={**pct(batches, 50, 90, 100), "mean": float(np.mean(batches)) if batches else math.nan},
        batch_hist=dict(sorted(hist.items(), key=lambda kv: int(kv[0].split("-")[0]))),
        queue_wait_ms={k: v * 1000 for k, v in pct(rec.waits, 50, 95, 99).items()},
        decoder_core_s_per_call_s=per_call,
        decoder_wall_s_per_call_s=decode_wall / call_seconds if call_seconds else math.nan,
        decoder_calls_per_core=1.0 / per_call if per_call > 0 else math.inf,
        decode_call_ms={k: v * 1000 for k, v in pct([s for _, s, _ in rec.decodes], 50, 99).items()},
        tokens_per_call_s=tokens[0] / call_seconds if call_seconds else 0.0,
        lag_ms={
            "p50_of_calls_p50": float(np.nanmedian(lags)) * 1000 if lags else math.nan,
            "max_of_calls_p95": float(np.nanmax(lag_p95)) * 1000 if lag_p95 else math.nan,
            "max": float(np.nanmax(lag_max)) * 1000 if lag_max else math.nan,
        },
        latency_ms={
            kind: {k: v * 1000 for k, v in pct(vals, 50, 95, 99).items()}
            for kind, vals in rec.latencies.items()
        },
        dropped_chunks=rec.dropped,
        errors=sum(1 for e in ended if e.reason == "error"),
        pacer_late_ms_max=late_max * 1000,
        push_us={k: v * 1e6 for k, v in pct(push_s, 50, 99).items()},
        push_core_share_per_call=sum(push_s) / call_seconds if call_seconds else math.nan,
        process_cores=cpu / wall if wall else math.nan,
        wall_s=wall,
    )


def format_row(r: RunResult) -> str:
    final = r.latency_ms.get("final", {})
    cells = [
        f"{r.calls}",
        f"{r.decoder_mode} x{r.workers}",
        f"{r.steps}",
        f"{r.step_ms['p50']:.1f} / {r.step_ms['p90']:.1f} / {r.step_ms['p100']:.1f}",
        f"{r.batch['mean']:.1f} / {r.batch['p100']:.0f}",
        f"{r.queue_wait_ms['p95']:.1f}",
        f"{r.decoder_calls_per_core:.0f}",
        f"{r.lag_ms['p50_of_calls_p50']:.0f} / {r.lag_ms['max']:.0f}",
        f"{final.get('p50', math.nan):.0f} / {final.get('p95', math.nan):.0f}",
        f"{r.dropped_chunks}",
        f"{r.pacer_late_ms_max:.0f}",
        f"{r.push_us['p50']:.0f} / {r.push_us['p99']:.0f}",
        f"{r.process_cores:.2f}",
    ]
    return "| " + " | ".join(cells) + " |"


COLUMNS = [
    "calls",
    "decoder",
    "steps",
    "step ms p50/p90/max",
    "batch mean/max",
    "queue wait p95 ms",
    "decoder calls/core",
    "lag ms p50/max",
    "final latency ms p50/p95",
    "dropped",
    "pacer late ms",
    "push us p50/p99",
    "process cores",
]
HEADER = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS)


def main(args: argparse.Namespace) -> int:
    from asr_core.model import AsrModel

    t_load = time.monotonic()
    model = AsrModel.load(args.model, args.precision)
    info = model.info
    print(f"host {platform.node()}: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(
        f"model {args.model} loaded in {time.monotonic() - t_load:.1f} s ({info.precision} on {info.device})"
    )
    modes: list[DecoderMode] = ["workers", "batched"] if args.decoder_mode == "both" else [args.decoder_mode]
    results: list[RunResult] = []
    print(HEADER)
    failures: list[dict[str, object]] = []
    for calls in args.calls:
        for mode in modes:
            try:
                r = run_once(model, calls, mode, args)
            except Exception as e:  # one failed configuration (e.g. out of memory) must not lose the rest
                print(f"| {calls} | {mode} | failed: {type(e).__name__}: {e} |", flush=True)
                failures.append({"calls": calls, "decoder_mode": mode, "error": f"{type(e).__name__}: {e}"})
                continue
            results.append(r)
            print(format_row(r), flush=True)
    if args.json:
        out = {
            "benchmark": "engine",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "host": platform.node(),
            "machine": platform.machine(),
            "model": str(args.model),
            "precision": model.info.precision,
            "device": model.info.device,
            "command": " ".join(sys.argv),
            "cpu_count": os.cpu_count(),
            "load_average_at_end": os.getloadavg(),
            "runs": [asdict(r) for r in results],
            "failures": failures,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    from asr_core import configure_process

    configure_process()  # before main() loads the model (and mlx)
    parser = argparse.ArgumentParser(prog="python -m tools.bench.engine", description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
