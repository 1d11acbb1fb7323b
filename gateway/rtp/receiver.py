"""The asyncio adapter of one call leg's media: RTP/RTCP sockets → `MediaCore` → `MediaSink`.

    manager = MediaManager.from_settings(settings)            # once, in the daemon
    media = await manager.open(plan, sink, name=call_id)       # per accepted m= line; PortsExhausted → 503
    answer = answerer.answer(negotiation, [media.port])
    media.update(new_plan)                                     # re-INVITE
    stats = media.close()                                      # flushes the last audio into the sink

Thin by design: each datagram goes to the core with `loop.time()`, the events that come back go to the
sink (a sink exception is logged and never reaches the socket), and one `loop.call_at` timer per call
serves the core's `next_deadline()` and a once-a-second metrics flush. The timer is only moved earlier
per packet, never re-armed for a later deadline (the core tolerates early wake-ups), so a steady stream
costs no timer churn.

Two ways to read the sockets (`MediaManager(intake_tick_s=...)`): each socket on the event loop (0, the
default: a datagram is handled as soon as the loop sees it), or one `_Intake` that serves every call of
the process each tick: it polls their sockets through a selector of its own, drains the ready ones and
runs the calls' due deadlines. At hundreds of calls a process the first wakes the loop for nearly every
datagram and playout deadline; the intake wakes it once a tick (on a 2-core VM: half the system CPU a
packet, a tenth of the whole; docs/benchmarks.md). It takes each datagram's arrival time from the kernel
(SO_TIMESTAMPNS), so jitter and playout see when it came, not when it was read, and the loop's other work
(engine results, signalling) does not wait for a tick.

The calls of a manager resample together (`UpsampleBatch`, unless `batch_resample=False`): a block that
a datagram completes is resampled, with every other call's of the same loop turn, in a callback the
turn schedules (`loop.call_soon`), and delivered from there with the events held behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import selectors
import socket
import struct
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gateway import metrics
from gateway.audio.resample import UpsampleBatch
from gateway.rtp.media import (
    PENDING_PLAN,
    AudioBlock,
    DtmfDigit,
    MediaConfig,
    MediaCore,
    MediaEvent,
    MediaSink,
    MediaStats,
    MediaTimeout,
    RtcpReport,
)
from gateway.rtp.ports import PortPool, PortsExhausted
from gateway.sdp import MediaPlan

if TYPE_CHECKING:
    from gateway.config import RtpSettings, Settings

logger = logging.getLogger(__name__)

__all__ = ["CallMedia", "MediaManager", "PortsExhausted", "media_config"]

METRICS_PERIOD_S = 1.0
BIND_ATTEMPTS = 32  # pairs tried when ports of the range are taken by other processes
# Receive buffer asked for each socket: the kernel's default (208 KiB) holds 256 packets of 20 ms G.711,
# ~5 s of a call, so a loop that far behind (a starved CPU) lost RTP in the kernel. The kernel caps the
# request at net.core.rmem_max and doubles it: 416 KiB (~10 s) on a stock Linux, 2 MiB where allowed.
RECEIVE_BUFFER = 1 << 20


def media_config(rtp: RtpSettings) -> MediaConfig:
    """The core's dataclass from the deployment settings (the edge is the only place that reads them)."""
    return MediaConfig(
        playout_delay_s=rtp.playout_delay_ms / 1000,
        block_ms=rtp.block_ms,
        max_gap_ms=rtp.max_gap_ms,
        idle_fill_after_s=rtp.idle_fill_after_ms / 1000,
        inactivity_timeout_s=rtp.inactivity_timeout_s,
        hold_timeout_s=rtp.hold_timeout_s,
        relatch_after_s=rtp.relatch_after_ms / 1000,
        resample_quality=rtp.resample_quality,
        rtcp_reports=rtp.rtcp_reports,
    )


# Datagrams read from a socket at close, at most (60 s of 20 ms packets), and their largest size.
MAX_PENDING_AT_CLOSE = 3000
MAX_DATAGRAM = 65535
# Datagrams the intake reads from one socket in one turn: a flood on one port cannot hold the others'
# (what is left is read next turn; the kernel keeps it, RECEIVE_BUFFER).
MAX_PER_TURN = 64
# Each datagram's arrival time from the kernel, on Linux: SO_TIMESTAMPNS (socket(7); 35 in
# asm-generic/socket.h, which x86-64 and arm64 use; Python names no constant), a struct timespec
# (tv_sec, tv_nsec) in the control message. Elsewhere the intake takes a datagram's turn as its arrival.
_SO_TIMESTAMPNS = 35 if sys.platform == "linux" else None
_TIMESPEC = struct.Struct("@qq")
_CMSG_SPACE = socket.CMSG_SPACE(_TIMESPEC.size)


