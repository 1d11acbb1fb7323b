"""`CallCore`: every decision about one call, pure. Inputs in (with `now`), effects out.

Theory of operation
-------------------
Rule 1: every change of a call's state is a row of `TRANSITIONS`: (state, input) -> (next state,
actions). `handle()` turns what happened into a table input, looks the row up and carries out its
actions in order; an action may raise a follow-up input (e.g. the last leg's port is open:
MEDIA_READY), which is looked up after the current row is done, never from inside it. An input the
current state does not list is ignored: it is a race with nothing left to do (a BYE crossing ours, a
stream ending after call_end).

    NEW ─offer_ok─► OPENING ─asr_ready─► SETUP ─media_ready─► RINGING ─answer_due─► ANSWERED ─acked─► ACTIVE
     │                 │                   │                     │                      │                │
  offer_refused    refused/cancel/       any end ──────────── any end ──────────── any end ──────── any end
     ▼             shutdown/error          ▼                     ▼                      ▼                ▼
   ENDED ◄───────────┘ (nothing          ENDING ─streams_ended / finish_timeout─► ENDED (call_end)
                        published)

- OPENING: each leg's ASR stream is being opened; nothing is published yet, so a refusal here leaves
  no trace but the SIP answer. SETUP: call_start is out, each leg's RTP port is being opened.
  RINGING: 180 sent and the answer delay running (left at once when there is none). ANSWERED: our 2xx
  (with our answer, or our offer when the INVITE had none) waits for the ACK. ENDING: over for SIP.
- An end input (peer BYE, CANCEL, no ACK, RTP timeout, shutdown, error, no port) names the SIP action
  in its row: nothing (the SIP core already answered), REJECT (a final error response to an unanswered
  INVITE) or BYE; `END_REASONS` gives call_end's `reason` (and the BYE's Reason text) for each.

Rule 2, the ending order, per leg: close its media (the last audio is flushed into its ASR stream)
→ MediaClosed with the leg's stats → finish its ASR stream → its final transcripts → AsrEnded. When
every leg's stream has ended, call_end is published. A stream that does not end within
`finish_timeout_s` is closed and call_end published anyway (`asr=timeout`). Every call that published
call_start publishes exactly one call_end, after every transcript and DTMF event of the call.

Rule 3, legs: a call has 1..N legs, each an audio stream with its own media plan, RTP port, ASR
stream, stats and `leg` name on its events; call_start and call_end are once per call, on the first
leg. A trunk call has one leg, `caller`; a SIPREC recording session (RFC 7866) one per recorded
stream, named from its metadata (gateway.siprec.recording.name_legs); a plain offer with several
audio streams one per stream when multi-leg calls are allowed. A re-offer updates the legs' media
and the recording metadata; a stream it drops (port 0) ends that leg alone (its media closes, its
last finals come); a stream it adds is refused (port 0). Audio never passes through this core:
whoever runs the legs wires a leg's media to its ASR stream. The core sees a leg's lifecycle (open
ASR → port → update → close → stats → finish), its media events (DTMF, inactivity) and its ASR
events (transcripts, stream end).

Driven by the front end (gateway.call.frontend), which turns SIP call events, leg results and media/
ASR events into the inputs below and carries out the effects. No sockets, tasks, threads or clocks.
"""

from __future__ import annotations

import enum
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from asr_core.api import StreamEnded, StreamOptions, TranscriptEvent
from gateway.addresses import advertised_address
from gateway.call.contract import (
    Acked,
    AckTimedOut,
    Answer,
    AnswerReoffer,
    AsrEnded,
    AsrOpened,
    AsrRefused,
    AudioRefused,
    CallInput,
    Cancelled,
    CloseAsr,
    CloseMedia,
    Dtmf,
    Effect,
    Failed,
    FinishAsr,
    Hangup,
    LegInput,
    MediaClosed,
    MediaFailed,
    MediaInactive,
    MediaOpened,
    Offered,
    OpenAsr,
    OpenMedia,
    PeerHungUp,
    Publish,
    Reject,
    RejectReoffer,
    ReofferAcked,
    Reoffered,
    Ring,
    Shutdown,
    Transcript,
    UpdateMedia,
)
from gateway.call.invite import call_metadata, choose_language
from gateway.events import CallEvent, EventType, words_json
from gateway.sdp import (
    MediaPlan,
    Negotiation,
    SdpAnswerer,
    SdpError,
    negotiate,
    negotiate_answer,
    parse_sdp,
)
from gateway.sip.headers import tokens_list
from gateway.sip.message import SipRequest
from gateway.siprec.metadata import MetadataError, RecordingMetadata, merge
from gateway.siprec.multipart import BodyError
from gateway.siprec.recording import (
    OfferBody,
    SessionKind,
    name_legs,
    participants_field,
    read_offer_body,
    session_kind,
    stream_limit,
)

logger = logging.getLogger(__name__)


