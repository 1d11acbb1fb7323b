"""Thin asyncio adapters around the pure cores: one shared SIP socket for every call, one RTP socket
per call, and one pacer task that sends every call's packets at their deadlines.

All times are `time.monotonic()` (uvloop's `loop.time()` is cached per loop iteration at 1 ms
resolution, too coarse for send-jitter numbers); timers are armed with `call_later`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import heapq
import itertools
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from gateway.rtp.packet import is_rtcp
from tools.replay import sipmsg
from tools.replay.rtp import RtpStream
from tools.replay.uac import Output, Send, UacCall

logger = logging.getLogger(__name__)

now = time.monotonic


# --- SIP -------------------------------------------------------------------------------------------


class _SipUdp(asyncio.DatagramProtocol):
    def __init__(self, endpoint: SipEndpoint) -> None:
        self.endpoint = endpoint

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.endpoint.on_message(data, addr)

    def error_received(self, exc: Exception) -> None:
        self.endpoint.transport_errors += 1  # ICMP port unreachable: nothing listens at the target


class _SipTcp(asyncio.Protocol):
    def __init__(self, endpoint: SipEndpoint) -> None:
        self.endpoint = endpoint
        self.framer = sipmsg.StreamFramer()

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.framer.feed(data)
        except sipmsg.SipParseError:
            self.endpoint.parse_errors += 1
            self.framer = sipmsg.StreamFramer()
            return
        for frame in frames:
            self.endpoint.on_message(frame, self.endpoint.target)

    def connection_lost(self, exc: Exception | None) -> None:
        self.endpoint.connection_lost = True


class SipEndpoint:
    """Every call's SIP over one UDP socket (or one TCP connection), dispatched by Call-ID.
    Requests go to the target, as through an outbound proxy; responses to the request's source."""

    def __init__(self, transport: str, local_ip: str, local_port: int, target: tuple[str, int]) -> None:
        self.transport_name = transport.upper()
        self.local_ip = local_ip
        self.local_port = local_port
        self.target = target
        self._transport: asyncio.BaseTransport | None = None
        self._calls: dict[str, tuple[UacCall, Callable[[list[Output]], None]]] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._lingering: dict[str, asyncio.TimerHandle] = {}
        self.sent = 0
        self.received = 0
        self.parse_errors = 0
        self.stray = 0
        self.transport_errors = 0
        self.connection_lost = False

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        transport: asyncio.BaseTransport
        if self.transport_name == "UDP":
            transport, _ = await loop.create_datagram_endpoint(
                lambda: _SipUdp(self), local_addr=(self.local_ip, self.local_port)
            )
        else:
            transport, _ = await loop.create_connection(
                lambda: _SipTcp(self),
                self.target[0],
                self.target[1],
                local_addr=(self.local_ip, self.local_port),
            )
        self._transport = transport
        self.local_port = transport.get_extra_info("sockname")[1]

    def close(self) -> None:
        for handle in [*self._timers.values(), *self._lingering.values()]:
            handle.cancel()
        self._timers.clear()
        self._lingering.clear()
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def _send(self, data: bytes, addr: tuple[str, int] | None = None) -> None:
        tr = self._transport
        if tr is None or tr.is_closing():
            self.transport_errors += 1
            return
        self.sent += 1
        # uvloop's transports do not subclass asyncio's, so dispatch on what was opened.
        if self.transport_name == "UDP":
            cast(asyncio.DatagramTransport, tr).sendto(data, addr or self.target)
        else:
            cast(asyncio.WriteTransport, tr).write(data)

    def add(self, call: UacCall, handler: Callable[[list[Output]], None]) -> None:
        self._calls[call.p.call_id] = (call, handler)

    def start(self, call: UacCall) -> None:
        self._carry_out(call, call.start(now()))

    def hangup(self, call: UacCall) -> None:
        self._carry_out(call, call.hangup(now()))

    def _carry_out(
        self, call: UacCall, outputs: list[Output], reply_to: tuple[str, int] | None = None
    ) -> None:
        events: list[Output] = []
        for out in outputs:
            if isinstance(out, Send):
                self._send(out.data, reply_to)
            else:
                events.append(out)
        self._rearm(call)
        entry = self._calls.get(call.p.call_id)
        if events and entry is not None:
            entry[1](events)
        if call.done and call.p.call_id not in self._lingering:
            # Keep a finished call for Timer D (32 s on UDP): a retransmitted final response still
            # gets its ACK (§17.1.1.2). Then forget it, so memory does not grow with the run.
            linger = 0.0 if call.p.reliable else 64 * call.p.t1_s
            loop = asyncio.get_running_loop()
            self._lingering[call.p.call_id] = loop.call_later(linger, self._forget, call.p.call_id)

    def _forget(self, call_id: str) -> None:
        self._lingering.pop(call_id, None)
        self._calls.pop(call_id, None)
        handle = self._timers.pop(call_id, None)
        if handle is not None:
            handle.cancel()

    @property
    def calls_tracked(self) -> int:
        return len(self._calls)

    def _rearm(self, call: UacCall) -> None:
        cid = call.p.call_id
        old = self._timers.pop(cid, None)
        if old is not None:
            old.cancel()
        deadline = call.next_deadline()
        if deadline is not None:
            loop = asyncio.get_running_loop()
            self._timers[cid] = loop.call_later(max(0.0, deadline - now()), self._on_timer, call)

    def _on_timer(self, call: UacCall) -> None:
        self._timers.pop(call.p.call_id, None)
        self._carry_out(call, call.handle_timer(now()))

    def on_message(self, data: bytes, addr: tuple[str, int]) -> None:
        if not data.strip():
            return  # keep-alive (RFC 5626 CRLF)
        self.received += 1
        try:
            msg = sipmsg.parse(data)
        except sipmsg.SipParseError as exc:
            self.parse_errors += 1
            logger.debug("unparsable SIP from %s: %s", addr, exc)
            return
        entry = self._calls.get(msg.call_id)
        if entry is None:
            if msg.is_request and msg.method != "ACK":
                code, reason = (
                    (200, "OK") if msg.method == "OPTIONS" else (481, "Call/Transaction Does Not Exist")
                )
                self._send(sipmsg.response_to(msg, code, reason), addr)
            else:
                self.stray += 1
            return
        call = entry[0]
        self._carry_out(call, call.receive(msg, now()), reply_to=addr if msg.is_request else None)