class _Protocol(asyncio.DatagramProtocol):
    __slots__ = ("_media", "_rtcp")

    def __init__(self, media: CallMedia, rtcp: bool) -> None:
        self._media = media
        self._rtcp = rtcp

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self._media._datagram(data, addr, self._rtcp)

    def error_received(self, exc: Exception) -> None:
        # ICMP errors (port unreachable) for our RTCP reports: the peer's RTCP port is closed; the
        # reports are best effort, so nothing to do but note it.
        logger.debug("RTP socket error: %s", exc)


def _bind(host: str, port: int, timestamps: bool = False) -> socket.socket:
    infos = socket.getaddrinfo(
        host, port, type=socket.SOCK_DGRAM, flags=socket.AI_NUMERICHOST | socket.AI_PASSIVE
    )
    family, socktype, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, socktype, proto)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        if timestamps and _SO_TIMESTAMPNS is not None:
            sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
        sock.bind(sockaddr)
    except OSError:
        sock.close()
        raise
    return sock


class _Intake:
    """Every call's sockets and deadlines served in batches, every `tick` seconds from one loop timer:
    the sockets through a selector of its own (epoll on Linux, kqueue on macOS) polled, never waited
    on; each ready socket drained (at most MAX_PER_TURN datagrams a turn), each datagram handed to its
    call with its arrival time on the loop's clock; then each call whose core deadline (playout, idle
    fill, timeouts, metrics) has come. A datagram is read, and a deadline served, up to a tick late;
    arrival times are the kernel's."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tick_s: float) -> None:
        self._loop = loop
        self._tick_s = tick_s
        self._selector = selectors.DefaultSelector()
        self._calls: set[CallMedia] = set()
        self._timer: asyncio.TimerHandle | None = None

    def add(self, media: CallMedia, sockets: Sequence[socket.socket]) -> None:
        """`sockets`: the call's RTP then RTCP socket."""
        for sock, rtcp in zip(sockets, (False, True), strict=True):
            self._selector.register(sock, selectors.EVENT_READ, (media, rtcp))
        self._calls.add(media)
        if self._timer is None:
            self._timer = self._loop.call_later(self._tick_s, self._turn)

    def remove(self, media: CallMedia, sockets: Sequence[socket.socket]) -> None:
        for sock in sockets:
            with contextlib.suppress(KeyError):
                self._selector.unregister(sock)
        self._calls.discard(media)
        if not self._calls and self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _turn(self) -> None:
        self._timer = self._loop.call_later(self._tick_s, self._turn)
        now = self._loop.time()
        ready = self._selector.select(0)
        if ready:
            self._read(ready, now)
        for media in [m for m in self._calls if m._timer_at <= now]:
            if not media.closed:
                try:
                    media._on_timer()
                except Exception:  # as a failing loop timer would: logged, the other calls served
                    logger.exception("media %s failed on its deadline", media.name)

    def _read(self, ready: list[tuple[selectors.SelectorKey, int]], now: float) -> None:
        # The kernel stamps arrivals on CLOCK_REALTIME, the loop's clock is the monotonic one (uvloop's
        # is read once per loop iteration, so `now` may be a few ms old): map through the two clocks
        # read together now, and keep an arrival no later than the loop's now.
        offset = time.time() - time.monotonic()
        readers = self._selector.get_map()
        for key, _ in ready:
            media, rtcp = key.data
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            for _ in range(MAX_PER_TURN):
                if key.fd not in readers:  # a datagram's events closed the call
                    break
                try:
                    data, ancillary, _, addr = sock.recvmsg(MAX_DATAGRAM, _CMSG_SPACE)
                except OSError:  # BlockingIOError: drained
                    break
                at = now
                for level, kind, value in ancillary:
                    if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS:
                        sec, nsec = _TIMESPEC.unpack(value)
                        at = min(now, sec + nsec * 1e-9 - offset)
                try:
                    media._datagram(data, addr, rtcp, at)
                except Exception:  # one call's failure must not starve the other calls' sockets
                    logger.exception("media %s failed on a datagram", media.name)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._calls.clear()
        self._selector.close()


