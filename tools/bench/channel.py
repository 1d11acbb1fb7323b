"""Chunk transport between processes: the shared-memory channel against pipes, per message cost.

    python -m tools.bench.channel                          # paced at 2,000 calls' chunk rate, then flat out
    python -m tools.bench.channel --rate 6250 --seconds 5 --transports shm,pipe,queue

A writer process sends mel-chunk-sized messages (8-byte stamp + 32 x 128 float32 = 16 KiB, what a media
worker sends per call every 320 ms) to a reader in this process, which touches every byte (a sum) as
the engine would when it copies the chunk out:
- `shm`: asr_core.channel (records in a shared-memory ring, positions over a socket, one flush per
  batch of `--batch` messages: what a media worker does per event-loop turn);
- `pipe`: multiprocessing.Pipe, `send_bytes` of the same bytes per message (kernel copies, no pickle);
- `queue`: multiprocessing.Queue of numpy arrays (pickled, a feeder thread, a lock).

Paced (`--rate` messages/s, the writer sleeping between batches): CPU time per message on each side
(`time.process_time` of the process) and the latency from the writer's stamp to the reader (same
monotonic clock). Flat out: messages per second. Prints a table and writes JSON to `--out`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import select
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from asr_core.channel import ChannelReader, channel_pair

SHAPE = (32, 128)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate", type=float, default=6250.0, help="paced messages per second")
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each paced run")
    parser.add_argument("--flat-messages", type=int, default=20000, help="messages of the flat-out run")
    parser.add_argument("--batch", type=int, default=8, help="messages per flush (shm) / per wake-up")
    parser.add_argument("--transports", default="shm,pipe,queue")
    parser.add_argument("--out", default="var/bench/channel.json")


_SHM_WRITER = textwrap.dedent(
    """
    import sys, time, select, numpy as np
    from asr_core.channel import ChannelEnd, ChannelWriter
    w = ChannelWriter.open(ChannelEnd.decode(sys.argv[1]))
    n, rate, batch = int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    mel = np.random.default_rng(0).standard_normal((32, 128)).astype(np.float32)
    t0 = time.monotonic(); c0 = time.process_time()
    for i in range(n):
        if rate > 0 and i % batch == 0:
            due = t0 + i / rate
            d = due - time.monotonic()
            if d > 0:
                time.sleep(d)
        stamp = np.float64(time.monotonic()).tobytes()
        while not w.write(1, stamp, mel):
            w.flush(); select.select([w.fileno()], [], [], 0.01)
        if i % batch == batch - 1:
            w.flush()
    w.flush()
    print(time.process_time() - c0, flush=True)
    select.select([w.fileno()], [], [], 5.0)
    w.close()
    """
)


def _paced(n: int, rate: float, batch: int) -> Iterator[int]:
    """0 .. n-1, each batch's first message not before its time at `rate` per second (0: flat out)."""
    t0 = time.monotonic()
    for i in range(n):
        if rate > 0 and i % batch == 0:
            d = t0 + i / rate - time.monotonic()
            if d > 0:
                time.sleep(d)
        yield i


def _pipe_writer(conn: Any, n: int, rate: float, batch: int, out: Any) -> None:
    mel = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    c0 = time.process_time()
    for _ in _paced(n, rate, batch):
        conn.send_bytes(np.float64(time.monotonic()).tobytes() + mel.tobytes())
    out.put(time.process_time() - c0)
    conn.close()


def _queue_writer(q: Any, n: int, rate: float, batch: int, out: Any) -> None:
    mel = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    c0 = time.process_time()
    for _ in _paced(n, rate, batch):
        q.put((time.monotonic(), mel))
    q.put(None)
    q.close()
    q.join_thread()
    out.put(time.process_time() - c0)


def _summary(lat: list[float], n: int, wall: float, reader_cpu: float, writer_cpu: float) -> dict[str, Any]:
    a = np.array(lat) * 1000
    return {
        "messages": n,
        "wall_s": wall,
        "messages_per_s": n / wall,
        "reader_us_per_msg": 1e6 * reader_cpu / n,
        "writer_us_per_msg": 1e6 * writer_cpu / n,
        "latency_ms_p50": float(np.percentile(a, 50)),
        "latency_ms_p99": float(np.percentile(a, 99)),
        "latency_ms_max": float(a.max()),
    }


