"""`ttg bench engine-procs`: the engine in its own process, fed by front-end processes, at N calls.

    ttg bench engine-procs --model DIR --calls 250 1000 2000 --feeders 8 --seconds 20 \\
        --decoder-mode device --max-batch 512 --json OUT

The gateway's process model without SIP, RTP and Redis: `asr_core.remote.EngineProcess` (MLX
encoder, scheduler, decoding) and `--feeders` processes (tools/bench/feeder.py) that each push
their share of N real-time synthetic calls through the front end and send the chunks over the
shared-memory channels; this process reads the results. So the engine's capacity is measured
without an interpreter lock shared with anything but itself.

Per N: encoder steps (batch mean/max, step time), queue wait, decoder step, final/partial latency
(from a chunk's audio to its transcript), the engine's lag (its STATUS records), dropped chunks,
whether the feeders kept real time, and each process's CPU (% of one core) and the GPU's utilisation.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from asr_core.api import StreamEnded
from asr_core.config import DecoderConfig, EngineConfig, SchedulerConfig
from asr_core.errors import EngineFullError
from asr_core.remote import EngineProcess
from asr_core.wire import Decode, Dropped, Event, Latency, Status, Step
from tools.bench.gateway import Sampler


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--precision", default="auto", choices=["auto", "f32", "f16", "bf16"])
    p.add_argument("--calls", type=int, nargs="+", default=[64])
    p.add_argument("--feeders", type=int, default=4)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--decoder-mode", default="batched", choices=["workers", "batched", "device"])
    p.add_argument("--workers", type=int, default=2, help="decoder threads (assembly only in device mode)")
    p.add_argument(
        "--device-thread",
        action="store_true",
        help="device mode: decode on a thread of its own beside the next step, not on the encoder's "
        "thread after each step",
    )
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--max-wait-ms", type=float, default=100.0)
    p.add_argument("--wait-policy", default="adaptive", choices=["adaptive", "fixed"])
    p.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="the engine process's interpreter-lock hand-over interval (default: Python's 5 ms, as the "
        "gateway's)",
    )
    p.add_argument(
        "--device-share",
        type=float,
        default=1.0,
        help="the part of the accelerator's memory this engine process may use, as the gateway gives each "
        "of N engines 1/N (default: all of it)",
    )
    p.add_argument(
        "--barrier",
        default=None,
        metavar="DIR:N",
        help="once the engine is ready, wait until N benches (this one included) are ready in DIR before the "
        "first level: several engine processes on one accelerator measured over the same seconds",
    )
    p.add_argument("--json", default=None)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def run(
    args: argparse.Namespace, engine: EngineProcess, spec_file: Path, n: int, level: int, sampler: Sampler
) -> dict[str, Any]:
    feeders = min(args.feeders, n)
    ends = engine.front_end_ends()[level * args.feeders : (level + 1) * args.feeders]
    per = [n // feeders + (1 if i < n % feeders else 0) for i in range(feeders)]
    procs = []
    key = 0
    t0 = time.monotonic()
    for i, calls in enumerate(per):
        cmd = [
            sys.executable, "-m", "tools.bench.feeder",
            "--channel", ends[i].encode(), "--spec", str(spec_file),
            "--calls", str(calls), "--seconds", str(args.seconds),
            "--first-key", str(key + (n << 20)),
            "--seed", str(key), "--role", f"feeder_{i}",
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, pass_fds=ends[i].fds(), stdout=subprocess.PIPE, text=True))
        sampler.others[f"feeder_{i}"] = procs[-1].pid
        key += calls
    steps: list[tuple[float, int]] = []
    waits: list[float] = []
    decodes: list[float] = []
    latency: dict[str, list[float]] = {"partial": [], "final": []}
    lag_max = 0.0
    dropped = errors = refused = ended = 0
    assert engine.results is not None
    deadline = time.monotonic() + args.seconds + 120
    while ended < n and time.monotonic() < deadline:
        select.select([engine.results], [], [], 0.5)
        for out in engine.read_results():
            if isinstance(out, Step):
                steps.append((out.seconds, out.batch))
                waits.extend(out.waits_s.tolist())
            elif isinstance(out, Decode):
                decodes.append(out.seconds)
            elif isinstance(out, Latency):
                latency[out.kind].append(out.seconds)
            elif isinstance(out, Dropped):
                dropped += 1
            elif isinstance(out, Status):
                lag_max = max(lag_max, float(out.values.get("lag_s", 0.0)))
            elif isinstance(out, Event) and isinstance(out.event, StreamEnded):
                ended += 1
                # A stream the engine refused at open (its pools full) ends at once with this error.
                full = (out.event.error or "").startswith(EngineFullError.__name__)
                refused += full
                errors += out.event.reason != "finished" and not full
        if not engine.poll_control():
            break
    t1 = time.monotonic()
    late = []
    for i, p in enumerate(procs):
        stdout, _ = p.communicate(timeout=60)
        sampler.others.pop(f"feeder_{i}", None)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
        if lines:
            late.append(json.loads(lines[-1])["late_max_s"])
    step_ms = [1000 * s for s, _ in steps]
    batches = [b for _, b in steps]
    return {
        "calls": n,
        "feeders": feeders,
        "ended": ended,
        "refused": refused,
        "not_finished": errors + (n - ended),
        "steps": len(steps),
        "batch_mean": round(float(np.mean(batches)), 1) if batches else None,
        "batch_max": max(batches) if batches else None,
        "step_ms_p50": round(_pct(step_ms, 50), 2),
        "step_ms_p90": round(_pct(step_ms, 90), 2),
        "queue_wait_ms_p95": round(1000 * _pct(waits, 95), 1),
        "decoder_ms_p50": round(1000 * _pct(decodes, 50), 2),
        "final_latency_ms_p50": round(1000 * _pct(latency["final"], 50), 1),
        "final_latency_ms_p95": round(1000 * _pct(latency["final"], 95), 1),
        "partial_latency_ms_p50": round(1000 * _pct(latency["partial"], 50), 1),
        "engine_lag_ms_max": round(1000 * lag_max, 1),
        "dropped_chunks": dropped,
        "feeder_late_ms_max": round(1000 * max(late), 1) if late else None,
        **sampler.window(t0, t1),
    }


def wait_for_peers(barrier: str, timeout_s: float = 600.0) -> None:
    """`DIR:N`: mark this bench ready in DIR, then wait until N are (each engine's start and warm-up take
    their own time, and the levels should overlap)."""
    folder, _, count = barrier.rpartition(":")
    if not folder or not count.isdigit() or int(count) < 1:
        raise SystemExit(f"--barrier {barrier!r}: expected DIR:N")
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / str(os.getpid())).touch()
    deadline = time.monotonic() + timeout_s
    while (ready := sum(1 for _ in path.iterdir())) < int(count):
        if time.monotonic() > deadline:
            raise SystemExit(f"--barrier: {ready} of {count} benches ready after {timeout_s:.0f} s")
        time.sleep(0.2)
    print(f"barrier: {count} benches ready", flush=True)


def main(args: argparse.Namespace) -> int:
    config = EngineConfig(
        scheduler=SchedulerConfig(
            max_batch=args.max_batch,
            max_wait_ms=args.max_wait_ms,
            max_queued_chunks=64,
            wait_policy=args.wait_policy,
        ),
        streams=max(args.calls),  # as the gateway sizes an engine's pools for its share of the calls
        decoder=DecoderConfig(mode=args.decoder_mode, workers=args.workers, device_thread=args.device_thread),
    )
    results = []
    print(f"host: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
    # One engine for every level (its compiled shapes and caches warm once); each level's feeders get
    # channels of their own, since a front end that exits ends its channel.
    engine = EngineProcess(
        args.model,
        args.precision,
        config,
        front_ends=args.feeders * len(args.calls),
        switch_interval_ms=args.switch_interval_ms,
        device_share=args.device_share,
    )
    t = time.monotonic()
    spec = engine.start(timeout=900)
    print(f"engine ready in {time.monotonic() - t:.1f} s ({engine.info})", flush=True)
    sampler = Sampler(engine.pid or 0, root_name="engine")
    sampler.start()
    try:
        if args.barrier:
            wait_for_peers(args.barrier)
        with tempfile.TemporaryDirectory() as tmp:
            spec_file = Path(tmp) / "spec.json"
            spec_file.write_text(json.dumps(spec.to_json()))
            for level, n in enumerate(args.calls):
                r = run(args, engine, spec_file, n, level, sampler)
                results.append(r)
                print(json.dumps(r), flush=True)
    finally:
        sampler.stop()
        exit_status = engine.shutdown(drain=False, timeout=10)
        engine.close()
    print(f"engine exit status {exit_status}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        report = {"command": " ".join(sys.argv), "results": results, "engine_exit": exit_status}
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if exit_status == 0 else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