class MediaManager:
    """Owns the port pool and the receive settings; opens one `CallMedia` per accepted stream.

    `intake_tick_s` > 0: an `_Intake` serves the calls every that many seconds instead of the event
    loop serving each socket and timer (the module docstring says when that pays)."""

    def __init__(
        self,
        config: MediaConfig,
        *,
        host: str = "0.0.0.0",
        port_min: int = 20000,
        port_max: int = 30000,
        quarantine_s: float = 2.0,
        intake_tick_s: float = 0.0,
        batch_resample: bool = True,
    ) -> None:
        self.config = config
        self.host = host
        self.pool = PortPool(port_min, port_max, quarantine_s=quarantine_s)
        self.intake_tick_s = intake_tick_s
        self._intake: _Intake | None = None
        self._open: set[CallMedia] = set()
        self.upsample_batch = UpsampleBatch(config.resample_quality) if batch_resample else None
        self._waiting: list[CallMedia] = []  # calls whose audio waits for the batch's run

    @classmethod
    def from_settings(cls, settings: Settings) -> MediaManager:
        rtp = settings.rtp
        return cls(
            media_config(rtp),
            host=rtp.host,
            port_min=rtp.port_min,
            port_max=rtp.port_max,
            quarantine_s=rtp.port_quarantine_s,
            intake_tick_s=rtp.intake_tick_ms / 1000,
        )

    @property
    def streams(self) -> int:
        return len(self._open)

    async def open(self, plan: MediaPlan | None, sink: MediaSink, *, name: str = "") -> CallMedia:
        """Bind an RTP/RTCP port pair and start receiving. Raises PortsExhausted (answer 503).

        `plan=None` when we make the offer (delayed offer): nothing is accepted until `update(plan)`."""
        if plan is None:
            plan = PENDING_PLAN
        loop = asyncio.get_running_loop()
        rtp_sock, rtcp_sock, port = self._bind_pair(loop.time())
        media = CallMedia(self, plan, sink, port, name, loop)
        if self.intake_tick_s > 0:
            if self._intake is None:
                self._intake = _Intake(loop, self.intake_tick_s)
            media._attach([], (rtp_sock, rtcp_sock), ticked=True)
            self._intake.add(media, (rtp_sock, rtcp_sock))
        else:
            try:
                rtp_tr, _ = await loop.create_datagram_endpoint(
                    lambda: _Protocol(media, False), sock=rtp_sock
                )
                rtcp_tr, _ = await loop.create_datagram_endpoint(
                    lambda: _Protocol(media, True), sock=rtcp_sock
                )
            except BaseException:
                rtp_sock.close()
                rtcp_sock.close()
                self.pool.release(port, loop.time())
                raise
            media._attach([rtp_tr, rtcp_tr], (rtp_sock, rtcp_sock))
        self._open.add(media)
        metrics.RTP_STREAMS.inc()
        return media

    def close_all(self) -> list[MediaStats]:
        stats = [media.close() for media in list(self._open)]
        if self._intake is not None:
            self._intake.close()
            self._intake = None
        return stats

    def _wait_for_batch(self, media: CallMedia) -> None:
        if not self._waiting:
            media._loop.call_soon(self._run_batch)
        self._waiting.append(media)

    def _run_batch(self) -> None:
        waiting, self._waiting = self._waiting, []
        assert self.upsample_batch is not None
        try:
            self.upsample_batch.run()
        except Exception:  # each call then resamples its own below
            logger.exception("batched resampling of %d calls failed", len(waiting))
        for media in waiting:
            try:
                media._batch_done()
            except Exception:  # as a failing datagram would: logged, the other calls served
                logger.exception("media %s failed on its resampled audio", media.name)

    def _release_sockets(self, media: CallMedia, sockets: Sequence[socket.socket]) -> None:
        """A closing call's sockets, where the intake reads them (the loop's transports close their own)."""
        if self._intake is not None:
            self._intake.remove(media, sockets)
            for sock in sockets:
                sock.close()

    def _bind_pair(self, now: float) -> tuple[socket.socket, socket.socket, int]:
        for _ in range(min(BIND_ATTEMPTS, self.pool.capacity)):
            try:
                port = self.pool.acquire(now)
            except PortsExhausted:
                metrics.RTP_PORTS_EXHAUSTED.inc()
                raise
            try:
                rtp = _bind(self.host, port, timestamps=self.intake_tick_s > 0)
            except OSError as exc:
                logger.warning("RTP port %d not bindable (%s); trying the next pair", port, exc)
                self.pool.release(port, now)
                continue
            try:
                rtcp = _bind(self.host, port + 1, timestamps=self.intake_tick_s > 0)
            except OSError as exc:
                logger.warning("RTCP port %d not bindable (%s); trying the next pair", port + 1, exc)
                rtp.close()
                self.pool.release(port, now)
                continue
            return rtp, rtcp, port
        metrics.RTP_PORTS_EXHAUSTED.inc()
        raise PortsExhausted(f"no bindable RTP port pair on {self.host} after {BIND_ATTEMPTS} attempts")

    def _closed(self, media: CallMedia, now: float) -> None:
        if media in self._open:
            self._open.discard(media)
            self.pool.release(media.port, now)
            metrics.RTP_STREAMS.dec()


