"""The replay UAC's SIP: message parsing, SDP offer/answer, and the call state machine (RFC 3261
transactions and timers) driven with a fake clock; one loopback test of the asyncio adapter."""

from __future__ import annotations

import asyncio
import itertools
import socket

import pytest

from tools.replay import sdp, sipmsg
from tools.replay.net import SipEndpoint
from tools.replay.uac import (
    Answered,
    CallState,
    Ended,
    Failed,
    Output,
    Provisional,
    Rejected,
    Send,
    UacCall,
    UacParams,
)

T1 = 0.5


def make_call(transport: str = "UDP", **kw: object) -> UacCall:
    params = UacParams(
        call_id="c1@127.0.0.1",
        local_host="127.0.0.1",
        local_port=5070,
        transport=transport,
        request_uri="sip:ttg@127.0.0.1:5060",
        from_uri="sip:replay@127.0.0.1",
        to_uri="sip:ttg@127.0.0.1:5060",
        sdp_offer=sdp.build_offer("127.0.0.1", 40000, "PCMU", 20, 1),
        extra_headers=(("X-Language", "uk-UA"),),
        **kw,  # type: ignore[arg-type]
    )
    counter = itertools.count()
    return UacCall(params, new_token=lambda: f"tok{next(counter)}")


def sent(outputs: list[Output]) -> list[sipmsg.SipMessage]:
    return [sipmsg.parse(o.data) for o in outputs if isinstance(o, Send)]


def events(outputs: list[Output]) -> list[Output]:
    return [o for o in outputs if not isinstance(o, Send)]


def response(
    request: sipmsg.SipMessage,
    status: int,
    reason: str = "",
    *,
    to_tag: str | None = "uas1",
    extra: str = "",
    body: bytes = b"",
) -> sipmsg.SipMessage:
    lines = [f"SIP/2.0 {status} {reason or 'X'}"]
    lines += [f"Via: {v}" for v in request.get_all("via")]
    to = request.get("to") or ""
    if to_tag and status > 100:
        to += f";tag={to_tag}"
    lines += [f"From: {request.get('from')}", f"To: {to}", f"Call-ID: {request.call_id}"]
    lines.append(f"CSeq: {request.get('cseq')}")
    if extra:
        lines.append(extra)
    lines.append(f"Content-Length: {len(body)}")
    return sipmsg.parse(("\r\n".join(lines) + "\r\n\r\n").encode() + body)


CONTACT_RR = "Contact: <sip:gw@127.0.0.2:5062>\r\nRecord-Route: <sip:p1;lr>, <sip:p2;lr>"
ANSWER = (
    b"v=0\r\no=gw 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.9\r\nt=0 0\r\n"
    b"m=audio 20000 RTP/AVP 8 101\r\na=rtpmap:8 PCMA/8000\r\na=rtpmap:101 telephone-event/8000\r\n"
    b"a=ptime:20\r\na=recvonly\r\n"
)


def answered_call(**kw: object) -> tuple[UacCall, sipmsg.SipMessage]:
    call = make_call(**kw)
    invite = sent(call.start(0.0))[0]
    call.receive(response(invite, 180, "Ringing"), 0.01)
    out = call.receive(
        response(invite, 200, "OK", extra=CONTACT_RR, body=ANSWER),
        0.02,
    )
    assert isinstance(events(out)[0], Answered)
    return call, invite


# --- messages ------------------------------------------------------------------------------------


def test_parser_reads_compact_headers_folding_and_body_by_content_length() -> None:
    raw = (
        b"SIP/2.0 200 OK\r\nv: SIP/2.0/UDP 1.2.3.4:5060;branch=z9hG4bKx\r\nf: <sip:a@b>;tag=1\r\n"
        b"t: <sip:c@d>;tag=2\r\ni: abc\r\nCSeq: 1\r\n INVITE\r\nl: 4\r\n\r\nbodyEXTRA"
    )
    msg = sipmsg.parse(raw)
    assert (msg.status, msg.call_id, msg.cseq, msg.body) == (200, "abc", (1, "INVITE"), b"body")
    assert msg.top_via_branch == "z9hG4bKx"
    assert sipmsg.header_param(msg.get("to") or "", "tag") == "2"


@pytest.mark.parametrize(
    "raw",
    [
        b"garbage\r\n\r\n",
        b"SIP/2.0 2000 OK\r\nCall-ID: a\r\n\r\n",
        b"SIP/2.0 200 OK\r\nVia: x\r\nFrom: a\r\nTo: b\r\nCall-ID: c\r\nCSeq: one INVITE\r\n\r\n",
        b"SIP/2.0 200 OK\r\nVia: x\r\nFrom: a\r\nTo: b\r\nCall-ID: c\r\nCSeq: 1 INVITE\r\nl: 9\r\n\r\nab",
        b"SIP/2.0 200 OK\r\nVia: x\r\nFrom: a\r\nTo: b\r\nCSeq: 1 INVITE\r\n\r\n",
        b"\xff\xfe\r\n\r\n",
    ],
)
def test_parser_rejects_malformed_messages_with_a_parse_error(raw: bytes) -> None:
    with pytest.raises(sipmsg.SipParseError):
        sipmsg.parse(raw)


