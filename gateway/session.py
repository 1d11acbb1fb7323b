"""`CallSession`: one call's state machine, joining its SIP dialog, its media and its ASR stream.

Theory of operation
-------------------
Rule 1: everything that decides a call's state lives in `TRANSITIONS` below; the methods only carry
out what the table says. An input the table does not allow raises `SessionStateError` and changes
nothing (the front end asks `accepts()` first where races are normal, e.g. a BYE crossing ours).

    SETUP ──answered──► ANSWERED ──acked──► ACTIVE ──(re-INVITE)──► ACTIVE
      │                    │                   │
      └─── any end ────────┴──── any end ──────┴──► ENDING ──stream_ended / finish_timeout──► ENDED

An end input (peer BYE, CANCEL, no ACK, RTP timeout, shutdown, error) moves to ENDING and names the
SIP action the front end must take (`SipAction`: nothing, BYE, or a final error response when the
INVITE is still unanswered). In ENDING the media is closed (its last audio is flushed into the ASR
stream), then the stream is finished; the stream's final transcript and `StreamEnded` arrive, then
`call_end` is published and the session is ENDED. If the engine does not end the stream within
`finish_timeout_s` the stream is closed and `call_end` published anyway (reason kept, `asr=timeout`).

Every call that reached SETUP publishes exactly one `call_start` and one `call_end`, in that order,
with all transcript and DTMF events between them.

Driven by: the front end (`answered`, `acked`, `reoffered`, `end`, `media_closed`), the media adapter
(`on_audio`, `on_dtmf`, `on_inactive` — the `MediaSink` contract), the ASR engine's events handed over
to the loop (`on_asr_event`), and one timer (`next_deadline`/`handle_timer`). No sockets, no threads.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from asr_core.api import AsrEvent, StreamEnded, TranscriptEvent
from asr_core.errors import AsrError
from gateway.events import CallEvent, EventPublisher, EventType, words_json

logger = logging.getLogger(__name__)

SAMPLE_RATE_HZ = 16_000


class AsrStreamLike(Protocol):
    """What the session needs of `asr_core.engine.AsrStream`."""

    def push(self, pcm: NDArray[np.float32]) -> None: ...

    def finish(self) -> None: ...

    def close(self) -> None: ...


class CallState(enum.Enum):
    SETUP = "setup"  # INVITE admitted; ASR stream open; media being prepared
    ANSWERED = "answered"  # 200 OK sent; waiting for the ACK
    ACTIVE = "active"  # ACK received
    ENDING = "ending"  # ended: media closed, ASR stream finishing
    ENDED = "ended"  # call_end published


class SessionInput(enum.Enum):
    ANSWERED = "answered"
    ACKED = "acked"
    REOFFERED = "reoffered"
    PEER_BYE = "bye"
    CANCELLED = "cancel"
    ACK_TIMEOUT = "no_ack"
    RTP_TIMEOUT = "rtp_timeout"
    SHUTDOWN = "shutdown"
    ERROR = "error"
    STREAM_ENDED = "stream_ended"
    FINISH_TIMEOUT = "finish_timeout"


class SipAction(enum.Enum):
    NONE = "none"  # the SIP core already answered (BYE, CANCEL) or nothing is needed
    BYE = "bye"  # the gateway hangs up an answered call
    REJECT = "reject"  # a final error response to the still unanswered INVITE


class SessionStateError(Exception):
    """An input the session's state table does not allow."""


# Inputs that end a call, and the call_end reason each gives.
END_INPUTS: frozenset[SessionInput] = frozenset(
    {
        SessionInput.PEER_BYE,
        SessionInput.CANCELLED,
        SessionInput.ACK_TIMEOUT,
        SessionInput.RTP_TIMEOUT,
        SessionInput.SHUTDOWN,
        SessionInput.ERROR,
    }
)

_S, _I, _A = CallState, SessionInput, SipAction
# state -> input -> (next state, SIP action)
TRANSITIONS: dict[CallState, dict[SessionInput, tuple[CallState, SipAction]]] = {
    _S.SETUP: {
        _I.ANSWERED: (_S.ANSWERED, _A.NONE),
        _I.CANCELLED: (_S.ENDING, _A.NONE),  # 487 already sent by the SIP core
        _I.SHUTDOWN: (_S.ENDING, _A.REJECT),
        _I.ERROR: (_S.ENDING, _A.REJECT),
    },
    _S.ANSWERED: {
        _I.ACKED: (_S.ACTIVE, _A.NONE),
        _I.REOFFERED: (_S.ANSWERED, _A.NONE),
        _I.PEER_BYE: (_S.ENDING, _A.NONE),  # a BYE may overtake the ACK
        _I.ACK_TIMEOUT: (_S.ENDING, _A.BYE),  # RFC 3261 §13.3.1.4
        _I.RTP_TIMEOUT: (_S.ENDING, _A.BYE),
        _I.SHUTDOWN: (_S.ENDING, _A.BYE),
        _I.ERROR: (_S.ENDING, _A.BYE),
    },
    _S.ACTIVE: {
        _I.REOFFERED: (_S.ACTIVE, _A.NONE),
        _I.PEER_BYE: (_S.ENDING, _A.NONE),
        _I.RTP_TIMEOUT: (_S.ENDING, _A.BYE),
        _I.SHUTDOWN: (_S.ENDING, _A.BYE),
        _I.ERROR: (_S.ENDING, _A.BYE),
    },
    _S.ENDING: {
        _I.STREAM_ENDED: (_S.ENDED, _A.NONE),
        _I.FINISH_TIMEOUT: (_S.ENDED, _A.NONE),
    },
    _S.ENDED: {},
}


