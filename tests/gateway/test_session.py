"""CallSession: the transition table, and every way a call ends closing the ASR stream with a final and
publishing call_end (pure: a recording ASR stream delivering synchronously, an in-memory publisher)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import numpy as np
import pytest

from asr_core.api import StreamEnded, StreamOptions, TranscriptEvent, Word
from gateway.events import from_fields, to_fields
from gateway.session import (
    END_INPUTS,
    TRANSITIONS,
    CallInfo,
    CallSession,
    CallState,
    SessionInput,
    SessionStateError,
    SipAction,
)
from tests.fixtures.telephony import MemoryPublisher, RecordingEngine, RecordingStream

_ids = itertools.count()


class Harness:
    def __init__(self, *, finish_timeout_s: float = 10.0) -> None:
        self.engine = RecordingEngine(threaded=False)
        self.publisher = MemoryPublisher()
        self.now = 100.0
        self.end_requests: list[SessionInput] = []
        call_id = f"call{next(_ids)}"
        holder: dict[str, CallSession] = {}
        self.stream: RecordingStream = self.engine.open_stream(
            call_id, StreamOptions("en-US"), lambda ev: holder["s"].on_asr_event(ev, self.now)
        )
        self.session = CallSession(
            CallInfo(call_id, "sip-call-id@127.0.0.1", "en-US", {"from": "<sip:a@h>", "codec": "PCMU"}),
            self.stream,
            self.publisher,
            now=self.now,
            finish_timeout_s=finish_timeout_s,
            wall_clock=lambda: 1_700_000_000.0,
            on_end_request=lambda s, ev: self.end_requests.append(ev),
        )
        holder["s"] = self.session

    def types(self) -> list[str]:
        return [e.type for e in self.publisher.events]

    def to(self, state: CallState) -> None:
        s = self.session
        if state in (CallState.ANSWERED, CallState.ACTIVE):
            s.answered(self.now)
        if state is CallState.ACTIVE:
            s.acked(self.now)
        if state is CallState.ENDING:
            s.end(SessionInput.SHUTDOWN, self.now)
        if state is CallState.ENDED:
            s.end(SessionInput.SHUTDOWN, self.now)
            s.media_closed(None, self.now)
        assert s.state is state


def test_call_start_is_published_at_once_with_the_metadata() -> None:
    h = Harness()
    (start,) = h.publisher.events
    assert start.type == "call_start" and start.sip_call_id == "sip-call-id@127.0.0.1"
    assert start.extra == {"from": "<sip:a@h>", "codec": "PCMU"}
    assert start.lang == "en-US" and start.ts == 1_700_000_000.0


@pytest.mark.parametrize("state", list(CallState))
@pytest.mark.parametrize("event", list(SessionInput))
def test_every_input_outside_the_table_raises_and_changes_nothing(
    state: CallState, event: SessionInput
) -> None:
    h = Harness()
    h.to(state)
    allowed = event in TRANSITIONS[state]
    assert h.session.accepts(event) is allowed
    if allowed:
        return
    published = len(h.publisher.events)
    with pytest.raises(SessionStateError):
        if event in END_INPUTS:
            h.session.end(event, h.now)
        elif event is SessionInput.ANSWERED:
            h.session.answered(h.now)
        elif event is SessionInput.ACKED:
            h.session.acked(h.now)
        elif event is SessionInput.REOFFERED:
            h.session.reoffered(h.now)
        else:
            h.session._apply(event)
    assert h.session.state is state
    assert len(h.publisher.events) == published


@pytest.mark.parametrize(
    ("state", "event", "action"),
    [
        (CallState.SETUP, SessionInput.CANCELLED, SipAction.NONE),
        (CallState.SETUP, SessionInput.SHUTDOWN, SipAction.REJECT),
        (CallState.SETUP, SessionInput.ERROR, SipAction.REJECT),
        (CallState.ANSWERED, SessionInput.PEER_BYE, SipAction.NONE),
        (CallState.ANSWERED, SessionInput.ACK_TIMEOUT, SipAction.BYE),
        (CallState.ANSWERED, SessionInput.RTP_TIMEOUT, SipAction.BYE),
        (CallState.ACTIVE, SessionInput.PEER_BYE, SipAction.NONE),
        (CallState.ACTIVE, SessionInput.RTP_TIMEOUT, SipAction.BYE),
        (CallState.ACTIVE, SessionInput.SHUTDOWN, SipAction.BYE),
        (CallState.ACTIVE, SessionInput.ERROR, SipAction.BYE),
    ],
)
def test_every_way_a_call_ends_finishes_the_stream_with_a_final_then_call_end(
    state: CallState, event: SessionInput, action: SipAction
) -> None:
    h = Harness()
    h.to(state)
    if state is CallState.ACTIVE:
        h.session.on_audio(np.full(1600, 0.25, np.float32), 0)
    assert h.session.end(event, h.now + 3.0) is action
    assert h.session.state is CallState.ENDING and not h.stream.finished
    h.session.on_audio(np.zeros(320, np.float32), 100)  # the media's flush still reaches ASR
    h.session.media_closed({"rtp_packets": "7"}, h.now + 3.0)
    assert h.stream.finished
    assert h.session.state is CallState.ENDED
    assert h.types()[0] == "call_start" and h.types()[-2:] == ["final", "call_end"]
    end = h.publisher.events[-1]
    assert end.extra["reason"] == event.value
    assert end.extra["rtp_packets"] == "7"
    assert end.extra["asr"] == "finished"
    assert end.extra["duration_ms"] == "3000"
    pushed = 1920 if state is CallState.ACTIVE else 320
    assert end.extra["audio_ms"] == str(pushed * 1000 // 16000)
    assert len(h.stream.pcm) == pushed


def test_transcripts_map_to_events_with_media_times_and_language() -> None:
    h = Harness()
    h.to(CallState.ACTIVE)
    h.session.on_asr_event(TranscriptEvent(h.session.call_id, "partial", 0, "hel", 0, 400), h.now)
    h.session.on_asr_event(
        TranscriptEvent(h.session.call_id, "final", 0, "hello", 0, 640, detected_language="uk-UA"), h.now
    )
    partial, final = h.publisher.events[1:]
    assert (partial.type, partial.text, partial.segment_id, partial.end_ms, partial.lang) == (
        "partial",
        "hel",
        0,
        400,
        "en-US",
    )
    assert (final.type, final.text, final.lang) == ("final", "hello", "uk-UA")
    assert "words" not in final.extra  # an event without words has no words field


def test_words_are_published_as_a_json_field_of_the_final() -> None:
    h = Harness()
    h.to(CallState.ACTIVE)
    words = (Word("hello", 80, 400, 0.91), Word("there", 400, 640, 0.5))
    h.session.on_asr_event(
        TranscriptEvent(h.session.call_id, "final", 0, "hello there", 0, 640, words=words), h.now
    )
    final = h.publisher.events[-1]
    fields = to_fields(final, 2)
    assert json.loads(fields["words"]) == [
        {"word": "hello", "start_ms": 80, "end_ms": 400, "confidence": 0.91},
        {"word": "there", "start_ms": 400, "end_ms": 640, "confidence": 0.5},
    ]
    assert from_fields(fields)[0].extra["words"] == fields["words"]  # consumers of schema v1 read it back


def test_dtmf_becomes_an_event_on_the_media_timeline() -> None:
    h = Harness()
    h.to(CallState.ACTIVE)
    h.session.on_dtmf("5", 1200, 160)
    ev = h.publisher.events[-1]
    assert (ev.type, ev.text, ev.start_ms, ev.end_ms) == ("dtmf", "5", 1200, 1360)


def test_rtp_inactivity_asks_the_front_end_to_end_the_call() -> None:
    h = Harness()
    h.to(CallState.ACTIVE)
    h.session.on_inactive()
    assert h.end_requests == [SessionInput.RTP_TIMEOUT]
    assert h.session.state is CallState.ACTIVE  # the front end decides (and sends the BYE)


def test_stream_that_never_ends_is_closed_after_the_finish_timeout() -> None:
    h = Harness(finish_timeout_s=2.0)
    h.to(CallState.ACTIVE)

    def finish_without_events() -> None:
        h.stream.finished = True

    h.stream.finish = finish_without_events  # type: ignore[method-assign]
    h.session.end(SessionInput.PEER_BYE, h.now)
    h.session.media_closed(None, h.now)
    assert h.session.state is CallState.ENDING
    assert h.session.next_deadline() == pytest.approx(h.now + 2.0)
    h.session.handle_timer(h.now + 1.0)
    assert h.session.state is CallState.ENDING
    h.session.handle_timer(h.now + 2.0)
    assert h.session.state is CallState.ENDED and h.stream.closed
    assert h.publisher.events[-1].extra["asr"] == "timeout"
    assert h.publisher.events[-1].extra["reason"] == "bye"


def test_engine_ending_the_stream_mid_call_ends_the_call_with_error() -> None:
    h = Harness()
    h.to(CallState.ACTIVE)
    h.session.on_asr_event(StreamEnded(h.session.call_id, "error", error="encoder thread died"), h.now)
    assert h.end_requests == [SessionInput.ERROR]
    assert h.session.end(SessionInput.ERROR, h.now) is SipAction.BYE
    h.session.media_closed(None, h.now)  # no finish() on a dead stream: call_end at once
    assert h.session.state is CallState.ENDED
    end = h.publisher.events[-1]
    assert (end.extra["reason"], end.extra["asr"], end.extra["asr_error"]) == (
        "error",
        "error",
        "encoder thread died",
    )
    assert not h.stream.finished


def test_audio_the_stream_refuses_ends_the_call_with_error() -> None:
    h = Harness()
    h.to(CallState.ACTIVE)
    h.stream.closed = True  # push now raises StreamClosedError
    h.session.on_audio(np.zeros(160, np.float32), 0)
    assert h.end_requests == [SessionInput.ERROR]


def test_exactly_one_call_start_and_one_call_end_whatever_arrives_late() -> None:
    h = Harness()
    h.to(CallState.ENDED)
    h.session.on_audio(np.zeros(160, np.float32), 0)
    h.session.on_dtmf("1", 0, 100)
    h.session.on_asr_event(StreamEnded(h.session.call_id, "finished"), h.now)
    h.session.media_closed(None, h.now)
    h.session.handle_timer(h.now + 100)
    assert h.types().count("call_start") == 1 and h.types().count("call_end") == 1


def test_publisher_failure_does_not_break_the_call() -> None:
    class Failing:
        def publish(self, ev: Any) -> None:
            raise RuntimeError("boom")

    h = Harness()
    h.session.publisher = Failing()
    h.to(CallState.ENDED)
