"""Media receive-path costs: per packet (pure core), per block (decode + resample), and real UDP intake.

    python -m tools.bench.media                       # all three, prints a table, writes JSON
    python -m tools.bench.media --calls 200 --seconds 10 --loop uvloop

1. core: `MediaCore.datagram` over pre-built 20 ms PCMU packets on a fake clock (parse, latching,
   A.1 sequence checks, jitter buffer, timeline, G.711, resampling and block events, amortized).
2. blocks: the per-block work alone (table decode + soxr upsampling of one block), per block size, and
   soxr's own ResampleStream for comparison.
3. udp: N concurrent calls of real-time RTP over loopback from a separate sender process into one
   `MediaManager` (one socket pair per call, as in the daemon); the receiver's CPU time per packet
   (user + system, so the kernel's receive work is in it) and its share of a core. `--front-end`: each
   call's blocks also go through its ASR front end (log-mel, chunking, voice activity; the embedded demo
   model's, or `--model`'s), as in a media worker: the numbers are then a media worker's work per call,
   all but the chunks' hand-over to the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing as mp
import os
import resource
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import soxr

from asr_core.frontend import FrontEndFactory, FrontEndSpec, StreamFrontEnd
from gateway.audio import g711
from gateway.audio.pipeline import AudioPipeline
from gateway.rtp.media import MediaConfig, MediaCore
from gateway.rtp.packet import parse_rtp
from gateway.rtp.receiver import MediaManager
from gateway.rtp.sender import RtpSender
from gateway.sdp import MediaPlan

PLAN = MediaPlan(0, "PCMU", 0, "127.0.0.1", 9, 10, dtmf_payload_type=101, cn_payload_type=13)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--packets", type=int, default=20_000, help="packets for the pure-core measurement")
    parser.add_argument("--calls", type=int, default=100, help="concurrent calls for the UDP measurement")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of the UDP measurement")
    parser.add_argument("--loop", choices=["asyncio", "uvloop", "both"], default="both")
    parser.add_argument("--block-ms", type=int, default=80)
    parser.add_argument(
        "--spread", action="store_true",
        help="calls' packets spread evenly over each 20 ms (as independent phones send) instead of one burst",
    )  # fmt: skip
    parser.add_argument(
        "--intake-tick-ms", type=float, nargs="+", default=[0.0],
        help="receiver's RTP intake tick(s) to compare (`TTG_RTP__INTAKE_TICK_MS`: every call's sockets "
        "read in batches every this many ms; 0: each socket on the event loop)",
    )  # fmt: skip
    parser.add_argument(
        "--front-end", action="store_true",
        help="UDP: run each call's ASR front end on its blocks (a media worker's whole work per call)",
    )  # fmt: skip
    parser.add_argument("--model", default=None, help="--front-end: the bundle (default: the embedded demo)")
    parser.add_argument(
        "--resample", choices=["batched", "alone"], nargs="+", default=["batched"],
        help="UDP: the receiver's calls resampled together once a loop turn (as in the daemon), or each "
        "call's blocks as they come; several: one run each, in turn",
    )  # fmt: skip
    parser.add_argument("--skip-udp", action="store_true")
    parser.add_argument("--out", default="var/bench/media.json", help="where to save the numbers")


def _speech(n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    t = np.arange(n) / 8000
    return (6000 * np.sin(2 * np.pi * 440 * t) + rng.normal(0, 800, n)).astype(np.int16)


def _core_us_per_packet(data: list[bytes], block_ms: int) -> float:
    addr = ("127.0.0.1", 5000)
    core = MediaCore(PLAN, MediaConfig(block_ms=block_ms, idle_fill_after_s=0.0), 0.0)
    core.datagram(data[0], addr, 0.0)
    core.handle_timer(0.1)  # end of priming
    t = time.process_time()
    for i, d in enumerate(data[1:], 1):
        core.datagram(d, addr, 0.1 + i * 0.02)
        core.next_deadline()  # the adapter asks after every packet
    return (time.process_time() - t) / (len(data) - 1) * 1e6


def bench_core(n_packets: int, block_ms: int, repeats: int = 7) -> dict[str, float]:
    """CPU time (process_time, so waiting for a shared CPU does not count), best of `repeats`."""
    sender = RtpSender("PCMU", seq=1, timestamp=0, ssrc=7).audio(_speech(160 * n_packets))
    data = [p.data for p in sender.packets]
    parse = []
    for _ in range(repeats):
        t = time.process_time()
        for d in data:
            parse_rtp(d)
        parse.append((time.process_time() - t) / len(data) * 1e6)
    return {
        "parse_us_per_packet": min(parse),
        # 1 s blocks: the per-block work is spread over 50 packets, what is left is the per-packet work.
        "core_us_per_packet_excluding_blocks": min(_core_us_per_packet(data, 1000) for _ in range(repeats)),
        "core_us_per_packet": min(_core_us_per_packet(data, block_ms) for _ in range(repeats)),
        "block_ms": block_ms,
    }


def bench_blocks(repeats: int = 7) -> dict[str, float]:
    out: dict[str, float] = {}
    codes = g711.encode(_speech(8000 * 20), "PCMU")
    for block_ms in (20, 80, 160, 320):
        n = 8 * block_ms
        best = float("inf")
        for _ in range(repeats):
            pipe = AudioPipeline("PCMU", block_ms=block_ms)
            sink: list[Any] = []
            t = time.process_time()
            for i in range(0, len(codes), n):
                pipe.append_codes(codes[i : i + n], sink)
            best = min(best, (time.process_time() - t) / len(sink))
        out[f"pipeline_us_per_block_{block_ms}ms"] = best * 1e6
        out[f"pipeline_core_share_per_call_{block_ms}ms"] = best * (1000 / block_ms)  # CPU s per audio s
    x = (_speech(8000 * 20) / 32768).astype(np.float32)
    best = float("inf")
    for _ in range(repeats):
        stream = soxr.ResampleStream(8000, 16000, 1, dtype="float32", quality="HQ")
        t = time.process_time()
        for i in range(0, len(x), 640):
            stream.resample_chunk(x[i : i + 640])
        best = min(best, (time.process_time() - t) / (len(x) / 640))
    out["soxr_stream_us_per_80ms_chunk"] = best * 1e6
    return out


def _send_calls(ports: list[int], seconds: float, ready: Any, spread: bool = False) -> None:
    """Sender process: one socket per call, 20 ms PCMU, paced on absolute deadlines; `spread`: call i
    sends i/n of a period after call 0 (phones are not in phase), else all in one burst."""
    packets = [p.data for p in RtpSender("PCMU", seq=1, timestamp=0, ssrc=1).audio(_speech(160 * 50)).packets]
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in ports]
    ready.wait()
    t0 = time.monotonic()
    k = 0
    while True:
        due = t0 + k * 0.02
        now = time.monotonic()
        if now - t0 > seconds:
            break
        if due > now:
            time.sleep(due - now)
        pkt = packets[k % len(packets)]
        # Rewrite seq/timestamp so every packet is new (bytes 2-7).
        header = pkt[:2] + ((k + 1) & 0xFFFF).to_bytes(2, "big") + ((160 * k) & 0xFFFFFFFF).to_bytes(4, "big")
        data = header + pkt[8:]
        for i, (sock, port) in enumerate(zip(socks, ports, strict=True)):
            if spread:
                lag = due + 0.02 * i / len(socks) - time.monotonic()
                if lag > 0:
                    time.sleep(lag)
            sock.sendto(data, ("127.0.0.1", port))
        k += 1
    for sock in socks:
        sock.close()


class _CountingSink:
    blocks = 0

    def on_audio(self, pcm16k: np.ndarray, start_ms: int) -> None:
        _CountingSink.blocks += 1

    def on_dtmf(self, digit: str, start_ms: int, duration_ms: int) -> None:
        pass

    def on_inactive(self) -> None:
        pass


class _FrontEndSink(_CountingSink):
    """A media worker's leg without the hand-over: the blocks through the call's ASR front end."""

    def __init__(self, front: StreamFrontEnd) -> None:
        self.front = front
        self.chunks = 0

    def on_audio(self, pcm16k: np.ndarray, start_ms: int) -> None:
        super().on_audio(pcm16k, start_ms)
        self.chunks += len(self.front.push(pcm16k))


def _spec_of(model: str | None, conn: Any) -> None:
    """Child process: the model's front-end spec as the engine process writes it (MLX stays out of the
    measuring process, as it stays out of a media worker)."""
    from asr_core import configure_process

    configure_process()
    from asr_core.model import AsrModel, embedded_model_dir
    from asr_core.vad import VadConfig

    model_dir = model or embedded_model_dir()
    if model_dir is None:
        raise SystemExit("no --model given and this install has no embedded demo model")
    conn.send(AsrModel.load(model_dir).frontend_spec(vad=VadConfig()).to_json())


def front_end_factory(model: str | None) -> FrontEndFactory:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_spec_of, args=(model, theirs))
    proc.start()
    spec = ours.recv()
    proc.join()
    return FrontEndFactory(FrontEndSpec.from_json(spec))


async def _receive(
    calls: int,
    seconds: float,
    block_ms: int,
    spread: bool = False,
    tick_ms: float = 0.0,
    factory: FrontEndFactory | None = None,
    batched: bool = True,
) -> dict[str, Any]:
    config = MediaConfig(block_ms=block_ms, idle_fill_after_s=0.0)
    mgr = MediaManager(
        config,
        host="127.0.0.1",
        port_min=46000,
        port_max=46000 + 4 * calls + 200,
        intake_tick_s=tick_ms / 1000,
        batch_resample=batched,
    )
    sinks = [
        _CountingSink() if factory is None else _FrontEndSink(factory.stream(factory.spec.default_lookahead))
        for _ in range(calls)
    ]
    medias = [await mgr.open(PLAN, sink, name=f"bench{i}") for i, sink in enumerate(sinks)]
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    proc = ctx.Process(target=_send_calls, args=([m.port for m in medias], seconds, ready, spread))
    proc.start()
    await asyncio.sleep(0.2)
    ready.set()
    await asyncio.sleep(1.0)  # warm-up: priming, first blocks
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    p0 = sum(m.stats().packets_received for m in medias)
    w0 = time.monotonic()
    await asyncio.sleep(seconds - 1.5)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    p1 = sum(m.stats().packets_received for m in medias)
    batch = mgr.upsample_batch
    wall = time.monotonic() - w0
    # The calls keep receiving until the sender is done (a join on the loop's thread would leave its last
    # datagrams to the close, each call's passes resampled alone there).
    await asyncio.to_thread(proc.join)
    stats = [m.close() for m in medias]
    user = r1.ru_utime - r0.ru_utime
    system = r1.ru_stime - r0.ru_stime
    cpu = user + system
    packets = p1 - p0
    return {
        "calls": calls,
        "front_end": factory is not None,
        # The encoder chunks the calls' front ends made (0 without --front-end).
        "chunks": sum(sink.chunks for sink in sinks if isinstance(sink, _FrontEndSink)),
        "spread": spread,
        "tick_ms": tick_ms,
        "resample": "batched" if batched else "alone",
        # Passes a batch run (over the whole run, warm-up included).
        "passes_per_batch": batch.passes / max(1, batch.runs) if batch is not None else 1.0,
        "packets_per_s": packets / wall,
        "cpu_us_per_packet": cpu / max(packets, 1) * 1e6,
        "user_us_per_packet": user / max(packets, 1) * 1e6,
        "system_us_per_packet": system / max(packets, 1) * 1e6,
        "core_share": cpu / wall,
        # RFC 3550 interarrival jitter, mean over the calls: the arrival times the receiver saw.
        "jitter_ms_mean": sum(s.jitter_ms for s in stats) / max(1, len(stats)),
        "lost": sum(s.lost for s in stats),
        "late": sum(s.late for s in stats),
    }


def bench_udp(
    calls: int,
    seconds: float,
    loop_kind: str,
    block_ms: int,
    spread: bool = False,
    tick_ms: float = 0.0,
    factory: FrontEndFactory | None = None,
    batched: bool = True,
) -> dict[str, Any]:
    receive = _receive(calls, seconds, block_ms, spread, tick_ms, factory, batched)
    if loop_kind == "uvloop":
        import uvloop

        return uvloop.run(receive)
    return asyncio.run(receive)


def main(args: argparse.Namespace) -> int:
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
    results["core"] = bench_core(args.packets, args.block_ms)
    results["blocks"] = bench_blocks()
    core = results["core"]
    print(f"parse_rtp                          {core['parse_us_per_packet']:7.2f} µs/packet")
    print(f"MediaCore.datagram, per packet     {core['core_us_per_packet_excluding_blocks']:7.2f} µs/packet")
    print(f"MediaCore.datagram, all work       {core['core_us_per_packet']:7.2f} µs/packet"
          f"  (block {args.block_ms} ms: G.711 decode + resample amortized)")  # fmt: skip
    for key, value in results["blocks"].items():
        unit = "% of a core per call" if "share" in key else "µs"
        print(f"{key:36s} {value * (100 if 'share' in key else 1):7.3f} {unit}")
    if not args.skip_udp:
        loops = ["asyncio", "uvloop"] if args.loop == "both" else [args.loop]
        results["udp"] = []  # one run per loop and tick, in the order run (a tick given twice runs twice)
        factory = front_end_factory(args.model) if args.front_end else None
        for kind, tick, how in itertools.product(loops, args.intake_tick_ms, args.resample):
            batched = how == "batched"
            r = bench_udp(args.calls, args.seconds, kind, args.block_ms, args.spread, tick, factory, batched)
            results["udp"].append({"loop": kind, **r})
            what = "UDP + front end" if args.front_end else "UDP"
            print(f"{what} {kind:8s} intake {tick:g} ms, resample {how} ({r['passes_per_batch']:.1f} a run), "
                  f"{r['calls']} calls: {r['packets_per_s']:.0f} pkt/s, "
                  f"{r['cpu_us_per_packet']:.2f} µs CPU/packet (user {r['user_us_per_packet']:.2f}, "
                  f"system {r['system_us_per_packet']:.2f}), {100 * r['core_share']:.1f} % of a core, "
                  f"jitter {r['jitter_ms_mean']:.2f} ms, lost {r['lost']}, late {r['late']}")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