# --- configuration --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CallConfig:
    """The per-call choices (built from `gateway.config.Settings` by `FrontEndConfig.from_settings`)."""

    codecs: tuple[str, ...] = ("PCMU", "PCMA")
    ptime_ms: int = 20  # a=ptime of our SDP when the offer has none
    default_language: str = "en-US"
    lookahead: int | None = None
    language_header: str = "X-Language"
    dnis_languages: Mapping[str, str] = field(default_factory=dict)
    metadata_headers: tuple[str, ...] = ("X-*",)
    answer_delay_s: float = 0.0  # ring (180) this long before answering
    finish_timeout_s: float = 10.0  # after the hang-up, longest wait for the streams to end
    model_name: str = ""
    # Contact and SDP addresses: the first concrete one of these, else our address toward the caller.
    contact_hosts: tuple[str, ...] = ()
    media_hosts: tuple[str, ...] = ()
    # Audio streams of one offer taken as legs (the rest are answered with port 0): a SIPREC recording
    # session takes up to `max_streams`, a plain call one unless `multi_leg_calls`.
    max_streams: int = 1
    multi_leg_calls: bool = False
    siprec: bool = False  # SIPREC recording sessions (RFC 7866) are taken


# --- the table --------------------------------------------------------------------------------------


class CallState(enum.Enum):
    NEW = "new"
    OPENING = "opening"  # ASR streams opening; nothing published
    SETUP = "setup"  # call_start published; RTP ports opening
    RINGING = "ringing"  # ports open; answer delay running
    ANSWERED = "answered"  # 2xx sent, ACK outstanding
    ACTIVE = "active"  # ACK received
    ENDING = "ending"  # media closing, streams finishing
    ENDED = "ended"  # call_end published (or nothing was ever published)


class Input(enum.Enum):
    """Table inputs (`END_REASONS` gives the call_end `reason` of those that end a call)."""

    OFFER_OK = "offer_ok"
    OFFER_REFUSED = "offer_refused"  # the INVITE's SDP cannot be used (400/488)
    ASR_READY = "asr_ready"  # every leg's stream is open
    LANGUAGE_FALLBACK = "language_fallback"  # the chosen language is unknown: retry in the default
    ASR_REFUSED = "asr_refused"
    MEDIA_READY = "media_ready"  # every leg's port is open
    MEDIA_FAILED = "media_failed"
    ANSWER_DUE = "answer_due"
    ACKED = "acked"
    REOFFERED = "reoffered"
    REOFFER_ACKED = "reoffer_acked"
    PEER_BYE = "peer_bye"
    CANCELLED = "cancelled"
    ACK_TIMEOUT = "ack_timeout"
    RTP_TIMEOUT = "rtp_timeout"
    SHUTDOWN = "shutdown"
    ERROR = "error"
    STREAMS_ENDED = "streams_ended"  # every leg's stream ended after its media closed
    FINISH_TIMEOUT = "finish_timeout"


class Action(enum.Enum):
    REJECT = "reject"  # final error response to the INVITE (status from the input)
    OPEN_STREAMS = "open_streams"  # OpenAsr for every leg
    REOPEN_IN_DEFAULT_LANGUAGE = "reopen_in_default_language"
    PUBLISH_START = "publish_start"
    OPEN_MEDIA = "open_media"  # OpenMedia for every leg
    RING = "ring"  # 180 and the answer timer (or ANSWER_DUE at once without a delay)
    ANSWER = "answer"  # 2xx with our answer, or our offer (delayed offer)
    TAKE_ANSWER = "take_answer"  # the ACK's answer to our offer; none usable: ERROR
    REOFFER = "reoffer"  # answer a re-INVITE (update the legs) or refuse it (session unchanged)
    REFUSE_REOFFER = "refuse_reoffer"  # 491: the call is ending
    TAKE_REOFFER_ANSWER = "take_reoffer_answer"
    BYE = "bye"
    END_LEGS = "end_legs"  # close every leg's media, then finish its stream; start the finish timer
    CLOSE_STREAMS = "close_streams"  # close every stream still open (refusal, finish timeout)
    PUBLISH_END = "publish_end"


_S, _I, _A = CallState, Input, Action
_ENDS_UNANSWERED = {  # an end before our answer: the INVITE still needs its final response
    _I.CANCELLED: (_S.ENDING, (_A.END_LEGS,)),  # 487 already sent by the SIP core
    _I.SHUTDOWN: (_S.ENDING, (_A.REJECT, _A.END_LEGS)),
    _I.ERROR: (_S.ENDING, (_A.REJECT, _A.END_LEGS)),
}
_ENDS_ANSWERED = {
    _I.PEER_BYE: (_S.ENDING, (_A.END_LEGS,)),
    _I.RTP_TIMEOUT: (_S.ENDING, (_A.BYE, _A.END_LEGS)),
    _I.SHUTDOWN: (_S.ENDING, (_A.BYE, _A.END_LEGS)),
    _I.ERROR: (_S.ENDING, (_A.BYE, _A.END_LEGS)),
}
_REOFFERS = {
    _I.REOFFERED: (None, (_A.REOFFER,)),  # None: the state stays
    _I.REOFFER_ACKED: (None, (_A.TAKE_REOFFER_ANSWER,)),
}