def test_stream_framer_cuts_messages_by_content_length_across_reads_and_skips_keepalives() -> None:
    one = b"SIP/2.0 100 Trying\r\nContent-Length: 0\r\n\r\n"
    two = b"SIP/2.0 200 OK\r\nl: 3\r\n\r\nabc"
    framer = sipmsg.StreamFramer()
    data = b"\r\n\r\n" + one + two
    frames: list[bytes] = []
    for i in range(0, len(data), 7):
        frames += framer.feed(data[i : i + 7])
    assert frames == [one, two]


def test_split_header_list_keeps_commas_inside_uris_and_quotes() -> None:
    assert sipmsg.split_header_list('"a, b" <sip:x;p=1,2>;lr, <sip:y>') == [
        '"a, b" <sip:x;p=1,2>;lr',
        "<sip:y>",
    ]


# --- SDP -----------------------------------------------------------------------------------------


def test_offer_lists_both_g711_laws_preferred_first_and_telephone_event() -> None:
    text = sdp.build_offer("127.0.0.1", 40002, "PCMA", 30, 7).decode()
    assert "m=audio 40002 RTP/AVP 8 0 101\r\n" in text
    assert "a=rtpmap:101 telephone-event/8000" in text and "a=ptime:30" in text
    assert "c=IN IP4 127.0.0.1" in text
    assert "a=rtcp-mux\r\n" in text  # RFC 5761: the gateway's RTCP comes back to the RTP socket


def test_answer_gives_the_first_g711_format_media_address_and_ptime() -> None:
    ans = sdp.parse_answer(ANSWER)
    assert (ans.host, ans.port, ans.codec, ans.payload_type) == ("127.0.0.9", 20000, "PCMA", 8)
    assert (ans.telephone_event_pt, ans.ptime_ms, ans.direction) == (101, 20, "recvonly")


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"v=0\r\nc=IN IP4 1.2.3.4\r\nm=audio 0 RTP/AVP 0\r\n", "port 0"),
        (b"v=0\r\nc=IN IP4 1.2.3.4\r\nm=audio 5000 RTP/AVP 9\r\na=rtpmap:9 G722/8000\r\n", "no G.711"),
        (b"v=0\r\nc=IN IP4 1.2.3.4\r\nm=audio 5000 RTP/AVP 0\r\na=sendonly\r\n", "sendonly"),
        (b"v=0\r\nm=audio 5000 RTP/AVP 0\r\n", "no c-line"),
        (b"v=0\r\nc=IN IP4 1.2.3.4\r\nm=video 5000 RTP/AVP 96\r\n", "no audio"),
    ],
)
def test_unusable_answers_are_an_sdp_error(body: bytes, why: str) -> None:
    with pytest.raises(sdp.SdpError, match=why):
        sdp.parse_answer(body)


# --- the call state machine ------------------------------------------------------------------------


def test_invite_carries_the_offer_language_header_and_a_magic_cookie_branch() -> None:
    call = make_call()
    [invite] = sent(call.start(0.0))
    assert invite.method == "INVITE" and invite.uri == "sip:ttg@127.0.0.1:5060"
    assert invite.get("x-language") == "uk-UA"
    assert (invite.top_via_branch or "").startswith("z9hG4bK")  # RFC 3261 §8.1.1.7
    assert invite.get("content-type") == "application/sdp" and b"m=audio 40000" in invite.body
    assert invite.cseq == (1, "INVITE") and sipmsg.header_param(invite.get("from") or "", "tag")


def test_invite_is_retransmitted_at_t1_doubling_until_timer_b_over_udp() -> None:
    call = make_call()
    call.start(0.0)
    times = []
    t = call.next_deadline()
    failed: list[Output] = []
    while t is not None:
        out = call.handle_timer(t)
        times += [t] * len(sent(out))
        failed += [e for e in events(out) if isinstance(e, Failed)]
        t = call.next_deadline()
    # Timer A: 0.5, 1.5, 3.5, 7.5, 15.5, 31.5 s; Timer B fires at 64·T1 = 32 s (§17.1.1.2).
    assert times == [0.5, 1.5, 3.5, 7.5, 15.5, 31.5]
    assert len(failed) == 1 and "Timer B" in failed[0].reason  # type: ignore[attr-defined]
    assert call.state is CallState.TERMINATED and call.invite_retransmits == 6


