"""A media worker process: RTP receive, jitter buffer, G.711, resampling and the ASR front end
(log-mel, chunking, frame energies) for the call legs the main process gives it.

    python -m gateway.workers.media_worker --index I --control FD --chunks END --spec FILE --media JSON

Per leg it owns an RTP/RTCP port pair from its own share of the port range (`gateway.rtp.receiver`
does the sockets, `MediaCore` the packets) and a `StreamFrontEnd`; the leg's 16 kHz blocks go through
the front end and its chunks straight to the engine process (`ChunkSender`, flushed once per event-loop
turn, or within a long turn: PUBLISH_WITHIN_TURN_S). DTMF and inactivity go to the main process as
control messages (gateway.workers.protocol).

Order per leg, as in one process: `close` flushes the media's last audio into the front end and
answers with the stats; `finish` then ends the ASR stream (the front end's last short chunk, FINISH).
If the main process goes away (its control socket closes) the worker aborts its legs and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from asr_core.channel import ChannelEnd, ChannelWriter
from asr_core.frontend import FrontEndFactory, FrontEndSpec, StreamFrontEnd
from asr_core.heap import freeze_startup_heap
from asr_core.remote import ChunkSender, ignore_stop_signals
from gateway import metrics
from gateway.logs import configure_logging
from gateway.loop_lag import watch_loop_lag
from gateway.rtp.media import MediaConfig
from gateway.rtp.ports import PortsExhausted
from gateway.rtp.receiver import CallMedia, MediaManager
from gateway.workers.protocol import CounterDeltas, counters_by_name, line, plan_from_json, stats_to_json

logger = logging.getLogger(__name__)

METRICS_PERIOD_S = 1.0
# Chunks are published once per event-loop turn (one position on the channel's socket for all of them),
# but a turn that serves hundreds of calls' datagrams can run for tens of milliseconds: once the oldest
# unpublished chunk has waited this long, the next block any leg hands its front end publishes it.
PUBLISH_WITHIN_TURN_S = 0.01
# The most a loop turn spends on the main process's commands before the calls' media gets the loop.
COMMANDS_TURN_S = 0.01


@dataclass(eq=False)
class _Leg:
    """One leg: its ASR front end and key (the MediaSink of its CallMedia)."""

    worker: MediaWorker
    name: str
    key: int
    front: StreamFrontEnd
    media: CallMedia | None = None
    accepting: bool = True  # audio goes into the front end until the stream is finished or aborted
    finished: bool = False

    def on_audio(self, pcm16k: NDArray[np.float32], start_ms: int) -> None:
        if not self.accepting:
            return
        payloads = self.front.push(pcm16k)
        if payloads:
            self.worker.sender.chunks(self.key, payloads, self.front.samples)
            self.worker.dirty(payloads[0].completed_at)
        else:
            self.worker.publish_if_waited(time.monotonic())

    def on_dtmf(self, digit: str, start_ms: int, duration_ms: int) -> None:
        self.worker.send({"op": "dtmf", "leg": self.name, "digit": digit, "start_ms": start_ms,
                          "duration_ms": duration_ms})  # fmt: skip

    def on_inactive(self) -> None:
        self.worker.send({"op": "inactive", "leg": self.name})


class MediaWorker:
    def __init__(
        self,
        index: int,
        sender: ChunkSender,
        factory: FrontEndFactory,
        manager: MediaManager,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.index = index
        self.sender = sender
        self.factory = factory
        self.manager = manager
        self._writer = writer
        self.legs: dict[str, _Leg] = {}
        self._flush_scheduled = False
        self._loop = asyncio.get_running_loop()
        self._deltas = CounterDeltas(counters_by_name(metrics).values())
        # Since when the oldest chunk not yet published waits (None: none waits), and the report period's
        # longest such wait (sent with the next periodic report).
        self._unflushed_since: float | None = None
        self.flush_delay_max = 0.0

    # -- to the engine and to the main process ----------------------------------------------------

    def dirty(self, completed_at: float | None = None) -> None:
        """Records were written: publish them once this event-loop turn is done, or at once when chunks
        already wait PUBLISH_WITHIN_TURN_S. `completed_at`: the monotonic time its front end completed the
        first chunk among them (chunks only)."""
        if completed_at is not None:
            if self._unflushed_since is None:
                self._unflushed_since = completed_at
            elif self.publish_if_waited(completed_at):
                return
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def publish_if_waited(self, now: float) -> bool:
        """Publish the chunks that wait if the oldest has waited PUBLISH_WITHIN_TURN_S by `now` (monotonic);
        a leg asks at every block its front end takes, so the last chunks of a long turn need not wait
        for a later chunk or the turn's end. True once it tried (a full ring schedules its own retry)."""
        since = self._unflushed_since
        if since is None or now - since < PUBLISH_WITHIN_TURN_S:
            return False
        self._publish()
        return True

    def _flush(self) -> None:
        self._flush_scheduled = False
        self._publish()

    def _publish(self) -> None:
        if not self.sender.flush():  # the ring is full: the engine is behind; try again shortly
            if not self._flush_scheduled:
                self._flush_scheduled = True
                self._loop.call_later(0.005, self._flush)
            return
        if self._unflushed_since is not None:
            self.flush_delay_max = max(self.flush_delay_max, time.monotonic() - self._unflushed_since)
            self._unflushed_since = None

    def send(self, msg: dict[str, Any]) -> None:
        if not self._writer.is_closing():
            self._writer.write(line(msg))

    # -- commands --------------------------------------------------------------------------------

    async def serve(self, reader: asyncio.StreamReader) -> None:
        """The main process's commands, until "stop" or until its socket closes (it is gone).

        A line already read returns without yielding, so a read that brings many commands (a wave of
        hang-ups: each leg's close and finish) would serve them all in one loop turn while the other
        calls' datagrams and chunks wait; after COMMANDS_TURN_S of commands the loop gets a turn."""
        spent = 0.0
        while True:
            raw = await reader.readline()
            if not raw:
                return
            msg = json.loads(raw)
            if msg.get("op") == "stop":
                return
            start = time.monotonic()
            try:
                await self.handle(msg)
            except Exception:
                logger.exception("media worker %d: command %s failed", self.index, msg.get("op"))
            spent += time.monotonic() - start
            if spent >= COMMANDS_TURN_S:
                spent = 0.0
                await asyncio.sleep(0)

    async def handle(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        name = str(msg.get("leg", ""))
        if op == "open":
            await self._open(name, msg)
        elif op == "update":
            leg = self.legs.get(name)
            plan = plan_from_json(msg.get("plan"))
            if leg is not None and leg.media is not None and plan is not None:
                leg.media.update(plan)
        elif op == "close":
            self._close(name)
        elif op == "finish":
            self._finish(name)
        elif op == "abort":
            self._abort(name)

    async def _open(self, name: str, msg: dict[str, Any]) -> None:
        lookahead = msg.get("lookahead")
        lookahead = self.factory.spec.default_lookahead if lookahead is None else int(lookahead)
        key = int(msg["key"])
        leg = _Leg(self, name, key, self.factory.stream(lookahead))
        self.legs[name] = leg
        self.sender.open(
            key, lookahead, str(msg.get("language") or "auto"), str(msg.get("stream_id") or name)
        )
        self.dirty()
        try:
            leg.media = await self.manager.open(plan_from_json(msg.get("plan")), leg, name=name)
        except (PortsExhausted, OSError) as e:
            self.send({"op": "open_failed", "leg": name, "error": str(e), "exhausted": True})
            return
        except Exception as e:
            logger.exception("leg %s: opening media failed", name)
            self.send({"op": "open_failed", "leg": name, "error": str(e), "exhausted": False})
            return
        self.send({"op": "opened", "leg": name, "port": leg.media.port})

    def _close(self, name: str) -> None:
        leg = self.legs.get(name)
        if leg is None:
            self.send({"op": "closed", "leg": name, "stats": None, "audio_ms": 0})
            return
        stats = leg.media.close() if leg.media is not None else None  # last audio into the front end
        leg.media = None
        # The leg's last counts first: the main process publishes call_end once it has "closed", and
        # /metrics should have counted that call's packets by then, not up to a period later.
        self.send_metrics()
        self.send({"op": "closed", "leg": name, "stats": None if stats is None else stats_to_json(stats),
                   "audio_ms": leg.front.audio_ms})  # fmt: skip
        if leg.finished:
            del self.legs[name]

    def _finish(self, name: str) -> None:
        leg = self.legs.get(name)
        if leg is None or leg.finished:
            return
        leg.accepting = False
        leg.finished = True
        payloads, last_is_final = leg.front.finish()
        self.sender.chunks(leg.key, payloads, leg.front.samples, last_is_final=last_is_final)
        if not last_is_final:
            self.sender.finish(leg.key, leg.front.samples)
        self.dirty(payloads[0].completed_at if payloads else None)
        if leg.media is None:
            del self.legs[name]

    def _abort(self, name: str) -> None:
        leg = self.legs.pop(name, None)
        if leg is None:
            return
        if leg.media is not None:
            leg.media.close()
        if not leg.finished:
            self.sender.close(leg.key)
            self.dirty()

    def abort_all(self) -> None:
        for name in list(self.legs):
            self._abort(name)
        self.sender.flush()

    def send_metrics(self, streams: int | None = None, *, loop_lag_s: float | None = None) -> None:
        """The counters' increments since the last report, and the RTP streams up (`streams` if given);
        the periodic report also the period's loop lag (`loop_lag_s`) and longest flush delay."""
        up = self.manager.streams if streams is None else streams
        msg: dict[str, Any] = {"op": "metrics", "counters": self._deltas.take(), "streams": up}
        if loop_lag_s is not None:
            msg["loop_lag_s"], msg["flush_delay_s"] = loop_lag_s, self.flush_delay_max
            self.flush_delay_max = 0.0
        self.send(msg)

    async def metrics_loop(self) -> None:
        """A report every METRICS_PERIOD_S, with how late the loop ran meanwhile."""
        await watch_loop_lag(lambda lag: self.send_metrics(loop_lag_s=lag), METRICS_PERIOD_S)


async def _serve(args: argparse.Namespace) -> int:
    spec = FrontEndSpec.from_json(json.loads(Path(args.spec).read_text()))
    media = json.loads(args.media)
    config = MediaConfig(**media["config"])
    manager = MediaManager(
        config,
        host=media["host"],
        port_min=int(media["port_min"]),
        port_max=int(media["port_max"]),
        quarantine_s=float(media.get("quarantine_s", 2.0)),
        intake_tick_s=float(media.get("intake_tick_s", 0.0)),
    )
    sender = ChunkSender(ChannelWriter.open(ChannelEnd.decode(args.chunks)))
    reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=args.control))
    worker = MediaWorker(args.index, sender, FrontEndFactory(spec), manager, writer)
    freeze_startup_heap()
    worker.send({"op": "ready", "index": args.index, "ports": [media["port_min"], media["port_max"]]})
    reports = asyncio.create_task(worker.metrics_loop())
    try:
        await worker.serve(reader)
    finally:
        reports.cancel()
        worker.abort_all()
        worker.send_metrics(streams=0)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()
        sender.writer.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ignore_stop_signals()
    p = argparse.ArgumentParser(prog="python -m gateway.workers.media_worker")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--control", type=int, required=True, help="control socket fd (inherited)")
    p.add_argument("--chunks", required=True, help="chunk channel end to the engine (fd:size:fd)")
    p.add_argument("--spec", required=True, help="front-end spec (JSON file)")
    p.add_argument("--media", required=True, help="MediaConfig and port range (JSON)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--uvloop", action="store_true")
    p.add_argument("--role", default="", help="a name for process listings")
    args = p.parse_args(argv)
    configure_logging(logging.getLevelNamesMapping().get(args.log_level.upper(), logging.INFO))
    loop_factory = None
    if args.uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            loop_factory = uvloop.new_event_loop
    t0 = time.monotonic()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        code = runner.run(_serve(args))
    logger.debug("media worker %d ran %.0f s", args.index, time.monotonic() - t0)
    return code


if __name__ == "__main__":
    from asr_core import configure_process

    configure_process(mlx=False)  # the front ends' small matmuls: numpy's BLAS on one thread; no MLX here
    sys.exit(main())
