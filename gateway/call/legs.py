"""Where a call's legs run: the leg effects of the call core carried out, and what happens reported back.

A leg is one audio stream of a call: its RTP port and receive core (gateway.rtp), its ASR stream
(asr_core) and the audio path between them. The front end hands every leg effect (`OpenAsr`,
`OpenMedia`, `UpdateMedia`, `CloseMedia`, `FinishAsr`, `CloseAsr`) to a `Legs` implementation and gets
leg inputs back through `LegEvents.leg_event`, always on the event loop, never from inside `execute`
(a result that is known at once is handed over after `execute` returns).

`LocalLegs` runs them in this process: the engine's `open_stream`, the `MediaManager`'s ports, and a
`_LegAudio` sink per leg that pushes the leg's PCM straight into its ASR stream and reports DTMF,
inactivity and a refused push. Audio never goes through the call core or the front end, so another
implementation can run media in worker processes and the engine in its own (the audio then flows
worker → engine) behind these same methods and events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from asr_core.api import SAMPLE_RATE_HZ, AsrEvent, EventCallback, StreamEnded, StreamOptions, TranscriptEvent
from asr_core.errors import AsrError
from gateway.call.contract import (
    AsrEnded,
    AsrOpened,
    AsrRefused,
    AudioRefused,
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
from gateway.rtp.media import MediaSink
from gateway.rtp.ports import PortsExhausted
from gateway.rtp.stats import MediaStats
from gateway.sdp import MediaPlan

logger = logging.getLogger(__name__)


class LegEvents(Protocol):
    """Where leg inputs go (the front end); called on the event loop."""

    def leg_event(self, call_id: str, event: LegInput) -> None: ...


class Legs(Protocol):
    """What the front end needs of wherever the legs run."""

    def start(self, events: LegEvents) -> None:
        """Bind the event receiver; called once on the running loop."""

    def execute(self, call_id: str, effect: LegEffect) -> None:
        """Carry out one leg effect; its outcome comes back as a leg input (never synchronously)."""

    def discard(self, call_id: str) -> None:
        """The call is gone: close whatever of its legs is still open, report nothing more."""

    async def close(self) -> None:
        """Stop: cancel what is in flight (calls were ended or discarded before)."""


# --- in this process ----------------------------------------------------------------------------------


class AsrStreamLike(Protocol):
    """What a leg needs of `asr_core.engine.AsrStream`."""

    def push(self, pcm: NDArray[np.float32]) -> None: ...

    def finish(self) -> None: ...

    def close(self) -> None: ...


class StreamOpener(Protocol):
    """What a leg needs of `asr_core.engine.AsrEngine`."""

    def open_stream(
        self, stream_id: str, options: StreamOptions, on_event: EventCallback
    ) -> AsrStreamLike: ...


class CallMediaLike(Protocol):
    """One leg's RTP receiver (gateway.rtp.receiver.CallMedia)."""

    @property
    def port(self) -> int: ...

    def update(self, plan: MediaPlan) -> None: ...

    def close(self) -> MediaStats:
        """Flush (the last audio reaches the sink), free the ports and return the final stats."""


class MediaOpener(Protocol):
    """gateway.rtp.receiver.MediaManager: binds a port pair and starts receiving (PortsExhausted: 503)."""

    async def open(self, plan: MediaPlan | None, sink: MediaSink, *, name: str = "") -> CallMediaLike:
        """`plan` None: a delayed offer; the port takes nothing until `update()` with the answer."""


@dataclass(eq=False, slots=True)
class _LegAudio:
    """One leg in this process: its ASR stream, its media, and the audio path between them (the leg's
    `MediaSink`: PCM → `stream.push`; DTMF and inactivity → leg inputs)."""

    call_id: str
    name: str
    report: Callable[[LegInput], None]
    stream_id: str = ""
    stream: AsrStreamLike | None = None
    media: CallMediaLike | None = None
    opening: asyncio.Task[None] | None = None
    accepting: bool = False  # audio goes into the stream (until it is finished, ends or refuses)
    samples: int = 0
    discarded: bool = False

    def on_audio(self, pcm16k: NDArray[np.float32], start_ms: int) -> None:
        if not self.accepting or self.stream is None:
            return
        try:
            self.stream.push(pcm16k)
        except (AsrError, ValueError) as e:
            self.accepting = False
            self.report(AudioRefused(self.name, str(e)))
            return
        self.samples += len(pcm16k)

    def on_dtmf(self, digit: str, start_ms: int, duration_ms: int) -> None:
        self.report(Dtmf(self.name, digit, start_ms, duration_ms))

    def on_inactive(self) -> None:
        self.report(MediaInactive(self.name))


