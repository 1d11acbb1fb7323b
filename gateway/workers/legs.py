"""`WorkerLegs`: the call core's legs run in media worker processes, their streams in the engine process.

The same seam as `gateway.call.legs.LocalLegs` (the front end cannot tell them apart): leg effects in,
leg inputs out, always on the event loop. What runs where:

    OpenAsr     checked here against the model's languages and lookaheads (the front-end spec); the
                stream itself opens in the engine when the leg's worker sends its first record
    OpenMedia   the pool gives the leg to a worker, which binds the port and opens the engine stream
                (its chunks go worker -> engine directly) -> MediaOpened / MediaFailed
    CloseMedia  the worker flushes the leg's last audio into its front end -> MediaClosed(stats)
    FinishAsr   the worker sends the front end's last chunk and FINISH; finals and the stream's end
                come from the engine's results channel -> Transcript ..., AsrEnded
    CloseAsr    the worker (or, if it is gone, nobody: the engine closed it) drops the stream

Results of the engine process (`on_results`) are matched to legs by their key (chosen here). A media
worker that dies: each of its live legs gets MediaFailed (the call ends with a BYE, reason error; the
engine closed their streams when their channel closed, so their decoded text still comes as finals,
then AsrEnded). The engine process that dies: every stream gets AsrEnded(error).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from asr_core.api import StreamEnded, TranscriptEvent
from asr_core.frontend import FrontEndSpec
from asr_core.hooks import EngineHooks
from asr_core.wire import Decode, Dropped, Event, Latency, Status, Step, TimeToFinal
from gateway import metrics
from gateway.call.contract import (
    AsrEnded,
    AsrOpened,
    AsrRefused,
    CloseAsr,
    CloseMedia,
    Dtmf,
    FinishAsr,
    LegEffect,
    LegInput,
    MediaClosed,
    MediaFailed,
    MediaInactive,
    MediaOpened,
    OpenAsr,
    OpenMedia,
    Transcript,
    UpdateMedia,
)
from gateway.call.legs import LegEvents
from gateway.sdp import MediaPlan
from gateway.workers.pool import MediaWorkerPool, OpenFailed, WorkerGone

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Leg:
    call_id: str
    name: str
    id: str  # the pool's name of the leg: unique among live legs
    key: int = 0
    stream_id: str = ""
    language: str = "auto"
    lookahead: int | None = None
    asr_open: bool = False  # OpenAsr accepted, stream not ended
    media_opened: bool = False  # the worker has it (its engine stream exists)
    finished: bool = False
    closed_asr: bool = False
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)


class WorkerLegs:
    def __init__(self, pool: MediaWorkerPool, spec: FrontEndSpec, hooks: EngineHooks) -> None:
        self.pool = pool
        self.spec = spec
        self.hooks = hooks
        self._status: dict[int, dict[str, Any]] = {}  # per engine process
        self._calls: dict[str, dict[str, _Leg]] = {}
        self._by_key: dict[int, _Leg] = {}
        self._by_id: dict[str, _Leg] = {}
        self._keys = itertools.count(1)
        self._events: LegEvents | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        pool.on_event = self._worker_event
        pool.on_worker_died = self.worker_died

    # -- the Legs protocol -----------------------------------------------------------------------

    def start(self, events: LegEvents) -> None:
        self._events = events
        self._loop = asyncio.get_running_loop()

    def execute(self, call_id: str, effect: LegEffect) -> None:
        legs = self._calls.setdefault(call_id, {})
        leg = legs.get(effect.leg)
        if leg is None:
            leg = legs[effect.leg] = _Leg(call_id, effect.leg, f"{call_id}/{effect.leg}")
            self._by_id[leg.id] = leg
        match effect:
            case OpenAsr(stream_id=stream_id, options=options):
                self._open_asr(leg, stream_id, options.language, options.lookahead)
            case OpenMedia(plan=plan):
                self._spawn(leg, self._open_media(leg, plan))
            case UpdateMedia(plan=plan):
                self.pool.update_leg(leg.id, plan)
            case CloseMedia():
                self._spawn(leg, self._close_media(leg))
            case FinishAsr():
                self._finish_asr(leg)
            case CloseAsr():
                self._close_asr(leg)

    def discard(self, call_id: str) -> None:
        for leg in self._calls.pop(call_id, {}).values():
            for task in leg.tasks:
                task.cancel()
            if leg.media_opened and not leg.finished:
                self.pool.abort_leg(leg.id)
            self._by_id.pop(leg.id, None)
            self._by_key.pop(leg.key, None)

    async def close(self) -> None:
        tasks = [t for legs in self._calls.values() for leg in legs.values() for t in leg.tasks]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- ASR -------------------------------------------------------------------------------------

    def _open_asr(self, leg: _Leg, stream_id: str, language: str, lookahead: int | None) -> None:
        spec = self.spec
        if lookahead is not None and lookahead not in spec.lookaheads:
            self._report(leg, AsrRefused(leg.name, f"lookahead {lookahead} not supported"))
            return
        if language not in ("", "auto") and language not in spec.prompts:
            error = f"unknown language {language!r}: not in the bundle's prompt_dictionary"
            self._report(leg, AsrRefused(leg.name, error, unknown_language=True))
            return
        leg.key = next(self._keys) & 0xFFFFFFFF
        leg.stream_id, leg.language, leg.lookahead = stream_id, language or "auto", lookahead
        leg.asr_open = True
        self._by_key[leg.key] = leg
        self._report(leg, AsrOpened(leg.name))

    def _finish_asr(self, leg: _Leg) -> None:
        if not leg.asr_open or leg.finished:
            return
        leg.finished = True
        if not leg.media_opened:
            # No worker ever had this stream (its port never opened): it has nothing to decode.
            self._asr_ended(leg, StreamEnded(leg.stream_id, "finished"))
        elif not self.pool.finish_leg(leg.id):
            pass  # its worker died: the engine closed the stream when the worker's channel closed

    def _close_asr(self, leg: _Leg) -> None:
        leg.closed_asr = True
        if leg.media_opened and not leg.finished:
            self.pool.abort_leg(leg.id)
        leg.finished = True
        leg.asr_open = False
        self._by_key.pop(leg.key, None)

    # -- media -----------------------------------------------------------------------------------

    async def _open_media(self, leg: _Leg, plan: MediaPlan | None) -> None:
        try:
            port = await self.pool.open_leg(
                leg.id, leg.key, plan, language=leg.language, lookahead=leg.lookahead, stream_id=leg.stream_id
            )
        except OpenFailed as e:
            leg.media_opened = True  # the worker opened the engine stream before the port failed
            self._deliver(leg, MediaFailed(leg.name, str(e), e.exhausted))
            return
        except WorkerGone as e:
            self._deliver(leg, MediaFailed(leg.name, str(e), False))
            return
        leg.media_opened = True
        self._deliver(leg, MediaOpened(leg.name, port))

    async def _close_media(self, leg: _Leg) -> None:
        stats, audio_ms = await self.pool.close_leg(leg.id)
        if stats is not None and stats.packets_received:
            metrics.RTP_JITTER.observe(stats.jitter_ms / 1000)
        fields = stats.to_fields() if stats is not None else {}
        self._deliver(leg, MediaClosed(leg.name, fields, audio_ms))

    # -- what comes back -------------------------------------------------------------------------

    @property
    def status(self) -> dict[str, Any]:
        """The engines' last STATUS records as one: the largest lag, load and batching wait, summed
        counts."""
        parts = list(self._status.values())
        if len(parts) <= 1:
            return dict(parts[0]) if parts else {}
        return {
            "active_streams": sum(p.get("active_streams", 0) for p in parts),
            "queued_chunks": sum(p.get("queued_chunks", 0) for p in parts),
            "lag_s": max(p.get("lag_s", 0.0) for p in parts),
            "load": max(p.get("load", 0.0) for p in parts),
            "max_wait_ms": max(p.get("max_wait_ms", 0.0) for p in parts),
            "failed": any(p.get("failed", False) for p in parts),
        }

    def engine_status(self, engine: int) -> dict[str, Any]:
        """Engine process `engine`'s last STATUS record ({} without one, or once it died)."""
        return dict(self._status.get(engine, {}))

    def engine_streams(self, engine: int) -> int:
        """The streams engine process `engine` said it holds in its last STATUS (0 without one)."""
        return int(self.engine_status(engine).get("active_streams", 0))

    def on_results(self, outputs: Sequence[Any], engine: int = 0) -> None:
        """Records of engine process `engine`'s results channel (on the loop)."""
        hooks = self.hooks
        for out in outputs:
            if isinstance(out, Event):
                leg = self._by_key.get(out.key)
                if leg is None:
                    continue
                if isinstance(out.event, TranscriptEvent):
                    self._deliver(leg, Transcript(leg.name, out.event))
                else:
                    self._asr_ended(leg, out.event)
            elif isinstance(out, Step):
                hooks.encoder_step(out.seconds, out.batch, out.waits_s.tolist())
            elif isinstance(out, Decode):
                hooks.decoder_step(out.seconds, out.streams)
            elif isinstance(out, Latency):
                hooks.transcript(out.kind, out.seconds)
            elif isinstance(out, TimeToFinal):
                hooks.time_to_final(out.seconds)
            elif isinstance(out, Dropped):
                hooks.chunk_dropped("")
            elif isinstance(out, Status):
                self._status[engine] = out.values

    def engine_died(
        self, error: str, engine: int | None = None, workers: Collection[int] | None = None
    ) -> None:
        """An engine process is gone: the open streams of `workers` (the media workers that fed it;
        None: every worker) end with an error, and its last STATUS no longer counts."""
        if engine is not None:
            self._status.pop(engine, None)
        for leg in list(self._by_key.values()):
            if workers is None or self.pool.owner(leg.id) in workers:
                self._asr_ended(leg, StreamEnded(leg.stream_id, "error", error=error))

    def _asr_ended(self, leg: _Leg, ended: StreamEnded) -> None:
        self._by_key.pop(leg.key, None)
        leg.asr_open = False
        if not leg.closed_asr:
            self._deliver(leg, AsrEnded(leg.name, ended))

    def _worker_event(self, leg_id: str, msg: dict[str, Any]) -> None:
        leg = self._by_id.get(leg_id)
        if leg is None:
            return
        op = msg.get("op")
        if op == "dtmf":
            metrics.DTMF_EVENTS.inc()
            self._deliver(
                leg, Dtmf(leg.name, str(msg["digit"]), int(msg["start_ms"]), int(msg["duration_ms"]))
            )
        elif op == "inactive":
            metrics.RTP_TIMEOUTS.inc()
            self._deliver(leg, MediaInactive(leg.name))

    def worker_died(self, index: int, leg_ids: list[str]) -> None:
        for leg_id in leg_ids:
            leg = self._by_id.get(leg_id)
            if leg is not None:
                self._deliver(leg, MediaFailed(leg.name, f"media worker {index} died", False))

    # -- plumbing --------------------------------------------------------------------------------

    def _spawn(self, leg: _Leg, coro: Any) -> None:
        assert self._loop is not None
        task = self._loop.create_task(coro)
        leg.tasks.add(task)
        task.add_done_callback(leg.tasks.discard)

    def _report(self, leg: _Leg, event: LegInput) -> None:
        """A result known while an effect is carried out: handed over after `execute` returns."""
        if self._loop is not None:
            self._loop.call_soon(self._deliver, leg, event)

    def _deliver(self, leg: _Leg, event: LegInput) -> None:
        if self._events is not None and self._calls.get(leg.call_id, {}).get(leg.name) is leg:
            self._events.leg_event(leg.call_id, event)
