"""How many calls one core of the replay tool can drive: the RTP sender alone (pacer + packetizer +
one socket per call), at a given ptime, into a UDP sink in another process.

    python -m tools.replay.bench --calls 100 200 400 --seconds 10 [--ptime 20] [--loop uvloop]

Prints, per call count: packets/s, the sender's CPU (process time / wall time), CPU per call, send
lateness p50/p99/max, and what the sink received. The numbers go into docs/replay.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np

from tools.replay.audio import AudioClip, plan_call, speech_segments
from tools.replay.config import Impairments
from tools.replay.net import Pacer, RtpPortPool
from tools.replay.rtp import LatenessHistogram, RtpStream

_SINK = r"""
import signal, socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1], flush=True)
n = 0
def stop(*_):
    print(n, flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
buf = bytearray(2048)
while True:
    s.recv_into(buf)
    n += 1
"""


def _clip(seconds: float) -> AudioClip:
    t = np.arange(int(seconds * 8000)) / 8000
    pcm = (8000 * np.sin(2 * np.pi * 300 * t) * (np.sin(2 * np.pi * 0.3 * t) > 0)).astype(np.int16)
    return AudioClip("bench", pcm, tuple(speech_segments(pcm, 600)))


async def measure(n_calls: int, seconds: float, ptime_ms: int, slack_s: float = 0.001) -> dict[str, Any]:
    sink = subprocess.Popen([sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
    assert sink.stdout is not None
    port = int(sink.stdout.readline())
    try:
        plan = plan_call([_clip(seconds)], ptime_ms, lead_ms=0, gap_ms=0, tail_ms=0)
        pool = RtpPortPool("127.0.0.1", 40000, 59998)
        pacer = Pacer(slack_s)
        runner = asyncio.create_task(pacer.run())
        socks = [pool.open() for _ in range(n_calls)]
        for sock in socks:
            sock.connect(("127.0.0.1", port))
        start = time.monotonic() + 0.2
        flows = []
        lateness = LatenessHistogram()
        for i, sock in enumerate(socks):
            # Calls start at random moments, so their packet phases spread over one ptime.
            t0 = start + (i / n_calls) * ptime_ms / 1000.0
            stream = RtpStream(plan, "PCMU", 0, t0, ptime_ms, Impairments(), random.Random(i), lateness)
            flows.append(pacer.add(stream, sock))
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        cpu0, wall0 = time.process_time(), time.monotonic()
        await asyncio.gather(*(f.done for f in flows))
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        runner.cancel()
        for s in socks:
            s.close()
    finally:
        sink.send_signal(signal.SIGTERM)
        received = int(sink.stdout.readline() or 0)
        sink.wait(5)
    sent = sum(f.stream.sent for f in flows)
    return {
        "calls": n_calls,
        "ptime_ms": ptime_ms,
        "packets_per_s": round(sent / wall),
        "cpu_percent": round(100 * cpu / wall, 1),
        "cpu_percent_per_call": round(100 * cpu / wall / n_calls, 3),
        "us_per_packet": round(1e6 * cpu / max(sent, 1), 1),
        "lateness_ms_p50": round(1000 * lateness.quantile(0.5), 2),
        "lateness_ms_p99": round(1000 * lateness.quantile(0.99), 2),
        "lateness_ms_max": round(1000 * lateness.max_s, 2),
        "sent": sent,
        "sink_received": received,
        "send_errors": sum(s.send_errors for s in socks),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, nargs="+", default=[50, 100, 200, 400])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--ptime", type=int, default=20)
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="uvloop")
    p.add_argument("--slack-ms", type=float, default=1.0, help="pacer coalescing window")
    args = p.parse_args(argv)
    factory = None
    if args.loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    for n in args.calls:
        with asyncio.Runner(loop_factory=factory) as r:
            row = r.run(measure(n, args.seconds, args.ptime, args.slack_ms / 1000.0))
        row["loop"] = args.loop
        row["slack_ms"] = args.slack_ms
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