# --- RTP -------------------------------------------------------------------------------------------


class RtpSocket:
    """One call's RTP socket: bound before the INVITE (its port goes into the SDP offer), connected to
    the answer's address, so sends need no address and the kernel filters what comes back."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.port: int = sock.getsockname()[1]
        self.received = 0  # RTP that came back (sipp -rtp_echo echoes; the gateway sends none)
        self.rtcp_received = 0  # RTCP on the same port (rtcp-mux: the gateway's receiver reports)
        self.send_errors = 0
        self._reading = False

    def connect(self, remote: tuple[str, int]) -> None:
        self.sock.connect(remote)
        asyncio.get_running_loop().add_reader(self.sock.fileno(), self._on_readable)
        self._reading = True

    def _on_readable(self) -> None:
        while True:
            try:
                data = self.sock.recv(2048)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # ICMP errors surface here on a connected socket
                self.send_errors += 1
                return
            if is_rtcp(data):
                self.rtcp_received += 1
            else:
                self.received += 1

    def send(self, data: bytes) -> bool:
        try:
            self.sock.send(data)
            return True
        except OSError:  # full send buffer or an ICMP error from an earlier packet: a lost packet
            self.send_errors += 1
            return False

    def close(self) -> None:
        if self._reading:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self._reading = False
        self.sock.close()


def even_ports(port_min: int, port_max: int) -> range:
    """The even ports of a range, where RTP goes (RFC 3550 §11). The replay takes RTCP on the same port
    (rtcp-mux), so, unlike the gateway's pairs (`gateway.rtp.ports.rtp_pair_ports`), an even port at the
    top of the range counts."""
    return range(port_min + (port_min & 1), port_max + 1, 2)


class RtpPortPool:
    """Even ports from a range (`even_ports`), taken round robin, skipping busy ones."""

    def __init__(self, ip: str, port_min: int, port_max: int) -> None:
        self.ip = ip
        self._ports = list(even_ports(port_min, port_max))
        if not self._ports:
            raise ValueError(f"no even port in {port_min}-{port_max}")
        self._cursor = 0

    def open(self) -> RtpSocket:
        family = socket.AF_INET6 if ":" in self.ip else socket.AF_INET
        for _ in range(len(self._ports)):
            port = self._ports[self._cursor]
            self._cursor = (self._cursor + 1) % len(self._ports)
            sock = socket.socket(family, socket.SOCK_DGRAM)
            try:
                sock.bind((self.ip, port))
            except OSError as exc:
                sock.close()
                if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                    continue
                raise
            sock.setblocking(False)
            return RtpSocket(sock)
        raise OSError(errno.EADDRINUSE, f"no free even RTP port in {self._ports[0]}-{self._ports[-1]}")


@dataclass(eq=False)
class _Flow:
    stream: RtpStream
    sock: RtpSocket
    done: asyncio.Future[None]
    pending: int = 0  # impaired packets still waiting in the heap
    stopped: bool = False
    sent: int = field(default=0)

    def finish_if_done(self) -> None:
        if (self.stopped or self.stream.done) and self.pending == 0 and not self.done.done():
            self.done.set_result(None)


def _wake_up(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Pacer:
    """One task sends every call's packets: a heap of (due time, flow) entries for the next packet of
    each call and for packets an impairment delayed. Deadlines are absolute (t0 + k·ptime).

    Each wake-up also sends what falls due within `slack_s` after it: waking the loop costs far more than
    sending a packet (tens of µs against a few), and calls' packet phases are spread over the ptime, so
    without coalescing every packet would cost a wake-up. A packet leaves at most `slack_s` early."""

    def __init__(self, slack_s: float = 0.001) -> None:
        self.slack_s = slack_s
        self._heap: list[tuple[float, int, _Flow, bytes | None]] = []
        self._count = itertools.count()
        self._wake: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.flows: list[_Flow] = []
        self.packets_sent = 0

    def add(self, stream: RtpStream, sock: RtpSocket) -> _Flow:
        flow = _Flow(stream, sock, asyncio.get_running_loop().create_future())
        self.flows.append(flow)
        deadline = stream.next_deadline()
        if deadline is None:
            flow.done.set_result(None)
            return flow
        self._push(deadline, flow, None)
        return flow

    def stop(self, flow: _Flow) -> None:
        flow.stopped = True
        flow.pending = 0
        flow.finish_if_done()

    def _push(self, when: float, flow: _Flow, data: bytes | None) -> None:
        heapq.heappush(self._heap, (when, next(self._count), flow, data))
        if self._heap[0][2] is flow and self._wake is not None and not self._wake.done():
            self._wake.set_result(None)  # an earlier deadline than the one we sleep for

    def _send(self, flow: _Flow, data: bytes) -> None:
        if flow.sock.send(data):
            flow.stream.sent += 1
            self.packets_sent += 1

    def _step(self) -> None:
        heap = self._heap
        horizon = now() + self.slack_s
        while heap and heap[0][0] <= horizon:
            _, _, flow, data = heapq.heappop(heap)
            if flow.stopped:
                continue
            if data is not None:  # a delayed (impaired) packet
                flow.pending -= 1
                self._send(flow, data)
                flow.finish_if_done()
                continue
            t = now()
            for delay, pkt in flow.stream.emit(t):
                if delay <= 0:
                    self._send(flow, pkt)
                else:
                    flow.pending += 1
                    heapq.heappush(heap, (t + delay, next(self._count), flow, pkt))
            nxt = flow.stream.next_deadline()
            if nxt is not None:
                heapq.heappush(heap, (nxt, next(self._count), flow, None))
            else:
                flow.finish_if_done()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._step()
            self._wake = loop.create_future()
            if self._heap:
                delay = self._heap[0][0] - now()
                self._timer = loop.call_later(max(0.0, delay), _wake_up, self._wake)
            try:
                await self._wake
            finally:
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
                self._wake = None