class CallLog(logging.LoggerAdapter):
    """Prefixes every line with the gateway's call id (the key of the call's events in Redis)."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[{self.extra['call_id'] if self.extra else '-'}] {msg}", kwargs


@dataclass(frozen=True, slots=True)
class CallInfo:
    """What call_start carries (from the INVITE and the negotiation)."""

    call_id: str
    sip_call_id: str
    language: str
    extra: Mapping[str, str]  # from, to, dnis, headers (JSON), model, codec, ...


class CallSession:
    """See the module docstring."""

    def __init__(
        self,
        info: CallInfo,
        stream: AsrStreamLike,
        publisher: EventPublisher,
        *,
        now: float,
        leg: str = "caller",
        finish_timeout_s: float = 10.0,
        wall_clock: Callable[[], float] = time.time,
        on_end_request: Callable[[CallSession, SessionInput], None] | None = None,
    ) -> None:
        self.info = info
        self.call_id = info.call_id
        self.stream = stream
        self.publisher = publisher
        self.leg = leg
        self.state = CallState.SETUP
        self.reason: SessionInput | None = None
        self.started_at = now
        self.answered_at: float | None = None
        self.ended_at: float | None = None
        self.samples_pushed = 0
        self.dtmf_events = 0
        self.finals = 0
        self._finish_timeout_s = finish_timeout_s
        self._wall = wall_clock
        self._on_end_request = on_end_request
        self._deadline: float | None = None
        self._media_stats: dict[str, str] = {}
        self._media_closed = False
        self._stream_finished = False
        self._stream_end: StreamEnded | None = None
        # "error" (the engine refused to finish the stream) or "timeout" (no end in time); "" = fine.
        self._asr_failure = ""
        self._asr_error = ""  # why the stream refused audio or could not finish (engine failure)
        self.log = CallLog(logger, {"call_id": info.call_id})
        self._publish(self._event("call_start", extra=dict(info.extra)))

    # --- the table ---

    def accepts(self, event: SessionInput) -> bool:
        return event in TRANSITIONS[self.state]

    def _apply(self, event: SessionInput) -> SipAction:
        entry = TRANSITIONS[self.state].get(event)
        if entry is None:
            raise SessionStateError(f"call {self.call_id}: {event.value} not allowed in {self.state.value}")
        self.state, action = entry
        return action

    @property
    def over(self) -> bool:
        """True once the call is ending or ended (end inputs are no longer accepted)."""
        return self.state in (CallState.ENDING, CallState.ENDED)

    # --- front end inputs ---

    def answered(self, now: float) -> None:
        self._apply(SessionInput.ANSWERED)
        self.answered_at = now

    def acked(self, now: float) -> None:
        self._apply(SessionInput.ACKED)

    def reoffered(self, now: float) -> None:
        self._apply(SessionInput.REOFFERED)

    def end(self, event: SessionInput, now: float) -> SipAction:
        """Start ending the call; returns the SIP action the front end must take.

        Next the front end closes the media and calls `media_closed(stats)` (at once when there is no
        media), which finishes the ASR stream.
        """
        if event not in END_INPUTS:
            raise SessionStateError(f"{event.value} is not an end input")
        action = self._apply(event)
        self.reason = event
        self.ended_at = now
        self._deadline = now + self._finish_timeout_s
        self.log.debug("ending call: %s (sip: %s)", event.value, action.value)
        return action

    def media_closed(self, stats: Mapping[str, str] | None, now: float) -> None:
        """The media is closed (its last audio already delivered): finish the ASR stream."""
        if self.state is not CallState.ENDING or self._media_closed:
            return
        self._media_closed = True
        self._media_stats = dict(stats or {})
        if self._stream_end is not None:
            self._finalize(now)
            return
        self._stream_finished = True
        try:
            self.stream.finish()
        except (AsrError, RuntimeError) as e:
            # The engine is gone or the stream already ended: nothing more will come from it.
            self.log.warning("finishing the ASR stream failed: %s", e)
            self._asr_failure = "error"
            self._asr_error = self._asr_error or str(e)
            self._finalize(now)

    # --- MediaSink (called by the media adapter on the loop) ---

    def on_audio(self, pcm16k: NDArray[np.float32], start_ms: int) -> None:
        if self.state is CallState.ENDED or self._stream_finished or self._stream_end is not None:
            return
        try:
            self.stream.push(pcm16k)
        except (AsrError, ValueError) as e:
            self.log.warning("ASR stream refused audio: %s", e)
            self._asr_error = self._asr_error or str(e)
            self._request_end(SessionInput.ERROR)
            return
        self.samples_pushed += len(pcm16k)

    def on_dtmf(self, digit: str, start_ms: int, duration_ms: int) -> None:
        if self.state is CallState.ENDED:
            return
        self.dtmf_events += 1
        self._publish(self._event("dtmf", text=digit, start_ms=start_ms, end_ms=start_ms + duration_ms))

    def on_inactive(self) -> None:
        """No RTP for the (hold-aware) inactivity timeout: the gateway ends the call with a BYE."""
        self._request_end(SessionInput.RTP_TIMEOUT)

    # --- ASR events (already on the loop) ---

    def on_asr_event(self, event: AsrEvent, now: float) -> None:
        if self.state is CallState.ENDED:
            return
        if isinstance(event, TranscriptEvent):
            if event.kind == "final":
                self.finals += 1
            self._publish(
                self._event(
                    event.kind,
                    segment_id=event.segment_id,
                    text=event.text,
                    start_ms=event.start_ms,
                    end_ms=event.end_ms,
                    lang=event.detected_language or self.info.language,
                    extra={"words": words_json(event.words)} if event.words else {},
                )
            )
            return
        self._stream_end = event
        if event.reason == "error":
            self.log.warning("ASR stream failed: %s", event.error)
        if self.state is CallState.ENDING:
            if self._media_closed:
                self._finalize(now)
            return
        # The engine ended the stream on its own (an error or a shutdown): the call cannot go on.
        self._request_end(SessionInput.ERROR)

    # --- timer ---

    def next_deadline(self) -> float | None:
        return self._deadline if self.state is CallState.ENDING else None

    def handle_timer(self, now: float) -> None:
        if self.state is not CallState.ENDING or self._deadline is None or now < self._deadline:
            return
        self.log.warning("ASR stream did not end within %.1f s; closing it", self._finish_timeout_s)
        self._asr_failure = "timeout"
        try:
            self.stream.close()
        except (AsrError, RuntimeError) as e:
            self.log.debug("closing the ASR stream failed: %s", e)
        self._finalize(now, event=SessionInput.FINISH_TIMEOUT)

    # --- helpers ---

    def _request_end(self, event: SessionInput) -> None:
        if self.over or not self.accepts(event):
            return
        if self._on_end_request is not None:
            self._on_end_request(self, event)

    def _finalize(self, now: float, event: SessionInput = SessionInput.STREAM_ENDED) -> None:
        self._apply(event)
        self._deadline = None
        extra: dict[str, str] = {
            "reason": (self.reason or SessionInput.ERROR).value,
            "duration_ms": str(round(1000 * ((self.ended_at or now) - self.started_at))),
            "audio_ms": str(self.samples_pushed * 1000 // SAMPLE_RATE_HZ),
            "dtmf_events": str(self.dtmf_events),
        }
        if self._stream_end is not None:
            extra["asr"] = self._stream_end.reason
            extra["asr_dropped_chunks"] = str(self._stream_end.dropped_chunks)
            if self._stream_end.error:
                extra["asr_error"] = self._stream_end.error[:300]
        if self._asr_failure:
            extra["asr"] = self._asr_failure
        if self._asr_error and "asr_error" not in extra:
            # The engine failed before its StreamEnded reached this call: its error is still known.
            extra["asr_error"] = self._asr_error[:300]
        for key, value in self._media_stats.items():
            extra.setdefault(key, value)
        self._publish(self._event("call_end", extra=extra))
        # The daemon logs the one INFO line per call (from call_end); this is the session's view.
        self.log.debug(
            "call ended: %s, %s ms audio, %d finals", extra["reason"], extra["audio_ms"], self.finals
        )

    def _event(self, type: EventType, **fields: Any) -> CallEvent:
        fields.setdefault("lang", self.info.language)
        return CallEvent(
            type,
            call_id=self.info.call_id,
            sip_call_id=self.info.sip_call_id,
            leg=self.leg,
            ts=self._wall(),
            **fields,
        )

    def _publish(self, event: CallEvent) -> None:
        try:
            self.publisher.publish(event)
        except Exception:
            # The publisher must never block or raise; if it does, the call still goes on.
            self.log.exception("publishing %s failed", event.type)
