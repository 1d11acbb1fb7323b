"""The call core as a specification: scripted calls, each step an input (with `now`) and the effects it
must produce, no sockets, threads or engine. Every scripted call also keeps the publishing invariants:
at most one call_start, exactly one call_end after it, every transcript and DTMF event in between."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from asr_core.api import StreamEnded, TranscriptEvent, Word
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
    Dtmf,
    Effect,
    Failed,
    Hangup,
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
    Shutdown,
    Transcript,
    UpdateMedia,
)
from gateway.call.core import CallConfig, CallCore, CallState
from gateway.events import CallEvent, from_fields, to_fields
from gateway.sip.message import SipRequest, parse_message
from tests.gateway.sip.factories import SDP_OFFER, UDP, invite, request

CALL = "call-1"
WALL = 1_700_000_000.0


def sip(data: bytes) -> SipRequest:
    message = parse_message(data)
    assert isinstance(message, SipRequest)
    return message


def reinvite(body: str = "") -> Reoffered:
    return Reoffered(sip(request("INVITE", to_tag="gw", cseq=2, body=body)))


PCMA_ANSWER = SDP_OFFER.replace("RTP/AVP 0 8 101", "RTP/AVP 8 101").replace("a=sendrecv", "a=sendonly")
MOVED_PCMA = (
    SDP_OFFER.replace("o=- 1 1", "o=- 1 2")
    .replace("c=IN IP4 127.0.0.1", "c=IN IP4 127.0.0.2")
    .replace("m=audio 6000 RTP/AVP 0 8 101", "m=audio 7000 RTP/AVP 8 101")
)
HOLD = SDP_OFFER.replace("a=sendrecv", "a=sendonly").replace("o=- 1 1", "o=- 1 2")
HOLD_NULL = SDP_OFFER.replace("c=IN IP4 127.0.0.1", "c=IN IP4 0.0.0.0").replace("o=- 1 1", "o=- 1 2")
RESUME = SDP_OFFER.replace("o=- 1 1", "o=- 1 3")

OFFER = Offered(sip(invite()), UDP, "127.0.0.1")
DELAYED = Offered(sip(request("INVITE")), UDP, "127.0.0.1")
ASR_OK = AsrOpened("caller")
PORT = MediaOpened("caller", 20000)
ACK = Acked()
BYE = PeerHungUp()
CLOSED = MediaClosed("caller", {"rtp_packets": "50", "rtp_codec": "PCMU"}, 1000)
FINAL = Transcript("caller", TranscriptEvent(CALL, "final", 0, "hello", 0, 640, at_end_of_stream=True))
PARTIAL = Transcript("caller", TranscriptEvent(CALL, "partial", 0, "hel", 0, 400))
FINISHED = AsrEnded("caller", StreamEnded(CALL, "finished", audio_ms=1000))
ENGINE_FAILED = AsrEnded("caller", StreamEnded(CALL, "error", error="encoder thread died"))
TIMER = "timer"  # a step that fires the core's timer at its deadline


def describe(effect: Effect) -> str:
    """Effects as the scripts spell them."""
    match effect:
        case Publish(event=ev) if ev.type == "call_end":
            return f"Publish call_end {ev.extra['reason']} asr={ev.extra.get('asr', '-')}"
        case Publish(event=ev):
            return f"Publish {ev.type}"
        case Reject(status=status) | RejectReoffer(status=status):
            return f"{type(effect).__name__} {status}"
        case Hangup(reason=reason):
            return f"Hangup {reason}"
        case OpenAsr(leg=leg, options=options):
            return f"OpenAsr {leg} {options.language}"
        case OpenMedia(leg=leg, plan=plan):
            return f"OpenMedia {leg} {plan.codec if plan is not None else 'offer'}"
        case UpdateMedia(leg=leg, plan=plan):
            where = f"{plan.remote_host}:{plan.remote_port}"
            return f"UpdateMedia {leg} {plan.codec} {where}" + (" hold" if plan.on_hold else "")
    leg = getattr(effect, "leg", None)
    return type(effect).__name__ + (f" {leg}" if leg else "")


Step = tuple[CallInput | str, list[str]]


@dataclass
class Driver:
    core: CallCore
    now: float = 100.0
    effects: list[Effect] | None = None

    @classmethod
    def new(cls, **config: object) -> Driver:
        cfg = CallConfig(**{"finish_timeout_s": 10.0, **config})  # type: ignore[arg-type]
        return cls(CallCore(CALL, cfg, now=100.0, wall_clock=lambda: WALL), effects=[])

    def feed(self, inp: CallInput | str, dt: float = 0.5) -> list[Effect]:
        self.now += dt
        if inp == TIMER:
            deadline = self.core.next_deadline()
            assert deadline is not None, "no timer armed"
            self.now = deadline
            out = self.core.handle_timer(self.now)
        else:
            assert not isinstance(inp, str)
            out = self.core.handle(inp, self.now)
        assert self.effects is not None
        self.effects += out
        return out

    def run(self, steps: Sequence[Step]) -> None:
        for n, (inp, expected) in enumerate(steps):
            got = [describe(e) for e in self.feed(inp)]
            assert got == expected, f"step {n} ({inp}): got {got}, expected {expected}"
        check_invariants(self.published)

    @property
    def published(self) -> list[CallEvent]:
        assert self.effects is not None
        return [e.event for e in self.effects if isinstance(e, Publish)]

    def sent(self, kind: type) -> list[Effect]:
        assert self.effects is not None
        return [e for e in self.effects if isinstance(e, kind)]


def check_invariants(events: list[CallEvent]) -> None:
    types = [e.type for e in events]
    if not types:
        return
    assert types[0] == "call_start" and types.count("call_start") == 1, types
    assert types.count("call_end") <= 1, types
    if "call_end" in types:
        assert types[-1] == "call_end", types


SETUP: list[Step] = [
    (OFFER, ["OpenAsr caller en-US"]),
    (ASR_OK, ["Publish call_start", "OpenMedia caller PCMU"]),
    (PORT, ["Answer"]),
    (ACK, []),
]
ENDS_CLEANLY: list[Step] = [
    (CLOSED, ["FinishAsr caller"]),
    (FINAL, ["Publish final"]),
]

SCRIPTS: dict[str, tuple[list[Step], CallState]] = {
    "offer/answer, the caller hangs up": (
        [*SETUP, (PARTIAL, ["Publish partial"]), (BYE, ["CloseMedia caller"]), *ENDS_CLEANLY,
         (FINISHED, ["Publish call_end bye asr=finished"])],
        CallState.ENDED,
    ),
    "the gateway hangs up at shutdown (drain over)": (
        [*SETUP, (Shutdown(), ["Hangup shutdown", "CloseMedia caller"]), *ENDS_CLEANLY,
         (FINISHED, ["Publish call_end shutdown asr=finished"])],
        CallState.ENDED,
    ),
    "BYEs cross: ours for the RTP timeout, theirs arrives after": (
        [*SETUP, (MediaInactive("caller"), ["Hangup rtp_timeout", "CloseMedia caller"]), (BYE, []),
         *ENDS_CLEANLY, (FINISHED, ["Publish call_end rtp_timeout asr=finished"])],
        CallState.ENDED,
    ),
    "a BYE overtakes the ACK": (
        [*SETUP[:3], (BYE, ["CloseMedia caller"]), (ACK, []), *ENDS_CLEANLY,
         (FINISHED, ["Publish call_end bye asr=finished"])],
        CallState.ENDED,
    ),
    "no ACK for our 2xx: BYE (RFC 3261 §13.3.1.4)": (
        [*SETUP[:3], (AckTimedOut(), ["Hangup no_ack", "CloseMedia caller"]), *ENDS_CLEANLY,
         (FINISHED, ["Publish call_end no_ack asr=finished"])],
        CallState.ENDED,
    ),
    "delayed offer: our 2xx offers, the ACK answers": (
        [(DELAYED, ["OpenAsr caller en-US"]), (ASR_OK, ["Publish call_start", "OpenMedia caller offer"]),
         (PORT, ["Answer"]), (Acked(PCMA_ANSWER.encode()), ["UpdateMedia caller PCMA 127.0.0.1:6000"])],
        CallState.ACTIVE,
    ),
    "delayed offer whose ACK has no answer: BYE": (
        [(DELAYED, ["OpenAsr caller en-US"]), (ASR_OK, ["Publish call_start", "OpenMedia caller offer"]),
         (PORT, ["Answer"]), (ACK, ["Hangup error", "CloseMedia caller"]), *ENDS_CLEANLY,
         (FINISHED, ["Publish call_end error asr=finished"])],
        CallState.ENDED,
    ),
    "re-INVITE: codec and address change, a broken re-offer, a refresh, hold and resume": (
        [*SETUP,
         (reinvite(MOVED_PCMA), ["UpdateMedia caller PCMA 127.0.0.2:7000", "AnswerReoffer"]),
         (reinvite("v=0\r\nbogus\r\n"), ["RejectReoffer 400"]),  # RFC 3264 §8: the session stays
         (reinvite(), ["AnswerReoffer"]),  # no offer: ours again, the ACK answers
         (ReofferAcked(PCMA_ANSWER.encode()), ["UpdateMedia caller PCMA 127.0.0.1:6000"]),
         (reinvite(HOLD), ["UpdateMedia caller PCMU 127.0.0.1:6000 hold", "AnswerReoffer"]),
         (reinvite(HOLD_NULL), ["UpdateMedia caller PCMU 0.0.0.0:6000 hold", "AnswerReoffer"]),
         (reinvite(RESUME), ["UpdateMedia caller PCMU 127.0.0.1:6000", "AnswerReoffer"])],
        CallState.ACTIVE,
    ),
    "CANCEL while the ASR stream opens: nothing published": (
        [(OFFER, ["OpenAsr caller en-US"]), (Cancelled(), []), (ASR_OK, ["CloseAsr caller"])],
        CallState.ENDED,
    ),
    "CANCEL while the RTP port opens: the port is closed when it arrives": (
        [*SETUP[:2], (Cancelled(), []), (PORT, ["CloseMedia caller"]), *ENDS_CLEANLY,
         (FINISHED, ["Publish call_end cancel asr=finished"])],
        CallState.ENDED,
    ),
    "CANCEL crossing our 200: too late, the call goes on (RFC 3261 §9.2)": (
        [*SETUP[:3], (Cancelled(), []), (ACK, []), (BYE, ["CloseMedia caller"]), *ENDS_CLEANLY,
         (FINISHED, ["Publish call_end bye asr=finished"])],
        CallState.ENDED,
    ),
    "the engine ends the stream mid-call: BYE, call_end without finishing a dead stream": (
        [*SETUP, (ENGINE_FAILED, ["Hangup error", "CloseMedia caller"]),
         (CLOSED, ["Publish call_end error asr=error"])],
        CallState.ENDED,
    ),
    "the stream refuses audio: BYE": (
        [*SETUP, (AudioRefused("caller", "stream has ended"), ["Hangup error", "CloseMedia caller"])],
        CallState.ENDING,
    ),
    "no RTP port (pool exhausted): 503, the stream still finishes and call_end is published": (
        [*SETUP[:2], (MediaFailed("caller", "no port", exhausted=True), ["Reject 503", "FinishAsr caller"]),
         (FINAL, ["Publish final"]), (FINISHED, ["Publish call_end error asr=finished"])],
        CallState.ENDED,
    ),
    "a live leg's media is lost (its receiver died): BYE, the stream still finishes": (
        [*SETUP, (MediaFailed("caller", "gone", exhausted=False), ["Hangup error", "FinishAsr caller"]),
         (FINAL, ["Publish final"]), (FINISHED, ["Publish call_end error asr=finished"])],
        CallState.ENDED,
    ),
    "the media fails for another reason: 500": (
        [*SETUP[:2], (MediaFailed("caller", "bug", exhausted=False), ["Reject 500", "FinishAsr caller"])],
        CallState.ENDING,
    ),
    "shutdown while the ASR stream opens: 503, nothing published": (
        [(OFFER, ["OpenAsr caller en-US"]), (Shutdown(), ["Reject 503"])],
        CallState.ENDED,
    ),
    "shutdown while the port opens: 503 and call_end": (
        [*SETUP[:2], (Shutdown(), ["Reject 503"]), (PORT, ["CloseMedia caller"]), *ENDS_CLEANLY,
         (FINISHED, ["Publish call_end shutdown asr=finished"])],
        CallState.ENDED,
    ),
    "the engine refuses the stream: 503, nothing published": (
        [(OFFER, ["OpenAsr caller en-US"]), (AsrRefused("caller", "engine stopped"), ["Reject 503"])],
        CallState.ENDED,
    ),
    "an offer without a common codec: 488, nothing published": (
        [(Offered(sip(invite(body=SDP_OFFER.replace("RTP/AVP 0 8 101", "RTP/AVP 18"))), UDP, "127.0.0.1"),
          ["Reject 488"])],
        CallState.ENDED,
    ),
    "a failure before the offer is taken: 500, nothing published": (
        [(Failed("the offer could not be read"), ["Reject 500"])],
        CallState.ENDED,
    ),
    "an adapter failure ends the call as an error": (
        [*SETUP, (Failed("boom"), ["Hangup error", "CloseMedia caller"])],
        CallState.ENDING,
    ),
    "the stream does not end in time: closed, call_end with asr=timeout": (
        [*SETUP, (BYE, ["CloseMedia caller"]), (CLOSED, ["FinishAsr caller"]),
         (TIMER, ["CloseAsr caller", "Publish call_end bye asr=timeout"]), (FINISHED, [])],
        CallState.ENDED,
    ),
    "DTMF and transcripts go out between call_start and call_end, nothing after": (
        [*SETUP, (Dtmf("caller", "5", 1200, 160), ["Publish dtmf"]), (BYE, ["CloseMedia caller"]),
         (Dtmf("caller", "#", 2000, 100), ["Publish dtmf"]),  # flushed by the media close
         *ENDS_CLEANLY, (FINISHED, ["Publish call_end bye asr=finished"]),
         (Dtmf("caller", "1", 3000, 100), []), (PARTIAL, []), (MediaInactive("caller"), [])],
        CallState.ENDED,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_scripted_call(name: str) -> None:
    steps, final_state = SCRIPTS[name]
    d = Driver.new()
    d.run(steps)
    assert d.core.state is final_state


LATE = [Cancelled(), AckTimedOut(), ASR_OK, PORT, ACK, ReofferAcked(), AsrRefused("caller", "x")]
LATE += [Dtmf("no-such-leg", "1", 0, 1)]


@pytest.mark.parametrize("late", LATE, ids=lambda e: type(e).__name__)
def test_an_input_the_state_does_not_list_changes_nothing(late: CallInput) -> None:
    # Races with nothing left to do (a CANCEL after our 200, a duplicate result, an unknown leg) ...
    d = Driver.new()
    d.run(SETUP)
    assert d.feed(late) == [] and d.core.state is CallState.ACTIVE
    # ... and the call still ends in order: its media closed, its stream finished.
    d.run([(BYE, ["CloseMedia caller"]), *ENDS_CLEANLY, (FINISHED, ["Publish call_end bye asr=finished"])])


def test_the_answer_carries_our_port_recvonly_and_our_address_in_contact() -> None:
    d = Driver.new(contact_hosts=("", "0.0.0.0"), media_hosts=("203.0.113.5",))
    d.run(SETUP[:3])
    (answer,) = d.sent(Answer)
    assert isinstance(answer, Answer)
    body = answer.sdp.decode()
    assert "m=audio 20000 RTP/AVP 0 101" in body and "a=recvonly" in body and "c=IN IP4 203.0.113.5" in body
    assert answer.contact_host == "127.0.0.1"  # wildcards skipped: our address toward the caller


def test_a_hold_offer_to_the_null_address_is_answered_inactive() -> None:
    d = Driver.new()
    d.run(SETUP)
    d.feed(reinvite(HOLD_NULL))
    reply = d.sent(AnswerReoffer)[-1]
    assert isinstance(reply, AnswerReoffer) and b"a=inactive" in reply.sdp


def test_a_refresh_reoffer_repeats_our_sdp_with_the_same_version() -> None:
    d = Driver.new()
    d.run(SETUP)
    d.feed(reinvite(MOVED_PCMA))
    d.feed(reinvite())
    first, refresh = d.sent(AnswerReoffer)
    assert isinstance(first, AnswerReoffer) and isinstance(refresh, AnswerReoffer)
    assert first.sdp == refresh.sdp


def test_delayed_offer_offers_every_allowed_codec_and_call_start_has_no_codec_yet() -> None:
    d = Driver.new()
    d.run([(DELAYED, ["OpenAsr caller en-US"]), (ASR_OK, ["Publish call_start", "OpenMedia caller offer"])])
    d.feed(PORT)
    (answer,) = d.sent(Answer)
    assert isinstance(answer, Answer)
    assert b"m=audio 20000 RTP/AVP 0 8 13 101" in answer.sdp and b"a=recvonly" in answer.sdp
    assert d.published[0].extra["codec"] == ""


def test_call_start_carries_the_invite_metadata_and_call_end_the_legs_numbers() -> None:
    d = Driver.new(model_name="demo")
    d.run([*SETUP, (Dtmf("caller", "5", 1200, 160), ["Publish dtmf"]), (BYE, ["CloseMedia caller"])])
    d.feed(CLOSED, dt=2.0)
    d.feed(FINAL)
    d.feed(FINISHED)
    start, dtmf, final, end = d.published
    assert start.extra["model"] == "demo" and start.extra["codec"] == "PCMU"
    assert start.extra["language_source"] == "default" and start.extra["ani"] == "alice"
    assert (start.sip_call_id, start.lang, start.ts) == ("call-1@127.0.0.1", "en-US", WALL)
    assert start.leg == dtmf.leg == final.leg == end.leg == "caller"
    assert (dtmf.text, dtmf.start_ms, dtmf.end_ms) == ("5", 1200, 1360)
    assert (final.text, final.end_ms, final.lang) == ("hello", 640, "en-US")
    assert "words" not in final.extra  # an event without words has no words field
    assert end.extra["reason"] == "bye" and end.extra["duration_ms"] == "3000"  # INVITE (t=100) to BYE
    assert (end.extra["audio_ms"], end.extra["dtmf_events"], end.extra["rtp_packets"]) == ("1000", "1", "50")
    assert (end.extra["asr"], end.extra["asr_dropped_chunks"]) == ("finished", "0")


def test_a_detected_language_is_the_transcripts_language() -> None:
    d = Driver.new()
    d.run(SETUP)
    d.feed(
        Transcript("caller", TranscriptEvent(CALL, "final", 0, "привіт", 0, 640, detected_language="uk-UA"))
    )
    assert d.published[-1].lang == "uk-UA"


def test_words_are_published_as_a_json_field_of_the_final() -> None:
    d = Driver.new()
    d.run(SETUP)
    words = (Word("hello", 80, 400, 0.91), Word("there", 400, 640, 0.5))
    d.feed(Transcript("caller", TranscriptEvent(CALL, "final", 0, "hello there", 0, 640, words=words)))
    fields = to_fields(d.published[-1], 2)
    assert json.loads(fields["words"]) == [
        {"word": "hello", "start_ms": 80, "end_ms": 400, "confidence": 0.91},
        {"word": "there", "start_ms": 400, "end_ms": 640, "confidence": 0.5},
    ]
    assert from_fields(fields)[0].extra["words"] == fields["words"]  # consumers of schema v1 read it back


REFUSED = AudioRefused("caller", "ASR engine failed: RuntimeError('the GPU fell off the bus')")


@pytest.mark.parametrize(
    ("ending", "asr"),
    [
        ([(FINISHED, ["Publish call_end error asr=finished"])], "finished"),
        ([(TIMER, ["CloseAsr caller", "Publish call_end error asr=timeout"])], "timeout"),
    ],
)
def test_call_end_says_why_the_stream_refused_audio_when_its_end_does_not(
    ending: list[Step], asr: str
) -> None:
    d = Driver.new()
    d.run([*SETUP, (REFUSED, ["Hangup error", "CloseMedia caller"]), (CLOSED, ["FinishAsr caller"]), *ending])
    end = d.published[-1]
    assert (end.extra["asr"], end.extra["asr_error"]) == (asr, REFUSED.error)


def test_the_streams_own_error_is_what_call_end_says_when_it_has_one() -> None:
    d = Driver.new()
    d.run([*SETUP, (REFUSED, ["Hangup error", "CloseMedia caller"]), (CLOSED, ["FinishAsr caller"])])
    d.run([(ENGINE_FAILED, ["Publish call_end error asr=error"])])
    assert d.published[-1].extra["asr_error"] == "encoder thread died"


def test_a_segment_the_failed_engine_left_open_gets_its_newest_partial_as_an_unconfirmed_final() -> None:
    d = Driver.new()
    d.run([*SETUP, (FINAL, ["Publish final"])])
    d.feed(Transcript("caller", TranscriptEvent(CALL, "partial", 1, "good", 640, 960)))
    d.feed(Transcript("caller", TranscriptEvent(CALL, "partial", 1, "good bye", 640, 1280)))
    d.run([(ENGINE_FAILED, ["Publish final", "Hangup error", "CloseMedia caller"])])
    assert [(e.type, e.segment_id, e.text, e.extra.get("unconfirmed")) for e in d.published[1:]] == [
        ("final", 0, "hello", None),  # the engine's own
        ("partial", 1, "good", None),
        ("partial", 1, "good bye", None),
        ("final", 1, "good bye", "1"),  # the newest partial, as the segment's final
    ]
    assert (d.published[-1].start_ms, d.published[-1].end_ms) == (640, 1280)


def test_a_failed_engine_that_had_closed_every_segment_adds_no_final() -> None:
    d = Driver.new()
    d.run([*SETUP, (PARTIAL, ["Publish partial"]), (FINAL, ["Publish final"])])
    d.run([(ENGINE_FAILED, ["Hangup error", "CloseMedia caller"])])


def test_an_unknown_language_falls_back_to_the_default_and_then_is_refused() -> None:
    d = Driver.new(default_language="en-US")
    d.run(
        [
            (Offered(sip(invite(extra=("X-Language: xx-YY",))), UDP, "127.0.0.1"), ["OpenAsr caller xx-YY"]),
            (AsrRefused("caller", "no prompt for xx-YY", unknown_language=True), ["OpenAsr caller en-US"]),
            (ASR_OK, ["Publish call_start", "OpenMedia caller PCMU"]),
        ]
    )
    assert d.published[0].lang == "en-US"
    d = Driver.new(default_language="zz-ZZ")
    d.run(
        [
            (OFFER, ["OpenAsr caller zz-ZZ"]),
            (AsrRefused("caller", "no prompt for zz-ZZ", unknown_language=True), ["Reject 503"]),
        ]
    )


def test_the_answer_delay_rings_first_and_answers_at_its_deadline() -> None:
    d = Driver.new(answer_delay_s=1.5)
    d.run([*SETUP[:2], (PORT, ["Ring"])])
    assert d.core.next_deadline() == pytest.approx(d.now + 1.5)
    assert d.core.handle_timer(d.now + 1.0) == []  # an early wake-up changes nothing
    d.run([(MediaInactive("caller"), []), (TIMER, ["Answer"])])  # no RTP timeout before the answer
    assert d.core.state is CallState.ANSWERED and d.core.next_deadline() is None


def test_cancel_while_ringing_ends_the_call_with_its_port_closed() -> None:
    d = Driver.new(answer_delay_s=5.0)
    d.run([*SETUP[:2], (PORT, ["Ring"]), (Cancelled(), ["CloseMedia caller"]), *ENDS_CLEANLY])
    d.run([(FINISHED, ["Publish call_end cancel asr=finished"])])


def test_the_finish_timer_starts_at_the_hang_up() -> None:
    d = Driver.new(finish_timeout_s=2.0)
    d.run([*SETUP, (BYE, ["CloseMedia caller"])])
    assert d.core.next_deadline() == pytest.approx(d.now + 2.0)


TWO_STREAMS = SDP_OFFER + "".join(SDP_OFFER.partition("m=audio 6000")[1:]).replace(
    "m=audio 6000", "m=audio 6002"
)
# A SIPREC recording session (RFC 7866): both parties' streams, labelled, and who sends which.
LABELLED = (
    "v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
    "m=audio 6000 RTP/AVP 0\r\na=label:L1\r\na=sendonly\r\n"
    "m=audio 6002 RTP/AVP 0\r\na=label:L2\r\na=sendonly\r\n"
)
METADATA = """<?xml version="1.0" encoding="UTF-8"?>
<recording xmlns="urn:ietf:params:xml:ns:recording:1">
<datamode>complete</datamode>
<participant participant_id="cust"><nameID aor="sip:+15550100@pbx"><name>Cust</name></nameID></participant>
<participant participant_id="agent"><nameID aor="sip:7001@pbx"><name>Agent</name></nameID></participant>
<stream stream_id="s1"><label>L1</label></stream>
<stream stream_id="s2"><label>L2</label></stream>
<participantstreamassoc participant_id="cust"><send>s1</send></participantstreamassoc>
<participantstreamassoc participant_id="agent"><send>s2</send></participantstreamassoc>
<ext xmlns="urn:example"><callingParty participant_id="cust"/></ext>
</recording>"""
SRC = ("Require: siprec", "Contact: <sip:src@127.0.0.1:5070>;+sip.src")


def siprec_body(sdp: str, metadata: str = METADATA) -> str:
    return (
        f"--B\r\nContent-Type: application/sdp\r\n\r\n{sdp}\r\n"
        "--B\r\nContent-Type: application/rs-metadata+xml\r\nContent-Disposition: recording-session\r\n\r\n"
        f"{metadata}\r\n--B--\r\n"
    )


def recording(sdp: str = "", metadata: str = METADATA, streams_free: int | None = None) -> Offered:
    body = siprec_body(sdp or LABELLED, metadata)
    data = invite(extra=SRC, content_type="multipart/mixed;boundary=B", body=body)
    return Offered(sip(data), UDP, "127.0.0.1", streams_free)


CALLEE_FINAL = Transcript("callee", TranscriptEvent(CALL, "final", 0, "hi", 0, 320))
RECORDING_SETUP: list[Step] = [
    (recording(), ["OpenAsr caller en-US", "OpenAsr callee en-US"]),
    (ASR_OK, []),  # call_start waits for every leg's stream
    (AsrOpened("callee"), ["Publish call_start", "OpenMedia caller PCMU", "OpenMedia callee PCMU"]),
    (PORT, []),  # the answer waits for every leg's port
    (MediaOpened("callee", 20002), ["Answer"]),
    (ACK, []),
]


def test_a_recording_session_has_a_leg_per_party_named_by_its_metadata() -> None:
    d = Driver.new(max_streams=2, siprec=True)
    d.run(
        [
            *RECORDING_SETUP,
            (CALLEE_FINAL, ["Publish final"]),
            (BYE, ["CloseMedia caller", "CloseMedia callee"]),
            (CLOSED, ["FinishAsr caller"]),
            (FINISHED, []),  # call_end waits for the other leg
            (MediaClosed("callee", {"rtp_packets": "9"}, 500), ["FinishAsr callee"]),
            (
                AsrEnded("callee", StreamEnded(f"{CALL}:callee", "finished")),
                ["Publish call_end bye asr=finished"],
            ),
        ]
    )
    assert [(e.leg, e.stream_id) for e in d.sent(OpenAsr) if isinstance(e, OpenAsr)] == [
        ("caller", CALL),
        ("callee", f"{CALL}:callee"),
    ]
    (answer,) = d.sent(Answer)
    assert isinstance(answer, Answer) and answer.recording
    assert b"m=audio 20000 " in answer.sdp and b"m=audio 20002 " in answer.sdp  # each stream, its port
    assert b"a=label:L1" in answer.sdp and b"a=label:L2" in answer.sdp
    assert answer.sdp.count(b"a=recvonly") == 2  # sendonly is how an SRC sends: not hold
    start, final, end = d.published
    assert final.leg == "callee" and start.leg == end.leg == "caller"
    assert json.loads(start.extra["legs"]) == ["caller", "callee"] and start.extra["recording"] == "siprec"
    who = {p["id"]: (p["name"], p["role"], p["legs"]) for p in json.loads(start.extra["participants"])}
    assert who == {"cust": ("Cust", "caller", ["caller"]), "agent": ("Agent", "callee", ["callee"])}
    legs = json.loads(end.extra["legs"])
    assert (legs["caller"]["rtp_packets"], legs["callee"]["rtp_packets"]) == ("50", "9")
    assert (legs["caller"]["audio_ms"], legs["callee"]["audio_ms"]) == ("1000", "500")
    assert (end.extra["rtp_packets"], end.extra["audio_ms"]) == ("59", "1500")  # sums over the legs
    assert json.loads(end.extra["participants"]) == json.loads(start.extra["participants"])


def test_a_trunk_call_takes_only_the_first_of_two_audio_streams() -> None:
    d = Driver.new()
    d.run([(Offered(sip(invite(body=TWO_STREAMS)), UDP, "127.0.0.1"), ["OpenAsr caller en-US"])])
    d.run([(ASR_OK, ["Publish call_start", "OpenMedia caller PCMU"]), (PORT, ["Answer"])])
    (answer,) = d.sent(Answer)
    assert isinstance(answer, Answer) and b"m=audio 0 " in answer.sdp  # the second one refused


def rs_reinvite(body: str, content_type: str = "multipart/mixed;boundary=B", cseq: int = 2) -> Reoffered:
    return Reoffered(sip(request("INVITE", to_tag="gw", cseq=cseq, body=body, content_type=content_type)))


END_BOTH: list[Step] = [
    (BYE, ["CloseMedia caller", "CloseMedia callee"]),
    (CLOSED, ["FinishAsr caller"]),
    (FINISHED, []),
    (MediaClosed("callee", {"rtp_packets": "9"}, 500), ["FinishAsr callee"]),
    (CALLEE_FINAL, ["Publish final"]),
    (AsrEnded("callee", StreamEnded(f"{CALL}:callee", "finished")), ["Publish call_end bye asr=finished"]),
]


@pytest.mark.parametrize(
    ("offer", "status"),
    [
        (
            Offered(
                sip(invite(extra=SRC, content_type="multipart/mixed", body=siprec_body(LABELLED))), UDP, "h"
            ),
            400,
        ),
        (recording(metadata="<recording><participant></recording>"), 400),
        (recording(metadata='<!DOCTYPE r [<!ENTITY a "aaaa">]><recording>&a;</recording>'), 400),
        (
            Offered(
                sip(invite(extra=SRC, content_type="application/rs-metadata+xml", body=METADATA)), UDP, "h"
            ),
            400,
        ),
        (recording(streams_free=1), 503),  # two legs, room for one: capacity counts streams
    ],
    ids=["no boundary", "bad XML", "entities", "no SDP", "no room"],
)
def test_a_recording_offer_that_cannot_be_taken_is_refused_before_anything_opens(
    offer: Offered, status: int
) -> None:
    d = Driver.new(max_streams=2, siprec=True)
    d.run([(offer, [f"Reject {status}"])])
    assert d.core.finished and d.published == []


def test_metadata_naming_unknown_streams_leaves_legs_named_by_label() -> None:
    ghost = METADATA.replace("<send>s2</send>", "<send>s9</send>").replace(
        "<label>L1</label>", "<label>X</label>"
    )
    d = Driver.new(max_streams=2, siprec=True)
    d.run([(recording(metadata=ghost), ["OpenAsr stream-L1 en-US", "OpenAsr stream-L2 en-US"])])


def test_a_single_stream_recording_is_one_mixed_leg() -> None:
    mixed = LABELLED.split("m=audio 6002")[0]
    d = Driver.new(max_streams=2, siprec=True)
    # One stream and nobody said to send it alone (Metaswitch sends such sessions): both sides, mixed.
    unassociated = "".join(line + "\n" for line in METADATA.splitlines() if "streamassoc" not in line)
    d.run([(recording(mixed, metadata=unassociated), ["OpenAsr mixed en-US"])])


def test_a_metadata_only_reinvite_is_applied_and_answered_with_our_sdp() -> None:
    d = Driver.new(max_streams=2, siprec=True)
    d.run(RECORDING_SETUP)
    update = METADATA.replace("<datamode>complete</datamode>", "<datamode>partial</datamode>").replace(
        "<name>Agent</name>", "<name>Agent Smith</name>"
    )
    d.run([(rs_reinvite(update, "application/rs-metadata+xml"), ["AnswerReoffer"]), (ReofferAcked(), [])])
    (first, again) = d.sent(AnswerReoffer) and [*d.sent(Answer), *d.sent(AnswerReoffer)]  # type: ignore[misc]
    assert isinstance(first, Answer) and isinstance(again, AnswerReoffer) and again.sdp == first.sdp
    d.run(END_BOTH)
    end = d.published[-1]
    names = {p["id"]: p["name"] for p in json.loads(end.extra["participants"])}
    assert names == {"cust": "Cust", "agent": "Agent Smith"}


def test_a_bad_reinvite_changes_nothing_and_both_legs_still_end_with_their_finals() -> None:
    d = Driver.new(max_streams=2, siprec=True)
    d.run(RECORDING_SETUP)
    d.run(
        [
            (rs_reinvite(siprec_body(LABELLED, "<recording><oops")), ["RejectReoffer 400"]),
            (rs_reinvite("no delimiter at all"), ["RejectReoffer 400"]),
            (
                rs_reinvite(
                    LABELLED.replace("m=audio 6000", "m=audio 0").replace("m=audio 6002", "m=audio 0"),
                    "application/sdp",
                ),
                ["RejectReoffer 488"],
            ),
            *END_BOTH,
        ]
    )
    assert [e.leg for e in d.published if e.type == "final"] == ["callee"]


def test_a_refresh_reinvite_with_the_same_offer_gives_the_same_answer() -> None:
    d = Driver.new(max_streams=2, siprec=True)
    d.run(RECORDING_SETUP)
    d.run(
        [
            (
                rs_reinvite(siprec_body(LABELLED)),
                [
                    "UpdateMedia caller PCMU 127.0.0.1:6000",
                    "UpdateMedia callee PCMU 127.0.0.1:6002",
                    "AnswerReoffer",
                ],
            )
        ]
    )
    (answer,) = d.sent(Answer)
    (again,) = d.sent(AnswerReoffer)
    assert isinstance(answer, Answer) and isinstance(again, AnswerReoffer) and again.sdp == answer.sdp


def test_a_reoffer_that_drops_a_stream_ends_that_leg_alone_and_one_that_adds_a_stream_is_refused_it() -> None:
    d = Driver.new(max_streams=3, siprec=True)
    d.run(RECORDING_SETUP)
    dropped = LABELLED.replace("o=- 1 1", "o=- 1 2").replace("m=audio 6002", "m=audio 0")
    d.run(
        [
            (
                rs_reinvite(siprec_body(dropped)),
                ["UpdateMedia caller PCMU 127.0.0.1:6000", "CloseMedia callee", "AnswerReoffer"],
            ),
            (MediaClosed("callee", {"rtp_packets": "9"}, 500), ["FinishAsr callee"]),
            (CALLEE_FINAL, ["Publish final"]),  # its last finals still come
            (AsrEnded("callee", StreamEnded(f"{CALL}:callee", "finished")), []),  # the call goes on
            (MediaInactive("callee"), []),
        ]
    )
    (answer,) = d.sent(AnswerReoffer)
    assert (
        isinstance(answer, AnswerReoffer) and b"m=audio 0 " in answer.sdp and b"m=audio 20000 " in answer.sdp
    )
    added = dropped.replace("o=- 1 2", "o=- 1 3") + "m=audio 6004 RTP/AVP 0\r\na=label:L3\r\na=sendonly\r\n"
    d.run(
        [
            (
                rs_reinvite(siprec_body(added), cseq=3),
                ["UpdateMedia caller PCMU 127.0.0.1:6000", "AnswerReoffer"],
            )
        ]
    )
    third = d.sent(AnswerReoffer)[-1]
    assert isinstance(third, AnswerReoffer) and third.sdp.count(b"m=audio 0 ") == 2
    d.run(
        [
            (BYE, ["CloseMedia caller"]),
            (CLOSED, ["FinishAsr caller"]),
            (FINISHED, ["Publish call_end bye asr=finished"]),
        ]
    )
    legs = json.loads(d.published[-1].extra["legs"])
    assert sorted(legs) == ["callee", "caller"] and legs["callee"]["rtp_packets"] == "9"


def test_a_plain_offer_of_two_streams_is_two_legs_when_multi_leg_calls_are_on() -> None:
    d = Driver.new(max_streams=2, multi_leg_calls=True)
    d.run(
        [
            (
                Offered(sip(invite(body=TWO_STREAMS)), UDP, "h"),
                ["OpenAsr stream-1 en-US", "OpenAsr stream-2 en-US"],
            )
        ]
    )
    assert [leg.name for leg in d.core.live_legs] == ["stream-1", "stream-2"]


def test_siprec_off_takes_a_recording_offer_as_a_plain_call_of_one_leg() -> None:
    d = Driver.new(max_streams=2)  # the SIP core refuses Require: siprec then; metadata alone is no reason
    d.run([(recording(), ["OpenAsr caller en-US"])])