def run_shm(n: int, rate: float, batch: int) -> dict[str, Any]:
    writer_end, _, memory, (a, b) = channel_pair(8 << 20)
    child = subprocess.Popen(
        [sys.executable, "-c", _SHM_WRITER, writer_end.encode(), str(n), str(rate), str(batch)],
        pass_fds=writer_end.fds(),
        stdout=subprocess.PIPE,
        text=True,
    )
    a.close()
    reader = ChannelReader(memory, b)
    lat: list[float] = []
    acc = 0.0
    t0, c0 = time.monotonic(), time.process_time()
    while len(lat) < n and not reader.closed:
        select.select([reader], [], [], 1.0)
        for _, view in reader.poll():
            lat.append(time.monotonic() - float(np.frombuffer(view[:8], np.float64)[0]))
            acc += float(np.frombuffer(view[8:], np.float32).sum())
        reader.release()
    wall, cpu = time.monotonic() - t0, time.process_time() - c0
    writer_cpu = float(child.communicate(timeout=30)[0].split()[0])
    reader.close()
    return _summary(lat, n, wall, cpu, writer_cpu)


def run_pipe(n: int, rate: float, batch: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    out = ctx.Queue()
    p = ctx.Process(target=_pipe_writer, args=(send, n, rate, batch, out))
    p.start()
    send.close()
    lat: list[float] = []
    acc = 0.0
    t0, c0 = time.monotonic(), time.process_time()
    while len(lat) < n:
        data = recv.recv_bytes()
        lat.append(time.monotonic() - float(np.frombuffer(data[:8], np.float64)[0]))
        acc += float(np.frombuffer(data[8:], np.float32).sum())
    wall, cpu = time.monotonic() - t0, time.process_time() - c0
    writer_cpu = out.get(timeout=30)
    p.join(10)
    return _summary(lat, n, wall, cpu, writer_cpu)


def run_queue(n: int, rate: float, batch: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue(maxsize=4096)
    out = ctx.Queue()
    p = ctx.Process(target=_queue_writer, args=(q, n, rate, batch, out))
    p.start()
    lat: list[float] = []
    acc = 0.0
    t0, c0 = time.monotonic(), time.process_time()
    while True:
        item = q.get()
        if item is None:
            break
        stamp, mel = item
        lat.append(time.monotonic() - stamp)
        acc += float(mel.sum())
    wall, cpu = time.monotonic() - t0, time.process_time() - c0
    writer_cpu = out.get(timeout=30)
    p.join(10)
    return _summary(lat, n, wall, cpu, writer_cpu)


RUNNERS = {"shm": run_shm, "pipe": run_pipe, "queue": run_queue}


def main(args: argparse.Namespace) -> int:
    results: dict[str, Any] = {"rate": args.rate, "batch": args.batch, "paced": {}, "flat": {}}
    names = [t.strip() for t in args.transports.split(",") if t.strip()]
    paced_n = int(args.rate * args.seconds)
    for name in names:
        results["paced"][name] = RUNNERS[name](paced_n, args.rate, args.batch)
        results["flat"][name] = RUNNERS[name](args.flat_messages, 0.0, args.batch)
    print(
        f"16 KiB messages; paced at {args.rate:.0f}/s for {args.seconds:g} s, "
        f"then {args.flat_messages} flat out"
    )
    print("| transport | reader µs/msg | writer µs/msg | latency p50 / p99 / max ms | flat out msg/s |")
    print("| --- | --- | --- | --- | --- |")
    for name in names:
        p, f = results["paced"][name], results["flat"][name]
        print(
            f"| {name} | {p['reader_us_per_msg']:.1f} | {p['writer_us_per_msg']:.1f} | "
            f"{p['latency_ms_p50']:.2f} / {p['latency_ms_p99']:.2f} / {p['latency_ms_max']:.1f} | "
            f"{f['messages_per_s']:.0f} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    sys.exit(main(p.parse_args()))
