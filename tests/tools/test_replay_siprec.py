"""`ttg replay --siprec`: the recording INVITE it sends, how it reads a two-stream answer, and the
per-leg report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tools.replay import ReplayConfig, report, sdp
from tools.replay import cli as replay_cli
from tools.replay.analysis import ReceivedEvent, UtteranceTiming
from tools.replay.sipmsg import parse
from tools.replay.siprec import VENDORS, build_offer, vendor_of_call
from tools.replay.uac import Send, UacCall, UacParams

ANSWER = (
    "v=0\r\no=ttg 1 0 IN IP4 127.0.0.1\r\ns=ttg\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
    "m=audio 30000 RTP/AVP 0 101\r\na=rtpmap:0 PCMU/8000\r\na=rtpmap:101 telephone-event/8000\r\n"
    "a=ptime:20\r\na=label:1\r\na=recvonly\r\n"
    "m=audio 30002 RTP/AVP 8\r\na=rtpmap:8 PCMA/8000\r\na=label:2\r\na=recvonly\r\n"
    "m=audio 0 RTP/AVP 0\r\n"
)


def test_a_two_stream_answer_is_read_per_m_line_with_labels() -> None:
    first, second, refused = sdp.parse_answers(ANSWER.encode())
    assert isinstance(first, sdp.MediaAnswer) and isinstance(second, sdp.MediaAnswer)
    assert (first.port, first.codec, first.label, first.telephone_event_pt) == (30000, "PCMU", "1", 101)
    assert (second.port, second.codec, second.label, second.ptime_ms) == (30002, "PCMA", "2", None)
    assert isinstance(refused, sdp.SdpError) and "port 0" in str(refused)
    assert sdp.parse_answer(ANSWER.encode()) == first


def test_session_level_direction_applies_to_every_stream() -> None:
    body = ANSWER.replace("t=0 0\r\n", "t=0 0\r\na=inactive\r\n").replace("a=recvonly\r\n", "")
    assert all(isinstance(a, sdp.SdpError) for a in sdp.parse_answers(body.encode()))


def test_the_recording_invite_requires_siprec_and_marks_the_contact() -> None:
    offer = build_offer("cisco", index=0, ip="127.0.0.1", ports=(40000, 40002), session_id=9)
    call = UacCall(
        UacParams(
            call_id="c1@127.0.0.1",
            local_host="127.0.0.1",
            local_port=5070,
            transport="TCP",
            request_uri="sip:ttg@127.0.0.1:5060",
            from_uri="sip:src@127.0.0.1",
            to_uri="sip:ttg@127.0.0.1:5060",
            sdp_offer=offer.body,
            content_type=offer.content_type,
            contact_params=";+sip.src",
            extra_headers=(("Require", "siprec"),),
        )
    )
    (send,) = [o for o in call.start(0.0) if isinstance(o, Send)]
    msg = parse(send.data)
    assert msg.get("content-type") == "multipart/mixed;boundary=uniqueBoundary"
    assert msg.get("require") == "siprec"
    assert (msg.get("contact") or "").endswith(";transport=tcp>;+sip.src")
    assert msg.body == offer.body and len(send.data) > 1300  # RFC 3261 §18.1.1: too big for UDP


def test_vendor_round_robin() -> None:
    assert [vendor_of_call("all", i) for i in range(len(VENDORS) + 1)] == [*VENDORS, next(iter(VENDORS))]
    assert vendor_of_call("sonus", 5) == "sonus"


def ev(type_: str, seq: int, leg: str, **fields: str) -> ReceivedEvent:
    return ReceivedEvent.from_fields(
        {"type": type_, "seq": str(seq), "leg": leg, **fields}, arrival=1.0 + seq
    )


def test_transcripts_and_rtp_counters_are_taken_per_leg() -> None:
    legs = json.dumps({"caller": {"rtp_packets": "100"}, "callee": {"rtp_packets": "90"}})
    events = [
        ev("call_start", 1, "caller", lang="en-US"),
        ev("final", 2, "caller", segment_id="0", text="hello there", start_ms="0", end_ms="900"),
        ev("final", 1, "callee", segment_id="0", text="good morning", start_ms="0", end_ms="900"),
        ev("call_end", 3, "caller", rtp_packets="190", legs=legs),
    ]
    timing = [UtteranceTiming(0, 800, 0.0, 0.8)]
    caller = report.transcript_results(timing, events, "hello there", leg="caller")
    callee = report.transcript_results(timing, events, "good morning", leg="callee")
    assert (caller["hypothesis"], caller["word_errors"], caller["gateway_rtp_packets"]) == (
        "hello there",
        0,
        100,
    )
    assert (callee["hypothesis"], callee["word_errors"], callee["gateway_rtp_packets"]) == (
        "good morning",
        0,
        90,
    )
    whole = report.transcript_results(timing, events, None)  # a plain call: every event is its own
    assert whole["finals"] == 2 and whole["gateway_rtp_packets"] == 190


@pytest.mark.parametrize(("legs", "packets"), [("", "7"), ('{"other": {"rtp_packets": "1"}}', None)])
def test_leg_stats_of_a_call_end(legs: str, packets: str | None) -> None:
    end = {"rtp_packets": "7", **({"legs": legs} if legs else {})}
    assert report.leg_stats(end, "caller").get("rtp_packets") == packets


def test_summary_counts_calls_once_and_legs_each() -> None:
    def result(index: int, leg: str, finals: int) -> report.CallResult:
        return report.CallResult(
            index=index, sip_call_id=f"c{index}", lang="en-US", clips=(), outcome="completed",
            setup_s=0.01, leg=leg, finals=finals, rtp_sent=50, call_end_received=True,
        )  # fmt: skip

    s = report.summarize([result(0, "caller", 2), result(0, "callee", 1), result(1, "caller", 0)])
    assert (s.calls, s.completed, s.legs, s.legs_with_finals, s.finals, s.rtp_sent) == (2, 2, 3, 2, 3, 150)


def test_the_command_line_takes_siprec_with_or_without_a_vendor(tmp_path: Path) -> None:
    def config(*argv: str) -> ReplayConfig:
        parser = argparse.ArgumentParser()
        replay_cli.add_arguments(parser)
        return replay_cli.config_from_args(
            parser.parse_args([*argv, "--generate", "2", "--out", str(tmp_path)])
        )

    assert config("--siprec", "--calls", "20").siprec == "all"
    assert config("--siprec", "sonus", "--leg-offset-ms", "800").leg_offset_ms == 800
    assert config().siprec == ""
    with pytest.raises(SystemExit):
        config("--siprec", "nobody")