Row = tuple[CallState | None, tuple[Action, ...]]
# state -> input -> (next state or None for "stays", actions in order)
TRANSITIONS: dict[CallState, dict[Input, Row]] = {
    _S.NEW: {
        _I.OFFER_OK: (_S.OPENING, (_A.OPEN_STREAMS,)),
        _I.OFFER_REFUSED: (_S.ENDED, (_A.REJECT,)),
        _I.ERROR: (_S.ENDED, (_A.REJECT,)),  # the offer could not even be read: 500
    },
    _S.OPENING: {
        _I.ASR_READY: (_S.SETUP, (_A.PUBLISH_START, _A.OPEN_MEDIA)),
        _I.LANGUAGE_FALLBACK: (None, (_A.REOPEN_IN_DEFAULT_LANGUAGE,)),
        _I.ASR_REFUSED: (_S.ENDED, (_A.REJECT, _A.CLOSE_STREAMS)),
        _I.CANCELLED: (_S.ENDED, (_A.CLOSE_STREAMS,)),
        _I.SHUTDOWN: (_S.ENDED, (_A.REJECT, _A.CLOSE_STREAMS)),
        _I.ERROR: (_S.ENDED, (_A.REJECT, _A.CLOSE_STREAMS)),
    },
    _S.SETUP: {
        _I.MEDIA_READY: (_S.RINGING, (_A.RING,)),
        _I.MEDIA_FAILED: (_S.ENDING, (_A.REJECT, _A.END_LEGS)),
        **_ENDS_UNANSWERED,
    },
    _S.RINGING: {
        _I.ANSWER_DUE: (_S.ANSWERED, (_A.ANSWER,)),
        **_ENDS_UNANSWERED,
    },
    _S.ANSWERED: {
        _I.ACKED: (_S.ACTIVE, (_A.TAKE_ANSWER,)),
        _I.ACK_TIMEOUT: (_S.ENDING, (_A.BYE, _A.END_LEGS)),  # RFC 3261 §13.3.1.4
        **_REOFFERS,  # a re-INVITE may overtake the ACK
        **_ENDS_ANSWERED,  # so may a BYE
    },
    _S.ACTIVE: {
        **_REOFFERS,
        **_ENDS_ANSWERED,
    },
    _S.ENDING: {
        _I.REOFFERED: (None, (_A.REFUSE_REOFFER,)),
        _I.STREAMS_ENDED: (_S.ENDED, (_A.PUBLISH_END,)),
        _I.FINISH_TIMEOUT: (_S.ENDED, (_A.CLOSE_STREAMS, _A.PUBLISH_END)),
    },
    _S.ENDED: {},
}

# Inputs that end a call, and the call_end `reason` (also the BYE's Reason text) each gives.
END_REASONS: dict[Input, str] = {
    _I.PEER_BYE: "bye",
    _I.CANCELLED: "cancel",
    _I.ACK_TIMEOUT: "no_ack",
    _I.RTP_TIMEOUT: "rtp_timeout",
    _I.SHUTDOWN: "shutdown",
    _I.ERROR: "error",
    _I.MEDIA_FAILED: "error",
}


# --- legs -------------------------------------------------------------------------------------------


class MediaPhase(enum.Enum):
    NONE = "none"
    OPENING = "opening"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"  # closed, or never opened


class AsrPhase(enum.Enum):
    OPENING = "opening"
    OPEN = "open"
    FINISHING = "finishing"
    ENDED = "ended"  # StreamEnded received (or the stream was refused/closed: nothing more comes)


@dataclass(slots=True)
class Leg:
    """One audio stream of the call, as the core tracks it."""

    name: str
    stream_id: str
    plan: MediaPlan | None  # None until the answer to our offer (delayed offer)
    language: str
    index: int = 0  # its m= line
    media: MediaPhase = MediaPhase.NONE
    asr: AsrPhase = AsrPhase.OPENING
    port: int | None = None
    stats: dict[str, str] = field(default_factory=dict)
    audio_ms: int = 0
    dtmf_events: int = 0
    stream_end: StreamEnded | None = None
    asr_failure: str = ""  # "timeout" when the stream did not end in time
    refused_error: str = ""  # why the stream refused audio (the engine's error, kept for call_end)
    retired: bool = False  # a re-offer dropped its stream: it ended while the call goes on
    open_partial: TranscriptEvent | None = None  # the newest partial of a segment with no final yet


def assign_legs(
    call_id: str,
    negotiation: Negotiation | None,
    metadata: RecordingMetadata | None,
    language: str,
    *,
    recording: bool,
) -> list[Leg]:
    """The call's legs: one per accepted audio stream, in m= line order (a delayed offer: one, `caller`,
    on the stream of our offer), named by `gateway.siprec.recording.name_legs` and nowhere else. The
    first leg's ASR stream id is the call id; others add the name."""
    if negotiation is None:
        return [Leg("caller", call_id, None, language)]
    names = name_legs(negotiation.accepted, metadata, recording=recording)
    return [
        Leg(names[p.index], call_id if i == 0 else f"{call_id}:{names[p.index]}", p, language, index=p.index)
        for i, p in enumerate(negotiation.accepted)
    ]


