"""What goes into a call core and what comes out of it (gateway.call.core.CallCore).

Inputs are what happened to the call, each handed in with `now`: SIP call events (from the SIP user
agent), leg results (a leg's ASR stream or RTP port opened, refused, closed), media events (DTMF,
inactivity) and ASR events (transcripts, the stream's end). Effects are what the call wants done: SIP
answers and requests, leg lifecycle (open/update/close a leg's media, open/finish/close its ASR stream)
and events to publish. Leg inputs and effects name their leg; none of them carries audio.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from asr_core.api import StreamEnded, StreamOptions, TranscriptEvent
from gateway.events import CallEvent
from gateway.sdp import MediaPlan
from gateway.sip.agent import Flow
from gateway.sip.message import SipRequest

# --- inputs -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Offered:
    """The SIP core admitted an initial INVITE; `local_ip` is our address toward its source.
    `streams_free`: how many audio streams the gateway can still take with this call (capacity counts
    streams: a call whose offer needs more legs is refused 503); None: no limit."""

    request: SipRequest
    flow: Flow
    local_ip: str
    streams_free: int | None = None


@dataclass(frozen=True, slots=True)
class Acked:
    """The ACK of our 2xx (with the SDP answer when our 2xx made the offer)."""

    body: bytes = b""


@dataclass(frozen=True, slots=True)
class Reoffered:
    """A re-INVITE (with an offer, or without one: then our SDP is the offer and the ACK answers)."""

    request: SipRequest


@dataclass(frozen=True, slots=True)
class ReofferAcked:
    body: bytes = b""


@dataclass(frozen=True, slots=True)
class PeerHungUp:
    """BYE from the peer (already answered 200 by the SIP core)."""


@dataclass(frozen=True, slots=True)
class Cancelled:
    """CANCEL (or a BYE on the early dialog) before our answer (487 already sent)."""


@dataclass(frozen=True, slots=True)
class AckTimedOut:
    """No ACK for our 2xx within 64*T1 (RFC 3261 §13.3.1.4: end the session with a BYE)."""


@dataclass(frozen=True, slots=True)
class Shutdown:
    """The gateway is stopping: hang up (or refuse) the call."""


@dataclass(frozen=True, slots=True)
class Failed:
    """Something outside the table failed for this call (a bug in an adapter): end it as an error."""

    error: str


@dataclass(frozen=True, slots=True)
class AsrOpened:
    leg: str


@dataclass(frozen=True, slots=True)
class AsrRefused:
    """The engine refused the stream; `unknown_language` when the language is not in its prompt table."""

    leg: str
    error: str
    unknown_language: bool = False


@dataclass(frozen=True, slots=True)
class MediaOpened:
    leg: str
    port: int


@dataclass(frozen=True, slots=True)
class MediaFailed:
    """The leg's media could not be opened (`exhausted`: no port in the pool or the OS: 503, else 500),
    or, once open, is gone (e.g. the process receiving it died): the call ends as an error."""

    leg: str
    error: str
    exhausted: bool


@dataclass(frozen=True, slots=True)
class MediaClosed:
    """The leg's media is closed and its last audio is in its ASR stream. `stats` are the call_end
    fields of its RTP receive side; `audio_ms` how much audio went into the stream."""

    leg: str
    stats: Mapping[str, str]
    audio_ms: int


@dataclass(frozen=True, slots=True)
class Dtmf:
    leg: str
    digit: str
    start_ms: int
    duration_ms: int


@dataclass(frozen=True, slots=True)
class MediaInactive:
    """No RTP/RTCP on the leg for its (hold-aware) inactivity timeout."""

    leg: str


@dataclass(frozen=True, slots=True)
class AudioRefused:
    """The leg's ASR stream refused audio: the call cannot be transcribed any more."""

    leg: str
    error: str


@dataclass(frozen=True, slots=True)
class Transcript:
    leg: str
    event: TranscriptEvent


@dataclass(frozen=True, slots=True)
class AsrEnded:
    """The leg's ASR stream ended (after its finals): finished, closed, or an error."""

    leg: str
    event: StreamEnded


SipInput = Offered | Acked | Reoffered | ReofferAcked | PeerHungUp | Cancelled | AckTimedOut
LegInput = (
    AsrOpened
    | AsrRefused
    | MediaOpened
    | MediaFailed
    | MediaClosed
    | Dtmf
    | MediaInactive
    | AudioRefused
    | Transcript
    | AsrEnded
)
CallInput = SipInput | LegInput | Shutdown | Failed


# --- effects ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ring:
    """180 Ringing."""


@dataclass(frozen=True, slots=True)
class Answer:
    """The 2xx to the INVITE; `recording`: it answers a SIPREC recording session (RFC 7866: our
    Contact says +sip.srs, and Require: siprec when the SRC named the tag)."""

    sdp: bytes
    contact_host: str
    recording: bool = False


@dataclass(frozen=True, slots=True)
class Reject:
    """A final error response to the INVITE; `result` labels ttg_calls_total."""

    status: int
    warning: str
    result: str


@dataclass(frozen=True, slots=True)
class AnswerReoffer:
    sdp: bytes
    contact_host: str


@dataclass(frozen=True, slots=True)
class RejectReoffer:
    status: int
    warning: str


@dataclass(frozen=True, slots=True)
class Hangup:
    """BYE with an RFC 3326 Reason text (sent once the ACK is in, RFC 3261 §15)."""

    reason: str


@dataclass(frozen=True, slots=True)
class OpenAsr:
    """Open the leg's ASR stream; the answer is AsrOpened or AsrRefused."""

    leg: str
    stream_id: str
    options: StreamOptions


@dataclass(frozen=True, slots=True)
class OpenMedia:
    """Open the leg's RTP port and wire its audio into the leg's ASR stream; answered by MediaOpened
    or MediaFailed. `plan` None: we make the offer, nothing is accepted until UpdateMedia."""

    leg: str
    plan: MediaPlan | None


@dataclass(frozen=True, slots=True)
class UpdateMedia:
    leg: str
    plan: MediaPlan


@dataclass(frozen=True, slots=True)
class CloseMedia:
    """Flush the leg's last audio into its stream, free its port; answered by MediaClosed."""

    leg: str


@dataclass(frozen=True, slots=True)
class FinishAsr:
    """No more audio: the stream's last finals come, then AsrEnded."""

    leg: str


@dataclass(frozen=True, slots=True)
class CloseAsr:
    """Drop the stream without waiting for its finals."""

    leg: str


@dataclass(frozen=True, slots=True)
class Publish:
    event: CallEvent


SipEffect = Ring | Answer | Reject | AnswerReoffer | RejectReoffer | Hangup
LegEffect = OpenAsr | OpenMedia | UpdateMedia | CloseMedia | FinishAsr | CloseAsr
Effect = SipEffect | LegEffect | Publish