class CallMedia:
    """One call leg's media: the sockets, the core, the timer and the sink."""

    def __init__(
        self,
        manager: MediaManager,
        plan: MediaPlan,
        sink: MediaSink,
        port: int,
        name: str,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.port = port
        self.rtcp_port = port + 1
        self.name = name
        self._manager = manager
        self._sink = sink
        self._loop = loop
        self._core = MediaCore(plan, manager.config, loop.time(), upsample_batch=manager.upsample_batch)
        self._waits = False  # in the manager's list of calls whose audio waits for the batch
        self._transports: list[asyncio.DatagramTransport] = []
        self._sockets: tuple[socket.socket, ...] = ()  # (RTP, RTCP): read dry at close
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")  # the next deadline: the loop timer's, or the intake's to serve
        self._ticked = False
        self._metrics_at = loop.time() + METRICS_PERIOD_S
        self._published: dict[str, int] = {}
        self._final: MediaStats | None = None

    # --- API for the leg that owns it -------------------------------------------------------------

    @property
    def plan(self) -> MediaPlan:
        return self._core.plan

    @property
    def closed(self) -> bool:
        return self._final is not None

    def stats(self) -> MediaStats:
        return self._final if self._final is not None else self._core.stats()

    def update(self, plan: MediaPlan) -> None:
        """A re-INVITE's outcome for this stream: codec, remote address, hold/resume."""
        if self._final is not None:
            return
        self._deliver(self._core.update(plan, self._loop.time()))
        self._check_batch()
        self._schedule()

    def close(self) -> MediaStats:
        """Flush the last audio, DTMF and resampler tail into the sink; free the ports. Idempotent."""
        if self._final is not None:
            return self._final
        self._read_pending()
        now = self._loop.time()
        bye = self._core.goodbye(now)
        if bye is not None:
            self._send(bye)  # while the sockets are open
        events = self._core.close(now)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for transport in self._transports:
            transport.close()
        if self._ticked:
            self._manager._release_sockets(self, self._sockets)
        self._transports.clear()
        stats = self._core.stats()
        self._final = stats
        self._publish_metrics()
        if stats.packets_received:
            metrics.RTP_JITTER.observe(stats.jitter_ms / 1000)
        self._manager._closed(self, now)
        self._deliver(events)
        logger.debug(  # call_end carries these counters, and the daemon logs it at INFO
            "media %s closed: %d packets, lost %d, late %d, dup %d, invalid %d, ssrc changes %d, "
            "dtmf %d, jitter %.1f ms, audio %d ms",
            self.name, stats.packets_received, stats.lost, stats.late, stats.duplicate, stats.invalid,
            stats.ssrc_changes, stats.dtmf_events, stats.jitter_ms, stats.audio_ms,
        )  # fmt: skip
        return stats

    # --- adapter internals -----------------------------------------------------------------------

    def _attach(
        self,
        transports: list[asyncio.DatagramTransport],
        sockets: tuple[socket.socket, socket.socket],
        *,
        ticked: bool = False,
    ) -> None:
        """The loop's transports of the sockets, or none and `ticked` where the manager's intake reads
        them and serves the deadlines."""
        self._transports = transports
        self._sockets = sockets
        self._ticked = ticked
        self._schedule()

    def _read_pending(self) -> None:
        """Take what the kernel holds for the sockets before closing them: the event loop may handle
        the BYE before the datagrams that arrived ahead of it (it serves ready sockets in any order),
        and closing would throw the call's last packets away. Bounded: a flood cannot hold the close."""
        for sock, rtcp in zip(self._sockets, (False, True), strict=False):
            for _ in range(MAX_PENDING_AT_CLOSE):
                try:
                    data, addr = sock.recvfrom(MAX_DATAGRAM)
                except OSError:  # BlockingIOError: nothing left; or the socket is gone
                    break
                self._datagram(data, addr, rtcp)

    def _datagram(self, data: bytes, addr: Any, rtcp: bool, now: float | None = None) -> None:
        """One datagram, arrived at `now` on the loop's clock (None: now)."""
        if self._final is not None:
            return
        addr = (addr[0], addr[1])  # IPv6 addresses come as 4-tuples
        if now is None:
            now = self._loop.time()
        if rtcp:
            events = self._core.rtcp_datagram(data, addr, now)
        else:
            events = self._core.datagram(data, addr, now)
        if events:
            self._deliver(events)
        self._check_batch()
        deadline = self._core.next_deadline()
        if deadline is not None and deadline < self._timer_at:
            self._schedule()

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = float("inf")
        if self._final is not None:
            return
        now = self._loop.time()
        self._deliver(self._core.handle_timer(now))
        self._check_batch()
        if now >= self._metrics_at:
            self._publish_metrics()
            self._metrics_at = now + METRICS_PERIOD_S
        self._schedule()

    def _check_batch(self) -> None:
        if self._core.audio_pending and not self._waits:
            self._waits = True
            self._manager._wait_for_batch(self)

    def _batch_done(self) -> None:
        """The batch has run: deliver the blocks and the events held behind them (a pass the batch did
        not run, after a failure, runs alone here)."""
        self._waits = False
        if self._final is not None:  # closing ran the pass alone and delivered everything
            return
        self._deliver(self._core.resample_alone() if self._core.audio_pending else self._core.take_events())

    def _schedule(self) -> None:
        when = self._metrics_at
        deadline = self._core.next_deadline()
        if deadline is not None and deadline < when:
            when = deadline
        if self._ticked:
            self._timer_at = min(self._timer_at, when)
            return
        if self._timer is not None:
            if when >= self._timer_at:
                return
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._loop.call_at(when, self._on_timer)

    def _deliver(self, events: Sequence[MediaEvent]) -> None:
        sink = self._sink
        for ev in events:
            try:
                if type(ev) is AudioBlock:
                    sink.on_audio(ev.pcm, ev.start_ms)
                elif type(ev) is DtmfDigit:
                    metrics.DTMF_EVENTS.inc()
                    sink.on_dtmf(ev.digit, ev.start_ms, ev.duration_ms)
                elif type(ev) is MediaTimeout:
                    metrics.RTP_TIMEOUTS.inc()
                    state = "on hold" if ev.on_hold else "active"
                    logger.info("media %s: no RTP for %.1f s (%s)", self.name, ev.idle_s, state)
                    sink.on_inactive()
                elif type(ev) is RtcpReport:
                    self._send(ev)
            except Exception:
                logger.exception("media sink of %s failed on %s", self.name, type(ev).__name__)

    def _send(self, report: RtcpReport) -> None:
        """One RTCP report, best effort: a full socket buffer or an unreachable peer drops it (counted)."""
        if not self._sockets:
            return
        try:
            self._sockets[0 if report.rtp_port else 1].sendto(report.data, report.addr)
        except OSError as exc:
            metrics.RTCP_SEND_ERRORS.inc()
            logger.debug("media %s: RTCP report to %s not sent: %s", self.name, report.addr, exc)
            return
        metrics.RTCP_REPORTS_SENT.inc()

    def _publish_metrics(self) -> None:
        core = self._core
        current = {
            "received": core.packets_received,
            "lost": core.lost_settled,
            "late": core.late,
            "duplicate": core.duplicate,
        }
        for reason, n in core.invalid.items():
            current["invalid:" + reason] = n
        published = self._published
        for key, value in current.items():
            delta = value - published.get(key, 0)
            if delta <= 0:
                continue
            published[key] = value
            if key == "received":
                metrics.RTP_RECEIVED.labels(core.plan.codec).inc(delta)
            elif key == "lost":
                metrics.RTP_LOST.inc(delta)
            elif key == "late":
                metrics.RTP_LATE.inc(delta)
            elif key == "duplicate":
                metrics.RTP_DUPLICATE.inc(delta)
            else:
                metrics.RTP_INVALID.labels(key.partition(":")[2]).inc(delta)