class CallLog(logging.LoggerAdapter):
    """Prefixes every line with the gateway's call id (the key of the call's events in Redis)."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[{self.extra['call_id'] if self.extra else '-'}] {msg}", kwargs


# --- the core ---------------------------------------------------------------------------------------


class CallCore:
    """See the module docstring. `call_id` is the gateway's call id (CallEvent.call_id)."""

    def __init__(
        self,
        call_id: str,
        config: CallConfig,
        *,
        now: float,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.call_id = call_id
        self.config = config
        self.state = CallState.NEW
        self.reason: str | None = None  # call_end's reason, set by the input that ended the call
        self.legs: list[Leg] = []
        self.started_at = now
        self.ended_at: float | None = None
        self.log = CallLog(logger, {"call_id": call_id})
        self._wall = wall_clock
        self._now = now
        self._sip_call_id = ""
        self._metadata: dict[str, str] = {}
        self._contact_host = ""
        self._answerer: SdpAnswerer | None = None
        self._negotiation: Negotiation | None = None  # None until a delayed offer is answered
        self._kind: SessionKind = "plain"
        self._recording: RecordingMetadata | None = None  # SIPREC: the metadata as it stands
        self._our_offer: str | None = None  # our offer in a 2xx, waiting for the ACK's answer
        self._last_sdp = b""
        self._deadline: float | None = None
        self._rejection = (500, "error", "failed")  # the final response REJECT sends
        self._request: SipRequest | None = None  # the re-INVITE being handled
        self._ack_body = b""  # the ACK being handled
        self._subject: Leg | None = None  # the leg the current input is about
        self._raised: deque[Input] = deque()
        self._out: list[Effect] = []

    # --- queries ---

    @property
    def finished(self) -> bool:
        """call_end is out (or the call was refused before call_start): forget the call."""
        return self.state is CallState.ENDED

    @property
    def over(self) -> bool:
        return self.state in (CallState.ENDING, CallState.ENDED)

    def leg(self, name: str) -> Leg | None:
        return next((leg for leg in self.legs if leg.name == name), None)

    @property
    def live_legs(self) -> list[Leg]:
        """The legs whose stream the call still carries (not dropped by a re-offer)."""
        return [leg for leg in self.legs if not leg.retired]

    def next_deadline(self) -> float | None:
        return self._deadline if self.state in (CallState.RINGING, CallState.ENDING) else None

    # --- inputs ---

    def handle(self, event: CallInput, now: float) -> list[Effect]:
        """One input: what happened to the call. Returns the effects to carry out, in order."""
        self._now = now
        inp = self._classify(event)
        if inp is not None:
            self._raise(inp)
        return self._run()

    def handle_timer(self, now: float) -> list[Effect]:
        self._now = now
        if self._deadline is not None and now >= self._deadline:
            if self.state is CallState.RINGING:
                self._raise(Input.ANSWER_DUE)
            elif self.state is CallState.ENDING:
                self.log.warning(
                    "ASR stream did not end within %.1f s; closing it", self.config.finish_timeout_s
                )
                self._raise(Input.FINISH_TIMEOUT)
        return self._run()

    def _classify(self, event: CallInput) -> Input | None:
        """The table input an event amounts to, after the per-leg bookkeeping it needs (None: the
        event is recorded or published, the call's state does not change)."""
        self._subject = leg = self.leg(event.leg) if isinstance(event, LegInput) else None
        if isinstance(event, LegInput) and leg is None:
            return None  # a leg the call does not have
        match event:
            case Offered():
                return self._offer(event)
            case Acked(body=body):
                self._ack_body = body
                return Input.ACKED
            case Reoffered(request=request):
                self._request = request
                return Input.REOFFERED
            case ReofferAcked(body=body):
                self._ack_body = body
                return Input.REOFFER_ACKED
            case PeerHungUp():
                return Input.PEER_BYE
            case Cancelled():
                return Input.CANCELLED
            case AckTimedOut():
                return Input.ACK_TIMEOUT
            case Shutdown():
                return Input.SHUTDOWN
            case Failed(error=error):
                self.log.error("call failed: %s", error)
                return Input.ERROR
        assert leg is not None
        if isinstance(event, AsrOpened | AsrRefused) and leg.asr is not AsrPhase.OPENING:
            return None  # a result nobody waits for (a duplicate)
        if isinstance(event, MediaOpened) and leg.media is not MediaPhase.OPENING:
            return None
        if isinstance(event, MediaFailed) and leg.media in (MediaPhase.NONE, MediaPhase.CLOSED):
            return None
        match event:
            case AsrOpened():
                if self.over:
                    self._out.append(CloseAsr(leg.name))  # the call ended while it opened
                    leg.asr = AsrPhase.ENDED
                    return None
                leg.asr = AsrPhase.OPEN
                return Input.ASR_READY if all(g.asr is AsrPhase.OPEN for g in self.legs) else None
            case AsrRefused(error=error, unknown_language=unknown):
                self.log.warning("ASR stream of leg %s refused: %s", leg.name, error)
                if unknown and leg.language != self.config.default_language:
                    return Input.LANGUAGE_FALLBACK
                leg.asr = AsrPhase.ENDED
                self._rejection = (503, "transcription unavailable", "failed")
                return Input.ASR_REFUSED
            case MediaOpened(port=port):
                leg.port, leg.media = port, MediaPhase.OPEN
                if self.over:
                    self._close_media(leg)  # the call ended while the port opened
                    return None
                return Input.MEDIA_READY if all(g.media is MediaPhase.OPEN for g in self.legs) else None
            case MediaFailed(error=error, exhausted=exhausted):
                self.log.warning("media of leg %s failed: %s", leg.name, error)
                opening, leg.media = leg.media is MediaPhase.OPENING, MediaPhase.CLOSED
                if self.over:
                    return self._finish(leg)
                if not opening:
                    return Input.ERROR  # a live leg's media is gone (its receiver died): no stats
                self._rejection = (503 if exhausted else 500, "error", "failed")
                return Input.MEDIA_FAILED
            case MediaClosed(stats=stats, audio_ms=audio_ms):
                leg.media, leg.stats, leg.audio_ms = MediaPhase.CLOSED, dict(stats), audio_ms
                return self._finish(leg)
            case Dtmf(digit=digit, start_ms=start_ms, duration_ms=duration_ms):
                if self._publishing:
                    leg.dtmf_events += 1
                    self._publish("dtmf", leg, text=digit, start_ms=start_ms, end_ms=start_ms + duration_ms)
                return None
            case MediaInactive():
                return None if leg.retired else Input.RTP_TIMEOUT
            case AudioRefused(error=error):
                self.log.warning("ASR stream of leg %s refused audio: %s", leg.name, error)
                leg.refused_error = leg.refused_error or error
                return Input.ERROR
            case Transcript(event=ev):
                leg.open_partial = ev if ev.kind == "partial" else None
                self._publish_transcript(leg, ev)
                return None
            case AsrEnded(event=ended):
                leg.stream_end, leg.asr = ended, AsrPhase.ENDED
                if ended.reason == "error":
                    self.log.warning("ASR stream of leg %s failed: %s", leg.name, ended.error)
                    if leg.open_partial is not None:
                        # The engine went before it closed the segment: its newest partial becomes the
                        # final, marked, so that a consumer of finals still gets the words heard.
                        final = replace(leg.open_partial, kind="final")
                        self._publish_transcript(leg, final, {"unconfirmed": "1"})
                leg.open_partial = None
                if self.over:
                    return self._legs_done()
                if leg.retired:
                    return None  # its stream was dropped by a re-offer: its end is expected
                # The engine ended the stream on its own (an error or its shutdown): the call cannot go on.
                return Input.ERROR
        return None  # pragma: no cover - every input type is matched above

    @property
    def _publishing(self) -> bool:
        """Between call_start and call_end."""
        return self.state not in (CallState.NEW, CallState.OPENING, CallState.ENDED)

    # --- the table, run ---

    def _raise(self, inp: Input) -> None:
        self._raised.append(inp)

    def _run(self) -> list[Effect]:
        while self._raised:
            inp = self._raised.popleft()
            row = TRANSITIONS[self.state].get(inp)
            if row is None:
                self.log.debug("%s ignored in %s", inp.value, self.state.value)
                continue
            next_state, actions = row
            if inp in END_REASONS:
                self.reason, self.ended_at = END_REASONS[inp], self._now
            self.log.debug("%s: %s -> %s", inp.value, self.state.value, (next_state or self.state).value)
            if next_state is not None:
                self.state = next_state
            for action in actions:
                self._act(action, inp)
        out, self._out = self._out, []
        return out

    def _act(self, action: Action, inp: Input) -> None:
        match action:
            case Action.REJECT:
                status, warning, result = (
                    (503, "shutdown", "failed") if inp is Input.SHUTDOWN else self._rejection
                )
                self._out.append(Reject(status, warning, result))
            case Action.OPEN_STREAMS:
                for leg in self.legs:
                    self._open_stream(leg)
            case Action.REOPEN_IN_DEFAULT_LANGUAGE:
                subject = self._subject
                assert subject is not None
                self.log.warning(
                    "language %r not available; using %r", subject.language, self.config.default_language
                )
                subject.language = self.config.default_language
                self._open_stream(subject)
            case Action.PUBLISH_START:
                self._publish("call_start", self.legs[0], extra=self._metadata)
            case Action.OPEN_MEDIA:
                for leg in self.legs:
                    leg.media = MediaPhase.OPENING
                    self._out.append(OpenMedia(leg.name, leg.plan))
            case Action.RING:
                if self.config.answer_delay_s > 0:
                    self._out.append(Ring())
                    self._deadline = self._now + self.config.answer_delay_s
                else:
                    self._raise(Input.ANSWER_DUE)
            case Action.ANSWER:
                self._deadline = None
                self._out.append(Answer(self._our_sdp(), self._contact_host, self._kind == "recording"))
            case Action.TAKE_ANSWER:
                if self._our_offer is not None and not self._take_answer():
                    # RFC 3261 §13.2.1 / §13.3.1.4: no usable answer to our offer: the session cannot go on.
                    self._raise(Input.ERROR)
            case Action.REOFFER:
                self._reoffer()
            case Action.REFUSE_REOFFER:
                self._out.append(RejectReoffer(491, "call ending"))
            case Action.TAKE_REOFFER_ANSWER:
                if self._our_offer is not None and not self._take_answer():
                    self.log.info("no usable answer in the re-INVITE's ACK; media unchanged")
            case Action.BYE:
                self._out.append(Hangup(END_REASONS[inp]))
            case Action.END_LEGS:
                self._deadline = self._now + self.config.finish_timeout_s
                for leg in self.legs:
                    if leg.media is MediaPhase.OPEN:
                        self._close_media(leg)
                    elif leg.media in (MediaPhase.NONE, MediaPhase.CLOSED):  # no port, or it failed
                        leg.media = MediaPhase.CLOSED
                        self._finish(leg)
                    # OPENING: closed when its port arrives (MediaOpened)
                done = self._legs_done()
                if done is not None:
                    self._raise(done)
            case Action.CLOSE_STREAMS:
                for leg in self.legs:
                    if leg.asr in (AsrPhase.OPEN, AsrPhase.FINISHING):
                        self._out.append(CloseAsr(leg.name))
                        if inp is Input.FINISH_TIMEOUT:
                            leg.asr_failure = "timeout"
                        leg.asr = AsrPhase.ENDED
            case Action.PUBLISH_END:
                self._deadline = None
                self._publish("call_end", self.legs[0], extra=self._end_fields())

    # --- the offer ---

    def _offer(self, event: Offered) -> Input:
        req, cfg = event.request, self.config
        self._sip_call_id = req.call_id
        try:
            body = read_offer_body(req.headers.get("Content-Type"), req.body)
            kind = self._session_kind(req, body)
            if kind == "recording" and body.sdp is None:
                raise BodyError("a SIPREC INVITE without an SDP offer (RFC 7866)")
            negotiation = self._negotiate(body.sdp, kind=kind) if body.sdp is not None else None
        except (BodyError, MetadataError, SdpError) as e:
            status = e.status_hint if isinstance(e, SdpError) else e.status
            self.log.info("offer refused (%d): %s", status, e)
            self._rejection = (status, str(e)[:200], "rejected_codec")
            return Input.OFFER_REFUSED
        for warning in body.metadata.warnings if body.metadata is not None else ():
            self.log.info("recording metadata: %s", warning)
        self._negotiation, self._kind, self._recording = negotiation, kind, body.metadata
        language, source = choose_language(
            req, header=cfg.language_header, dnis_languages=cfg.dnis_languages, default=cfg.default_language
        )
        self.legs = assign_legs(
            self.call_id, negotiation, body.metadata, language, recording=kind == "recording"
        )
        if event.streams_free is not None and len(self.legs) > event.streams_free:
            self.log.info("%d streams offered, room for %d", len(self.legs), event.streams_free)
            self._rejection = (503, "Too Many Calls", "rejected_capacity")
            return Input.OFFER_REFUSED
        first = self.legs[0].plan
        self._metadata = {
            **call_metadata(req, event.flow, cfg.metadata_headers),
            "model": cfg.model_name,
            "language_source": source,
            "codec": first.codec if first is not None else "",  # a delayed offer: known after the ACK
            "legs": json.dumps([leg.name for leg in self.legs]),
            **self._recording_fields(),
        }
        self._contact_host = advertised_address(*cfg.contact_hosts, event.local_ip)
        self._answerer = SdpAnswerer(advertised_address(*cfg.media_hosts, event.local_ip))
        return Input.OFFER_OK

    def _session_kind(self, req: SipRequest, body: OfferBody) -> SessionKind:
        if not self.config.siprec:
            return "plain"
        return session_kind(tokens_list(req.headers.get_all("Require")), req.headers.get_all("Contact"), body)

    def _recording_fields(self) -> dict[str, str]:
        """call_start/call_end fields of a SIPREC session: who takes part, and which legs are theirs."""
        if self._kind != "recording":
            return {}
        out = {"recording": "siprec", "participants": "[]", "cs_call_id": ""}
        if self._recording is not None:
            legs = {leg.index: leg.name for leg in self.legs}
            plans = [leg.plan for leg in self.legs if leg.plan is not None]
            out["participants"] = participants_field(self._recording, legs, plans)
            out["cs_call_id"] = self._recording.cs_call_id
        return out

    def _negotiate(
        self, offer: bytes | str, answer: bytes | None = None, *, kind: SessionKind | None = None
    ) -> Negotiation:
        """RFC 3264 for the streams a call may take: their offer (or, with `answer`, our offer and
        their answer). Raises SdpError (400 malformed, 488 nothing acceptable)."""
        cfg = self.config
        kind = kind or self._kind
        if answer is None:
            return negotiate(
                parse_sdp(offer),
                codecs=cfg.codecs,
                max_streams=stream_limit(
                    kind, max_streams=cfg.max_streams, multi_leg_calls=cfg.multi_leg_calls
                ),
                default_ptime_ms=cfg.ptime_ms,
                recording=kind == "recording",
            )
        return negotiate_answer(
            parse_sdp(offer),
            parse_sdp(answer),
            codecs=cfg.codecs,
            max_streams=len(self.legs),
            default_ptime_ms=cfg.ptime_ms,
        )

    def _open_stream(self, leg: Leg) -> None:
        leg.asr = AsrPhase.OPENING
        options = StreamOptions(language=leg.language, lookahead=self.config.lookahead)
        self._out.append(OpenAsr(leg.name, leg.stream_id, options))

    def _our_sdp(self) -> bytes:
        """Our answer to their offer, or (no offer yet: §13.2.1 delayed offer) our offer."""
        assert self._answerer is not None
        if self._negotiation is not None:
            at = {leg.index: leg for leg in self.live_legs}
            ports = [at[p.index].port or 0 for p in self._negotiation.accepted]
            sdp = self._answerer.answer(self._negotiation, ports)
        else:
            ports = [leg.port or 0 for leg in self.legs]
            sdp = self._answerer.offer(ports, codecs=self.config.codecs, ptime_ms=self.config.ptime_ms)
            self._our_offer = sdp
        self._last_sdp = sdp.encode()
        return self._last_sdp

    def _take_answer(self) -> bool:
        """The peer's answer (in an ACK) to the offer in our 2xx: apply it to the legs' media."""
        offer, self._our_offer = self._our_offer, None
        body, self._ack_body = self._ack_body, b""
        if offer is None or not body:
            return False
        try:
            negotiation = self._negotiate(offer, body)
        except SdpError as e:
            self.log.info("unusable SDP answer: %s", e)
            return False
        self._apply(negotiation)
        return True

    def _reoffer(self) -> None:
        """RFC 3264 §8: a re-offer updates the legs' media (and a SIPREC session's metadata), or is
        refused and changes nothing (RFC 3261 §14.2). An offerless re-INVITE (a session refresh, or one
        that only carries new recording metadata) gets our current SDP as the offer; the ACK answers."""
        request, self._request = self._request, None
        assert request is not None
        try:
            body = read_offer_body(request.headers.get("Content-Type"), request.body)
            negotiation = self._renegotiate(body.sdp) if body.sdp is not None else None
        except (BodyError, MetadataError, SdpError) as e:
            status = e.status_hint if isinstance(e, SdpError) else e.status
            self._out.append(RejectReoffer(status, str(e)[:200]))
            return
        if body.metadata is not None:
            self._recording = merge(self._recording, body.metadata)
            for warning in self._recording.warnings:
                self.log.info("recording metadata: %s", warning)
        if negotiation is None:
            self._our_offer = self._last_sdp.decode()
            self._out.append(AnswerReoffer(self._last_sdp, self._contact_host))
            return
        self._apply(negotiation)
        self._out.append(AnswerReoffer(self._our_sdp(), self._contact_host))

    def _renegotiate(self, sdp: bytes) -> Negotiation:
        """A re-offer's negotiation, kept to the streams the call carries: a stream it adds is answered
        with port 0 (a new leg would need its port before the answer), a stream it drops ends its leg."""
        negotiation = self._negotiate(sdp)
        live = {leg.index for leg in self.live_legs}
        plans = tuple(p if p is not None and p.index in live else None for p in negotiation.plans)
        reasons = tuple(
            r if p is None or p.index in live else "a stream added mid-call is not taken"
            for p, r in zip(negotiation.plans, negotiation.reasons, strict=True)
        )
        if not any(plans):
            raise SdpError("the re-offer keeps none of the call's streams")
        return replace(negotiation, plans=plans, reasons=reasons)

    def _apply(self, negotiation: Negotiation) -> None:
        self._negotiation = negotiation
        by_index = {p.index: p for p in negotiation.accepted}
        for leg in self.live_legs:
            plan = by_index.get(leg.index)
            if plan is None:
                self._retire(leg)
                continue
            leg.plan = plan
            self._out.append(UpdateMedia(leg.name, plan))

    def _retire(self, leg: Leg) -> None:
        """The re-offer dropped the leg's stream: its media closes, its stream finishes (its last
        finals are published); the call goes on, and call_end still reports the leg."""
        self.log.info("leg %s: stream dropped by a re-offer", leg.name)
        leg.retired = True
        if leg.media is MediaPhase.OPEN:
            self._close_media(leg)
        elif leg.media is MediaPhase.NONE:
            leg.media = MediaPhase.CLOSED

    # --- ending ---

    def _close_media(self, leg: Leg) -> None:
        leg.media = MediaPhase.CLOSING
        self._out.append(CloseMedia(leg.name))

    def _finish(self, leg: Leg) -> Input | None:
        """The leg's media is closed: finish its stream (unless it already ended)."""
        if leg.asr is AsrPhase.OPEN:
            leg.asr = AsrPhase.FINISHING
            self._out.append(FinishAsr(leg.name))
        return self._legs_done()

    def _legs_done(self) -> Input | None:
        if self.state is not CallState.ENDING:
            return None
        if all(leg.media is MediaPhase.CLOSED and leg.asr is AsrPhase.ENDED for leg in self.legs):
            return Input.STREAMS_ENDED
        return None

    def _end_fields(self) -> dict[str, str]:
        reason = self.reason or "error"
        out = {
            "reason": reason,
            "duration_ms": str(round(1000 * ((self.ended_at or self._now) - self.started_at))),
        }
        per_leg = [_leg_fields(leg) for leg in self.legs]
        if len(per_leg) == 1:
            out.update({k: v for k, v in per_leg[0].items() if k not in out})
        else:
            out.update({k: v for k, v in _combined(per_leg).items() if k not in out})
            out["legs"] = json.dumps({leg.name: f for leg, f in zip(self.legs, per_leg, strict=True)})
        out.update(self._recording_fields())
        out.pop("cs_call_id", None)  # call_start has it
        self.log.debug("call ended: %s", reason)
        return out

    # --- events ---

    def _publish_transcript(self, leg: Leg, ev: TranscriptEvent, extra: dict[str, str] | None = None) -> None:
        if not self._publishing:
            return
        lang = ev.detected_language or leg.language
        fields = {**({"words": words_json(ev.words)} if ev.words else {}), **(extra or {})}
        self._publish(
            ev.kind, leg, segment_id=ev.segment_id, text=ev.text, start_ms=ev.start_ms,
            end_ms=ev.end_ms, lang=lang, extra=fields,
        )  # fmt: skip

    def _publish(self, type: EventType, leg: Leg, **fields: Any) -> None:
        fields.setdefault("lang", leg.language)
        self._out.append(
            Publish(
                CallEvent(
                    type,
                    call_id=self.call_id,
                    sip_call_id=self._sip_call_id,
                    leg=leg.name,
                    ts=self._wall(),
                    **fields,
                )
            )
        )


# call_end fields that add up over a call's legs; of the rest the first leg's value is kept, except
# the jitter (the worst leg's) and the ASR outcome (the first leg's that did not finish).
_SUMMED = ("audio_ms", "dtmf_events", "asr_dropped_chunks", "rtp_packets", "rtp_bytes", "rtp_lost",
           "rtp_late", "rtp_duplicate", "rtp_invalid", "rtp_ssrc_changes", "rtp_dtmf_events",
           "rtp_audio_ms", "rtp_concealed_ms")  # fmt: skip


def _combined(per_leg: list[dict[str, str]]) -> dict[str, str]:
    """The flat call_end fields of a call with several legs (each leg's own are in `legs`)."""
    out: dict[str, str] = {}
    for fields in per_leg:
        for key, value in fields.items():
            out.setdefault(key, value)
    for key in _SUMMED:
        values = [f[key] for f in per_leg if f.get(key, "").isdigit()]
        if values:
            out[key] = str(sum(int(v) for v in values))
    jitters = [
        (float(f["rtp_jitter_ms"]), f["rtp_jitter_ms"])
        for f in per_leg
        if _is_number(f.get("rtp_jitter_ms", ""))
    ]
    if jitters:
        out["rtp_jitter_ms"] = max(jitters)[1]
    failed = [f["asr"] for f in per_leg if f.get("asr", "finished") != "finished"]
    if failed:
        out["asr"] = failed[0]
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _leg_fields(leg: Leg) -> dict[str, str]:
    """A leg's part of call_end: its audio, DTMF, ASR outcome and RTP stats."""
    out = {"audio_ms": str(leg.audio_ms), "dtmf_events": str(leg.dtmf_events)}
    if leg.stream_end is not None:
        out["asr"] = leg.stream_end.reason
        out["asr_dropped_chunks"] = str(leg.stream_end.dropped_chunks)
        if leg.stream_end.error:
            out["asr_error"] = leg.stream_end.error[:300]
    if leg.asr_failure:
        out["asr"] = leg.asr_failure
    if leg.refused_error and "asr_error" not in out:
        # The stream refused audio and ended without an error of its own (or not in time): the
        # engine's error is still what call_end should say.
        out["asr_error"] = leg.refused_error[:300]
    for key, value in leg.stats.items():
        out.setdefault(key, value)
    return out