def test_tcp_never_retransmits_but_still_times_out() -> None:
    call = make_call("TCP")
    call.start(0.0)
    assert call.next_deadline() == 64 * T1
    out = call.handle_timer(64 * T1)
    assert sent(out) == [] and isinstance(events(out)[0], Failed)


def test_a_provisional_response_stops_invite_retransmissions() -> None:
    call = make_call(setup_timeout_s=60.0)
    [invite] = sent(call.start(0.0))
    out = call.receive(response(invite, 100, "Trying", to_tag=None), 0.1)
    assert events(out) == [Provisional(100)] and call.state is CallState.PROCEEDING
    assert call.next_deadline() == 60.0  # only the setup timeout is left
    assert sent(call.handle_timer(5.0)) == []


def test_2xx_is_acked_to_the_contact_through_the_reversed_route_set_and_each_retransmission_again() -> None:
    call = make_call()
    [invite] = sent(call.start(0.0))
    ok = response(invite, 200, "OK", extra=CONTACT_RR, body=ANSWER)
    out = call.receive(ok, 0.25)
    [ack] = sent(out)
    [ev] = events(out)
    assert isinstance(ev, Answered) and ev.setup_s == pytest.approx(0.25) and ev.sdp == ANSWER
    assert ack.method == "ACK" and ack.uri == "sip:gw@127.0.0.2:5062" and ack.cseq == (1, "ACK")
    assert ack.get_all("route") == ["<sip:p2;lr>", "<sip:p1;lr>"]  # §12.1.2
    assert ack.top_via_branch != invite.top_via_branch  # the ACK for a 2xx is its own transaction
    again = call.receive(ok, 0.75)
    assert [m.method for m in sent(again)] == ["ACK"] and events(again) == []  # §13.2.2.4
    assert call.state is CallState.CONFIRMED and call.next_deadline() is None


@pytest.mark.parametrize(("status", "retry_after"), [(503, 120.0), (403, None), (488, None)])
def test_final_error_responses_reject_the_call_and_are_acked_in_the_invite_transaction(
    status: int, retry_after: float | None
) -> None:
    call = make_call()
    [invite] = sent(call.start(0.0))
    extra = "Retry-After: 120 (overloaded);duration=60" if status == 503 else ""
    resp = response(invite, status, "No", extra=extra)
    out = call.receive(resp, 0.1)
    [ack] = sent(out)
    assert events(out) == [Rejected(status, "No", retry_after)]
    # §17.1.1.3: same branch as the INVITE, To with the response's tag, CSeq number of the INVITE.
    assert ack.method == "ACK" and ack.top_via_branch == invite.top_via_branch
    assert ack.get("to") == resp.get("to") and ack.cseq == (1, "ACK") and ack.uri == invite.uri
    retrans = call.receive(resp, 0.6)
    assert [m.method for m in sent(retrans)] == ["ACK"] and events(retrans) == []


def test_bye_is_retransmitted_up_to_t2_and_times_out_after_64_t1() -> None:
    call, _ = answered_call()
    [bye] = sent(call.hangup(10.0))
    assert bye.method == "BYE" and bye.cseq == (2, "BYE") and bye.uri == "sip:gw@127.0.0.2:5062"
    assert sipmsg.header_param(bye.get("to") or "", "tag") == "uas1"
    times = []
    t = call.next_deadline()
    last: list[Output] = []
    while t is not None:
        out = call.handle_timer(t)
        times += [round(t - 10.0, 3)] * len(sent(out))
        last = events(out)
        t = call.next_deadline()
    # Timer E: 0.5, 1, 2, 4, 4, ... (capped at T2) until Timer F at 32 s (§17.1.2.2).
    assert times[:5] == [0.5, 1.5, 3.5, 7.5, 11.5] and all(
        b - a == 4 for a, b in itertools.pairwise(times[3:])
    )
    assert last == [Ended("bye_timeout")]


def test_bye_answered_200_ends_the_call() -> None:
    call, _ = answered_call()
    [bye] = sent(call.hangup(5.0))
    out = call.receive(response(bye, 200, "OK"), 5.01)
    assert events(out) == [Ended("bye")] and call.done and call.next_deadline() is None


def test_a_bye_from_the_gateway_is_answered_200_and_ends_the_call() -> None:
    call, invite = answered_call()
    raw = (
        "BYE sip:replay@127.0.0.1:5070 SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.0.2:5062;branch=z9hG4bKgw\r\n"
        f"From: <sip:ttg@127.0.0.1>;tag=uas1\r\nTo: {invite.get('from')}\r\nCall-ID: {invite.call_id}\r\n"
        "CSeq: 7 BYE\r\nContent-Length: 0\r\n\r\n"
    )
    out = call.receive(sipmsg.parse(raw.encode()), 3.0)
    [ok] = sent(out)
    assert ok.status == 200 and ok.cseq == (7, "BYE") and ok.top_via_branch == "z9hG4bKgw"
    assert events(out) == [Ended("remote_bye")]