class LocalLegs:
    """Legs in this process: see the module docstring."""

    def __init__(self, engine: StreamOpener, media: MediaOpener) -> None:
        self.engine = engine
        self.media = media
        self._calls: dict[str, dict[str, _LegAudio]] = {}  # call id -> leg name -> leg
        self._opening: set[asyncio.Task[None]] = set()
        self._events: LegEvents | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, events: LegEvents) -> None:
        self._events = events
        self._loop = asyncio.get_running_loop()

    def execute(self, call_id: str, effect: LegEffect) -> None:
        legs = self._calls.setdefault(call_id, {})
        leg = legs.get(effect.leg)
        if leg is None:
            leg = legs[effect.leg] = _LegAudio(
                call_id, effect.leg, lambda event: self._report(call_id, event)
            )
        match effect:
            case OpenAsr():
                self._open_asr(leg, effect)
            case OpenMedia(plan=plan):
                assert self._loop is not None
                leg.opening = task = self._loop.create_task(self._open_media(leg, plan))
                self._opening.add(task)
                task.add_done_callback(self._opening.discard)
            case UpdateMedia(plan=plan):
                if leg.media is not None:
                    leg.media.update(plan)
            case CloseMedia():
                self._close_media(leg)
            case FinishAsr():
                self._finish_asr(leg)
            case CloseAsr():
                self._close_asr(leg)

    def discard(self, call_id: str) -> None:
        for leg in self._calls.pop(call_id, {}).values():
            leg.discarded = True  # a port still opening is closed when it arrives
            leg.accepting = False
            if leg.media is not None:
                with contextlib.suppress(Exception):
                    leg.media.close()
                leg.media = None
            if leg.stream is not None:
                with contextlib.suppress(AsrError, RuntimeError):
                    leg.stream.close()
                leg.stream = None

    async def close(self) -> None:
        tasks = list(self._opening)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # --- ASR ---

    def _open_asr(self, leg: _LegAudio, effect: OpenAsr) -> None:
        leg.stream_id = effect.stream_id
        try:
            leg.stream = self.engine.open_stream(effect.stream_id, effect.options, self._asr_callback(leg))
        except ValueError as e:  # a language (or lookahead) the model does not have
            self._report(leg.call_id, AsrRefused(leg.name, str(e), unknown_language=True))
            return
        except (AsrError, RuntimeError) as e:
            self._report(leg.call_id, AsrRefused(leg.name, str(e)))
            return
        leg.accepting = True
        self._report(leg.call_id, AsrOpened(leg.name))

    def _asr_callback(self, leg: _LegAudio) -> EventCallback:
        loop = self._loop
        assert loop is not None

        def on_event(event: AsrEvent) -> None:  # on an engine thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
                loop.call_soon_threadsafe(self._asr_event, leg, event)

        return on_event

    def _asr_event(self, leg: _LegAudio, event: AsrEvent) -> None:
        if isinstance(event, TranscriptEvent):
            self._deliver(leg.call_id, Transcript(leg.name, event))
            return
        leg.accepting = False
        leg.stream = None
        self._deliver(leg.call_id, AsrEnded(leg.name, event))

    def _finish_asr(self, leg: _LegAudio) -> None:
        leg.accepting = False
        if leg.stream is None:
            return
        try:
            leg.stream.finish()
        except (AsrError, RuntimeError) as e:
            # The engine is gone or the stream already ended: nothing more will come from it.
            leg.stream = None
            ended = StreamEnded(leg.stream_id, "error", error=f"finishing the stream failed: {e}")
            self._report(leg.call_id, AsrEnded(leg.name, ended))

    def _close_asr(self, leg: _LegAudio) -> None:
        leg.accepting = False
        stream, leg.stream = leg.stream, None
        if stream is not None:
            with contextlib.suppress(AsrError, RuntimeError):
                stream.close()

    # --- media ---

    async def _open_media(self, leg: _LegAudio, plan: MediaPlan | None) -> None:
        try:
            media = await self.media.open(plan, leg, name=leg.call_id)
        except Exception as e:
            leg.opening = None
            if not isinstance(e, PortsExhausted | OSError):
                logger.exception("call %s: opening the media of leg %s failed", leg.call_id, leg.name)
            if not leg.discarded:
                self._deliver(
                    leg.call_id, MediaFailed(leg.name, str(e), isinstance(e, PortsExhausted | OSError))
                )
            return
        leg.opening = None
        if leg.discarded:
            media.close()  # the call was given up while its port opened
            return
        leg.media = media
        self._deliver(leg.call_id, MediaOpened(leg.name, media.port))

    def _close_media(self, leg: _LegAudio) -> None:
        media, leg.media = leg.media, None
        stats: MediaStats | None = None
        if media is not None:
            try:
                stats = media.close()  # its last audio and DTMF reach `leg` (the sink) first
            except Exception:
                logger.exception("call %s: closing the media of leg %s failed", leg.call_id, leg.name)
        leg.accepting = False  # the media's last audio is in; nothing more goes into the stream
        fields = stats.to_fields() if stats is not None else {}
        audio_ms = leg.samples * 1000 // SAMPLE_RATE_HZ
        self._report(leg.call_id, MediaClosed(leg.name, fields, audio_ms))

    # --- reporting ---

    def _report(self, call_id: str, event: LegInput) -> None:
        """A result known while an effect is carried out: handed over after `execute` returns."""
        if self._loop is not None:
            self._loop.call_soon(self._deliver, call_id, event)

    def _deliver(self, call_id: str, event: LegInput) -> None:
        if self._events is not None and event.leg in self._calls.get(call_id, {}):
            self._events.leg_event(call_id, event)
