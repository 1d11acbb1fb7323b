"""Benchmark of the Redis sink: publish() cost, sustained throughput, spool replay speed.

    ttg bench sink [--events 100000] [--calls 200] [--url redis://...] [--out bench.json]

Without --url it starts its own redis-server (AOF off) on a free loopback port in a temp dir and stops
it by PID at the end. Prints a table and writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from gateway.events import CallEvent
from gateway.sink import ClientConfig, RedisSink, SinkConfig, StreamLayout


def _start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(workdir),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(200):
        try:
            if redis.Redis.from_url(url).ping():
                return proc, url
        except redis.ConnectionError:
            time.sleep(0.02)
    raise RuntimeError("redis-server did not start")


def _events(n: int, calls: int) -> list[CallEvent]:
    """A realistic mix: per call, ~3 partials per final, a DTMF now and then, start and end."""
    out: list[CallEvent] = []
    per_call = max(4, n // calls)
    for c in range(calls):
        cid = f"bench-{c:05d}"
        out.append(
            CallEvent("call_start", cid, f"{cid}@sip", ts=1.0, extra={"from": "sip:a@b", "to": "sip:c@d"})
        )
        for i in range(per_call - 2):
            if i % 4 == 3:
                text = "the quick brown fox jumps over the lazy dog " * 2
                out.append(CallEvent("final", cid, f"{cid}@sip", segment_id=i // 4, text=text, ts=1.0))
            elif i % 37 == 36:
                out.append(CallEvent("dtmf", cid, f"{cid}@sip", text="5", ts=1.0))
            else:
                out.append(
                    CallEvent("partial", cid, f"{cid}@sip", segment_id=i // 4, text="the quick brown", ts=1.0)
                )
        out.append(CallEvent("call_end", cid, f"{cid}@sip", ts=1.0, extra={"reason": "bye"}))
    # Interleave calls as they would be live.
    out.sort(key=lambda ev: (ev.type == "call_end", hash(ev.segment_id or 0) % 97, ev.call_id))
    return out


async def _throughput(url: str, spool: Path, events: list[CallEvent], batch_max: int) -> dict[str, Any]:
    sink = RedisSink.create(
        spool_dir=str(spool),
        layout=StreamLayout(),
        client_cfg=ClientConfig(url),
        sink_cfg=SinkConfig(max_buffered=len(events) + 1, batch_max=batch_max),
        metrics=False,
    )
    await sink.start()
    while not sink.core.redis_up:
        await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    publish_ns: list[int] = []
    for i, ev in enumerate(events):
        a = time.perf_counter_ns()
        sink.publish(ev)
        publish_ns.append(time.perf_counter_ns() - a)
        if i % 1000 == 999:
            await asyncio.sleep(0)  # let the publisher task run, as a live loop would
    while not sink.core.idle:
        await asyncio.sleep(0.001)
    elapsed = time.perf_counter() - t0
    await sink.close()
    return {
        "events": len(events),
        "seconds": elapsed,
        "events_per_s": len(events) / elapsed,
        "publish_us_p50": statistics.median(publish_ns) / 1000,
        "publish_us_p99": sorted(publish_ns)[int(0.99 * len(publish_ns))] / 1000,
    }


async def _replay(url: str, spool: Path, events: list[CallEvent], batch_max: int) -> dict[str, Any]:
    durable = [ev for ev in events if ev.durable]
    down = RedisSink.create(
        spool_dir=str(spool),
        layout=StreamLayout(stream="bench:replay"),
        client_cfg=ClientConfig("redis://127.0.0.1:1/0", retries=0),
        sink_cfg=SinkConfig(spill_after_s=0.0),
        metrics=False,
    )
    t0 = time.perf_counter()
    for ev in durable:
        down.publish(ev)
    await down.close(timeout_s=0.0)
    spool_s = time.perf_counter() - t0
    n = down.core.spool.pending
    size = down.core.spool.size
    up = RedisSink.create(
        spool_dir=str(spool),
        layout=StreamLayout(stream="bench:replay"),
        client_cfg=ClientConfig(url),
        sink_cfg=SinkConfig(batch_max=batch_max),
        metrics=False,
    )
    t0 = time.perf_counter()
    await up.start()
    while not up.core.idle:
        await asyncio.sleep(0.001)
    replay_s = time.perf_counter() - t0
    await up.close()
    return {
        "records": n,
        "spool_bytes": size,
        "spool_write_s": spool_s,
        "replay_s": replay_s,
        "replay_records_per_s": n / replay_s,
    }


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        proc = None
        url = args.url
        if url is None:
            proc, url = _start_redis(Path(tmp))
        try:
            events = _events(args.events, args.calls)
            result = {"throughput": await _throughput(url, Path(tmp) / "s1", events, args.batch_max)}
            result["replay"] = await _replay(url, Path(tmp) / "s2", events, args.batch_max)
            result["params"] = {"events": len(events), "calls": args.calls, "batch_max": args.batch_max}
            return result
        finally:
            if proc is not None:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(10)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--events", type=int, default=100_000)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--batch-max", type=int, default=500)
    p.add_argument("--url", help="an existing Redis (default: start a private redis-server)")
    p.add_argument("--out", type=Path, help="write the numbers as JSON here")


def main(args: argparse.Namespace) -> int:
    result = asyncio.run(_main(args))
    t, r = result["throughput"], result["replay"]
    print(
        f"sink throughput: {t['events']} events in {t['seconds']:.2f} s = {t['events_per_s']:,.0f} events/s"
    )
    print(f"publish() cost:  p50 {t['publish_us_p50']:.1f} µs, p99 {t['publish_us_p99']:.1f} µs")
    print(
        f"spool:           {r['records']} durable records ({r['spool_bytes'] / 1e6:.1f} MB) written in "
        f"{r['spool_write_s']:.2f} s, replayed in {r['replay_s']:.2f} s = {r['replay_records_per_s']:,.0f}/s"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