def test_hangup_before_any_provisional_waits_for_one_then_cancels_and_acks_the_487() -> None:
    call = make_call()
    [invite] = sent(call.start(0.0))
    assert sent(call.hangup(0.1)) == []  # §9.1: no CANCEL before a provisional response
    out = call.receive(response(invite, 180, "Ringing"), 0.2)
    [cancel] = sent(out)
    assert cancel.method == "CANCEL" and cancel.top_via_branch == invite.top_via_branch
    assert cancel.cseq == (1, "CANCEL") and cancel.get("to") == invite.get("to")
    out = call.receive(response(invite, 487, "Request Terminated"), 0.3)
    assert [m.method for m in sent(out)] == ["ACK"]
    assert isinstance(events(out)[0], Failed) and call.done


def test_no_answer_within_the_setup_timeout_cancels_the_call() -> None:
    call = make_call(setup_timeout_s=5.0)
    [invite] = sent(call.start(0.0))
    call.receive(response(invite, 180, "Ringing"), 0.1)
    out = call.handle_timer(5.0)
    assert [m.method for m in sent(out)] == ["CANCEL"] and call.state is CallState.CANCELLING


def test_a_200_that_races_our_cancel_is_acked_and_the_dialog_ended_with_bye() -> None:
    call = make_call(setup_timeout_s=5.0)
    [invite] = sent(call.start(0.0))
    call.receive(response(invite, 180, "Ringing"), 0.1)
    call.handle_timer(5.0)
    out = call.receive(response(invite, 200, "OK", body=ANSWER), 5.01)
    assert [m.method for m in sent(out)] == ["ACK", "BYE"]
    assert isinstance(events(out)[0], Failed) and call.state is CallState.TERMINATING


def test_requests_outside_the_dialog_get_481_and_options_200() -> None:
    call, invite = answered_call()
    stranger = (
        "BYE sip:x SIP/2.0\r\nVia: SIP/2.0/UDP 9.9.9.9;branch=z9hG4bKs\r\nFrom: <sip:z>;tag=other\r\n"
        f"To: <sip:y>\r\nCall-ID: {invite.call_id}\r\nCSeq: 1 BYE\r\n\r\n"
    )
    assert sent(call.receive(sipmsg.parse(stranger.encode()), 1.0))[0].status == 481
    assert call.state is CallState.CONFIRMED
    options = stranger.replace("BYE", "OPTIONS")
    assert sent(call.receive(sipmsg.parse(options.encode()), 1.0))[0].status == 200


# --- the adapter on loopback ---------------------------------------------------------------------


async def test_endpoint_retransmits_an_unanswered_invite_on_its_timer_over_real_udp() -> None:
    """A peer that ignores the first INVITE and rejects the retransmission: the adapter's timer fired."""
    peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    peer.bind(("127.0.0.1", 0))
    peer.setblocking(False)
    loop = asyncio.get_running_loop()
    endpoint = SipEndpoint("udp", "127.0.0.1", 0, peer.getsockname())
    await endpoint.open()
    try:
        params = UacParams(
            call_id="rt@127.0.0.1",
            local_host="127.0.0.1",
            local_port=endpoint.local_port,
            transport="UDP",
            request_uri="sip:ttg@127.0.0.1",
            from_uri="sip:r@127.0.0.1",
            to_uri="sip:ttg@127.0.0.1",
            sdp_offer=b"v=0\r\n",
            t1_s=0.05,
        )
        call = UacCall(params)
        got: asyncio.Future[list[Output]] = loop.create_future()
        endpoint.add(call, lambda evs: got.done() or got.set_result(evs))
        endpoint.start(call)
        first, addr = await asyncio.wait_for(loop.sock_recvfrom(peer, 4096), 5)
        second, _ = await asyncio.wait_for(loop.sock_recvfrom(peer, 4096), 5)
        assert first == second  # the retransmission is the same request (same branch)
        invite = sipmsg.parse(second)
        await loop.sock_sendto(peer, _raw_response(invite, 486, "Busy Here"), addr)
        assert await asyncio.wait_for(got, 5) == [Rejected(486, "Busy Here", None)]
        ack, _ = await asyncio.wait_for(loop.sock_recvfrom(peer, 4096), 5)
        assert sipmsg.parse(ack).method == "ACK"
        assert call.invite_retransmits >= 1 and endpoint.parse_errors == 0
    finally:
        endpoint.close()
        peer.close()


def _raw_response(req: sipmsg.SipMessage, status: int, reason: str) -> bytes:
    return sipmsg.response_to(req, status, reason, to_tag="peer")
