"""Benchmark of the SIP side: message parsing, the UAS core, and call set-up/tear-down with sipp.

    ttg bench sip [--calls 1000] [--rate 100] [--hold-ms 1000] [--out bench.json]
    ttg bench sip --burst 2000 [--recv-buffers 0,4194304] [--out burst.json]

Runs the telephony front end on 127.0.0.1 (real SIP and RTP sockets, an ASR engine that only counts
samples, an in-memory event sink) and drives it with sipp's built-in `uac` scenario (INVITE, ACK, hold,
BYE), bounded in calls and time. Prints the numbers and writes them as JSON. Needs sipp (sip-tester).

`--burst N`: the SIP endpoint alone in a child process (UDP, each `--recv-buffers` size in turn; 0 =
the OS default), N OPTIONS sent from one socket as fast as the sender can, answers counted for a few
seconds: what the kernel drops when a burst outruns the event loop (TTG_SIP__UDP_RECV_BUFFER_BYTES).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from asr_core.api import EventCallback, StreamEnded, StreamOptions
from gateway.call.frontend import FrontEndConfig, TelephonyFrontEnd
from gateway.call.legs import LocalLegs
from gateway.events import CallEvent
from gateway.rtp.media import MediaConfig
from gateway.rtp.receiver import MediaManager
from gateway.sip.admission import AdmissionConfig
from gateway.sip.agent import AgentConfig, Flow, UserAgent
from gateway.sip.message import parse_message
from tools.ports import free_port

INVITE = (
    "INVITE sip:1000@127.0.0.1:5060 SIP/2.0\r\n"
    "Via: SIP/2.0/UDP 127.0.0.1:5070;branch=z9hG4bK-bench-{i};rport\r\n"
    "Max-Forwards: 70\r\n"
    'From: "Alice" <sip:alice@127.0.0.1:5070>;tag=uac-{i}\r\n'
    "To: <sip:1000@127.0.0.1:5060>\r\n"
    "Call-ID: bench-{i}@127.0.0.1\r\n"
    "CSeq: 1 {method}\r\n"
    "Contact: <sip:alice@127.0.0.1:5070>\r\n"
    "Content-Type: application/sdp\r\n"
    "Content-Length: {n}\r\n\r\n{sdp}"
)
SDP = (
    "v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
    "m=audio 6000 RTP/AVP 0 8 101\r\na=rtpmap:0 PCMU/8000\r\na=rtpmap:8 PCMA/8000\r\n"
    "a=rtpmap:101 telephone-event/8000\r\na=fmtp:101 0-15\r\na=ptime:20\r\na=sendrecv\r\n"
)


def message(i: int, method: str = "INVITE", body: str = SDP) -> bytes:
    return INVITE.format(i=i, method=method, n=len(body), sdp=body).encode()


class _CountingStream:
    def __init__(self, stream_id: str, on_event: EventCallback) -> None:
        self.stream_id, self.on_event, self.samples = stream_id, on_event, 0

    def push(self, pcm: np.ndarray) -> None:
        self.samples += len(pcm)

    def finish(self) -> None:
        self.on_event(StreamEnded(self.stream_id, "finished", audio_ms=self.samples // 16))

    def close(self) -> None:
        self.on_event(StreamEnded(self.stream_id, "closed"))


class _CountingEngine:
    def open_stream(self, stream_id: str, options: StreamOptions, on_event: EventCallback) -> _CountingStream:
        return _CountingStream(stream_id, on_event)


class _Sink:
    def __init__(self) -> None:
        self.events = 0

    def publish(self, ev: CallEvent) -> None:
        self.events += 1


def bench_core(n: int) -> dict[str, float]:
    data = [message(i) for i in range(n)]
    t = time.perf_counter()
    for d in data:
        parse_message(d)
    parse_us = (time.perf_counter() - t) / n * 1e6
    ua = UserAgent(AgentConfig(host="127.0.0.1", port=5060))
    flow = Flow("udp", ("127.0.0.1", 5070))
    options = [message(i, "OPTIONS", "") for i in range(n)]
    t = time.perf_counter()
    for d in options:
        ua.receive(d, flow, 0.0)
    options_us = (time.perf_counter() - t) / n * 1e6
    return {"invite_bytes": len(data[0]), "parse_invite_us": parse_us, "uas_options_us": options_us}


async def bench_calls(calls: int, rate: float, hold_ms: int, workdir: Path) -> dict[str, Any]:
    sipp = shutil.which("sipp")
    if sipp is None:
        raise SystemExit("sipp not found (Debian package sip-tester)")
    media = MediaManager(
        MediaConfig(idle_fill_after_s=0.0, inactivity_timeout_s=0.0),
        host="127.0.0.1",
        port_min=40000,
        port_max=48000,
        quarantine_s=0.0,
    )
    cfg = FrontEndConfig(sip_host="127.0.0.1", sip_port=0, admission=AdmissionConfig(max_calls=calls))
    sink = _Sink()
    frontend = TelephonyFrontEnd(cfg, LocalLegs(_CountingEngine(), media), sink)
    await frontend.start()
    stats_file = workdir / "sipp_stats.csv"
    cmd = [
        sipp, f"127.0.0.1:{frontend.sip_port}", "-sn", "uac", "-i", "127.0.0.1", "-p", str(free_port()),
        "-r", str(rate), "-m", str(calls), "-l", str(calls), "-d", str(hold_ms),
        "-nostdin", "-timeout", f"{int(calls / rate + hold_ms / 1000 + 60)}s",
        "-trace_stat", "-stf", str(stats_file),
    ]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *cmd, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    await proc.wait()
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF)
    await frontend.close(timeout_s=5)
    lines = stats_file.read_text().splitlines()
    stats = dict(zip(lines[0].split(";"), lines[-1].split(";"), strict=False))
    ok = int(stats.get("SuccessfulCall(C)", "0"))
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "calls": calls,
        "rate_cps": rate,
        "hold_ms": hold_ms,
        "successful": ok,
        "failed": int(stats.get("FailedCall(C)", "0")),
        "wall_s": wall,
        "gateway_cpu_s": cpu,
        "gateway_cpu_ms_per_call": 1000 * cpu / max(ok, 1),
        "setup_time_avg": stats.get("ResponseTime1(C)", ""),  # sipp: INVITE sent -> 200 received
        "events_published": sink.events,
        "sipp_returncode": proc.returncode,
    }


def _burst_server(port: int, recv_buffer: int, ready: Any, stop: Any) -> None:
    """Child process: one SIP endpoint (UDP only) answering OPTIONS until `stop` is set."""

    class _NoCalls:
        def on_sip_event(self, event: object) -> None:
            pass

    async def serve() -> None:
        from gateway.sip.endpoint import SipEndpoint, TransportConfig

        agent = UserAgent(AgentConfig(host="127.0.0.1", port=port, max_transactions=1_000_000))
        transport = TransportConfig(udp_recv_buffer_bytes=recv_buffer)
        endpoint = SipEndpoint(agent, _NoCalls(), host="127.0.0.1", port=port, tcp=False, transport=transport)
        await endpoint.start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await endpoint.close()

    asyncio.run(serve())


def bench_burst(n: int, recv_buffer: int, settle_s: float = 5.0) -> dict[str, Any]:
    import multiprocessing
    import socket

    ctx = multiprocessing.get_context("spawn")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    ready, stop = ctx.Event(), ctx.Event()
    server = ctx.Process(target=_burst_server, args=(port, recv_buffer, ready, stop), daemon=True)
    server.start()
    try:
        if not ready.wait(60):
            raise SystemExit("the burst server did not start")
        tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        tx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)  # our side must not drop answers
        tx.bind(("127.0.0.1", 0))
        local = tx.getsockname()[1]
        via = f"127.0.0.1:{local}".encode()
        datagrams = [message(i, "OPTIONS", "").replace(b"127.0.0.1:5070", via) for i in range(n)]
        t0 = time.perf_counter()
        for d in datagrams:
            tx.sendto(d, ("127.0.0.1", port))
        send_s = time.perf_counter() - t0
        answered = 0
        tx.settimeout(settle_s)
        try:
            while answered < n:
                tx.recv(65536)
                answered += 1
        except TimeoutError:
            pass
        tx.close()
    finally:
        stop.set()
        server.join(10)
    return {
        "requests": n,
        "recv_buffer_asked": recv_buffer,
        "answered": answered,
        "lost_pct": round(100 * (n - answered) / n, 1),
        "send_s": round(send_s, 3),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=100.0, help="new calls per second")
    parser.add_argument("--hold-ms", type=int, default=1000, help="how long each call stays up")
    parser.add_argument("--core-messages", type=int, default=20000)
    parser.add_argument("--out", type=Path, default=None, help="write the numbers as JSON here")
    parser.add_argument("--burst", type=int, default=0, help="measure a burst of N OPTIONS instead")
    parser.add_argument(
        "--recv-buffers", default=f"0,{4 << 20}", help="SIP UDP receive buffer sizes to compare (bytes)"
    )


def main(args: argparse.Namespace) -> int:
    if args.burst:
        runs = [bench_burst(args.burst, int(size)) for size in args.recv_buffers.split(",")]
        for r in runs:
            print(
                f"{r['requests']} OPTIONS in {r['send_s']:.3f} s, receive buffer "
                f"{r['recv_buffer_asked'] or 'OS default'}: {r['answered']} answered ({r['lost_pct']}% lost)"
            )
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"burst": runs}, indent=2) + "\n")
        return 0
    result: dict[str, Any] = {"core": bench_core(args.core_messages)}
    core = result["core"]
    print(f"parse INVITE ({core['invite_bytes']} B): {core['parse_invite_us']:.1f} us")
    print(f"UAS core OPTIONS -> 200:  {core['uas_options_us']:.1f} us")
    with tempfile.TemporaryDirectory(prefix="ttg-bench-sip-") as tmp:
        calls = asyncio.run(bench_calls(args.calls, args.rate, args.hold_ms, Path(tmp)))
    result["calls"] = calls
    print(
        f"{calls['calls']} calls at {calls['rate_cps']:g} cps, {calls['hold_ms']} ms each: "
        f"{calls['successful']} ok, {calls['failed']} failed, wall {calls['wall_s']:.1f} s, "
        f"gateway CPU {calls['gateway_cpu_s']:.1f} s ({calls['gateway_cpu_ms_per_call']:.2f} ms/call), "
        f"INVITE->200 avg {calls['setup_time_avg']}"
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if calls["failed"] == 0 and calls["successful"] == calls["calls"] else 1


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(_parser)
    raise SystemExit(main(_parser.parse_args()))
