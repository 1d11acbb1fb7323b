"""The asyncio adapter of the SIP user agent: UDP and TCP sockets, one timer, metrics. Thin by design.

It feeds `UserAgent` with datagrams and framed stream messages, writes the `Send` effects, hands
call events to the application (`SipApplication.on_sip_event`) and re-arms one `loop.call_at` for the
core's next deadline. The application acts through the same adapter (`answer`, `reject`, `hangup` ...)
so every effect is carried out in one place, in order, from one queue (never re-entering the app).

TCP (RFC 3261 §18.3): messages are framed by Content-Length (`StreamFramer`); a stream that cannot be
framed any more is closed. CRLFCRLF keep-alives get a CRLF pong (RFC 5626 §4.4.1). A response or BYE
whose connection has closed goes over a new connection to the source IP (at the Via's sent-by port).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from gateway import metrics
from gateway.sip.agent import Address, Effect, Flow, Send, UserAgent
from gateway.sip.agent import CallEvent as SipCallEvent
from gateway.sip.message import FramingError, StreamFramer

logger = logging.getLogger(__name__)

TCP_CONNECT_TIMEOUT_S = 5.0


class SipApplication(Protocol):
    def on_sip_event(self, event: SipCallEvent) -> None:
        """A call event of the SIP core (called on the event loop)."""


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, endpoint: SipEndpoint) -> None:
        self.endpoint = endpoint

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        self.endpoint.receive(data, Flow("udp", (str(addr[0]), int(addr[1]))))

    def error_received(self, exc: Exception) -> None:
        # ICMP errors (port unreachable after a peer went away) must not disturb other calls.
        logger.debug("SIP UDP error: %s", exc)


class _TcpConnection(asyncio.Protocol):
    def __init__(self, endpoint: SipEndpoint, conn_id: int) -> None:
        self.endpoint = endpoint
        self.conn_id = conn_id
        self.framer = StreamFramer()
        self.transport: asyncio.Transport | None = None
        self.peer: Address = ("", 0)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = (str(peer[0]), int(peer[1])) if peer else ("", 0)
        if not self.endpoint._register(self):
            transport.close()

    def data_received(self, data: bytes) -> None:
        try:
            messages = self.framer.feed(data)
        except FramingError as e:
            metrics.SIP_ERRORS.labels("framing").inc()
            logger.info("closing SIP TCP connection from %s:%s: %s", *self.peer, e)
            if self.transport is not None:
                self.transport.close()
            return
        for message in messages:
            if message == b"\r\n\r\n":
                if self.transport is not None:
                    self.transport.write(b"\r\n")  # RFC 5626 §4.4.1 pong
                continue
            self.endpoint.receive(message, Flow("tcp", self.peer, self.conn_id))

    def connection_lost(self, exc: Exception | None) -> None:
        self.endpoint._unregister(self)

    def write(self, data: bytes) -> bool:
        if self.transport is None or self.transport.is_closing():
            return False
        self.transport.write(data)
        return True


class SipEndpoint:
    """Owns the SIP sockets and the `UserAgent` core; see the module docstring."""

    def __init__(
        self,
        agent: UserAgent,
        app: SipApplication,
        *,
        host: str,
        port: int,
        udp: bool = True,
        tcp: bool = True,
        max_tcp_connections: int = 1024,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.agent = agent
        self.app = app
        self.host = host
        self.port = port
        self._want_udp = udp
        self._want_tcp = tcp
        self._max_tcp = max_tcp_connections
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clock = clock
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp_server: asyncio.Server | None = None
        self._conns: dict[int, _TcpConnection] = {}
        self._outbound: dict[Address, _TcpConnection] = {}
        self._ids = itertools.count(1)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._pending: deque[Effect] = deque()
        self._executing = False

    # --- lifecycle ---

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # Port 0 = any free port. UDP picks it; TCP must get the same number, which a TCP socket may
        # already hold (an ephemeral client port): then try another pair, a few times.
        ephemeral, requested = self.port == 0, self.port
        for attempt in range(8 if ephemeral and self._want_udp and self._want_tcp else 1):
            self.port = requested
            if self._want_udp:
                transport, _ = await self._loop.create_datagram_endpoint(
                    lambda: _Udp(self), local_addr=(self.host, self.port)
                )
                self._udp = transport
                self.port = int(transport.get_extra_info("sockname")[1])
            if not self._want_tcp:
                break
            try:
                self._tcp_server = await self._loop.create_server(
                    lambda: _TcpConnection(self, next(self._ids)), self.host, self.port, reuse_address=True
                )
            except OSError as e:
                if not (ephemeral and self._udp is not None and e.errno == errno.EADDRINUSE and attempt < 7):
                    if self._udp is not None:
                        self._udp.close()
                        self._udp = None
                    raise
                self._udp.close()
                self._udp = None
                continue
            if not self._want_udp:
                self.port = int(self._tcp_server.sockets[0].getsockname()[1])
            break
        if self.agent.config.port != self.port:
            # An ephemeral port (tests): Contact and Via must name the port actually bound.
            self.agent.config = replace(self.agent.config, port=self.port)
        logger.info("SIP listening on %s:%d (%s)", self.host, self.port, self.transports)

    @property
    def transports(self) -> str:
        return "+".join(t for t, on in (("udp", self._udp), ("tcp", self._tcp_server)) if on is not None)

    async def close(self) -> None:
        """Close the sockets (the application ends calls first; see TelephonyFrontEnd.close)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._udp is not None:
            self._udp.close()
            self._udp = None
        if self._tcp_server is not None:
            self._tcp_server.close()
            with contextlib.suppress(Exception):
                await self._tcp_server.wait_closed()
            self._tcp_server = None
        for conn in list(self._conns.values()):
            if conn.transport is not None:
                conn.transport.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        # Let transports run their connection_lost callbacks.
        await asyncio.sleep(0)

    def now(self) -> float:
        if self._clock is not None:
            return self._clock()
        assert self._loop is not None
        return self._loop.time()

    # --- input ---

    def receive(self, data: bytes, flow: Flow) -> None:
        if self._closed:
            return
        try:
            effects = self.agent.receive(data, flow, self.now())
        except Exception:
            # A bug must cost one message, never the daemon (the message is dropped and counted).
            logger.exception("SIP core failed on a message from %s:%s", *flow.remote)
            metrics.SIP_ERRORS.labels("internal").inc()
            return
        self.execute(effects)

    # --- the application's actions ---

    def ring(self, call_ref: str) -> None:
        self.execute(self.agent.ring(call_ref, self.now()))

    def answer(
        self, call_ref: str, sdp: bytes, *, contact_host: str | None = None, recording: bool = False
    ) -> None:
        self.execute(
            self.agent.answer(call_ref, sdp, self.now(), contact_host=contact_host, recording=recording)
        )

    def reject(
        self, call_ref: str, status: int, *, warning: str | None = None, result: str = "failed"
    ) -> None:
        self.execute(self.agent.reject(call_ref, status, self.now(), warning=warning, result=result))

    def answer_reoffer(self, call_ref: str, sdp: bytes, *, contact_host: str | None = None) -> None:
        self.execute(self.agent.answer_reoffer(call_ref, sdp, self.now(), contact_host=contact_host))

    def reject_reoffer(self, call_ref: str, status: int, *, warning: str | None = None) -> None:
        self.execute(self.agent.reject_reoffer(call_ref, status, self.now(), warning=warning))

    def hangup(self, call_ref: str, *, reason: str | None = None) -> None:
        self.execute(self.agent.hangup(call_ref, self.now(), reason=reason))

    def set_admitting(self, admitting: bool) -> None:
        self.agent.set_admitting(admitting)

    # --- effects ---

    def execute(self, effects: list[Effect]) -> None:
        """Carry out the core's effects in order: write each `Send`, hand each call event to the
        application. Effects of an action the application takes while handling an event (`answer`,
        `hangup` ...) join the end of the queue and are carried out after that handler returns, so the
        application is never re-entered and every effect keeps its place in line."""
        self._pending.extend(effects)
        if self._executing:
            return
        self._executing = True
        try:
            while self._pending:
                effect = self._pending.popleft()
                if isinstance(effect, Send):
                    self._send(effect)
                    continue
                try:
                    self.app.on_sip_event(effect)
                except Exception:
                    logger.exception("application failed on %s", type(effect).__name__)
        finally:
            self._executing = False
        self._flush_counters()
        self._rearm()

    def _send(self, effect: Send) -> None:
        if effect.flow.transport == "udp":
            if self._udp is None:
                return
            try:
                self._udp.sendto(effect.data, effect.dest)
            except OSError as e:
                metrics.SIP_ERRORS.labels("send_failed").inc()
                logger.debug("SIP send to %s:%s failed: %s", *effect.dest, e)
            return
        conn = self._conns.get(effect.flow.conn_id) or self._outbound.get(effect.dest)
        if conn is not None and conn.write(effect.data):
            return
        if self._loop is None or self._closed:
            return
        task = self._loop.create_task(self._connect_and_send(effect.dest, effect.data))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connect_and_send(self, dest: Address, data: bytes) -> None:
        assert self._loop is not None
        try:
            _, proto = await asyncio.wait_for(
                self._loop.create_connection(lambda: _TcpConnection(self, next(self._ids)), dest[0], dest[1]),
                TCP_CONNECT_TIMEOUT_S,
            )
        except (OSError, TimeoutError) as e:
            metrics.SIP_ERRORS.labels("send_failed").inc()
            logger.info("SIP TCP connect to %s:%s failed: %s", *dest, e)
            return
        self._outbound[dest] = proto
        proto.write(data)

    def _flush_counters(self) -> None:
        c = self.agent.take_counters()
        for method, n in c.requests.items():
            metrics.SIP_REQUESTS.labels(method).inc(n)
        for code, n in c.responses.items():
            metrics.SIP_RESPONSES.labels(code).inc(n)
        for reason, n in c.errors.items():
            metrics.SIP_ERRORS.labels(reason).inc(n)
        for result, n in c.calls.items():
            metrics.CALLS.labels(result).inc(n)

    # --- timer ---

    def _rearm(self) -> None:
        if self._loop is None or self._closed:
            return
        at = self.agent.next_deadline()
        if self._timer is not None and self._timer_at == at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = at
        if at is not None:
            # The core's clock and the loop's clock are the same (loop.time) unless a test injected one.
            delay = max(0.0, at - self.now())
            self._timer = self._loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        try:
            effects = self.agent.handle_timer(self.now())
        except Exception:
            logger.exception("SIP core timer failed")
            metrics.SIP_ERRORS.labels("internal").inc()
            effects = []
        self.execute(effects)

    # --- TCP bookkeeping ---

    def _register(self, conn: _TcpConnection) -> bool:
        if len(self._conns) >= self._max_tcp or self._closed:
            metrics.SIP_ERRORS.labels("tcp_limit").inc()
            return False
        self._conns[conn.conn_id] = conn
        return True

    def _unregister(self, conn: _TcpConnection) -> None:
        self._conns.pop(conn.conn_id, None)
        for dest, c in list(self._outbound.items()):
            if c is conn:
                del self._outbound[dest]

    @property
    def tcp_connections(self) -> int:
        return len(self._conns)
