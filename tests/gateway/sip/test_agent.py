"""The UAS core (`UserAgent`), driven like aioquic's pure-core tests: bytes in, effects out, fake clock."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.sip.admission import AdmissionConfig
from gateway.sip.agent import (
    AgentConfig,
    CallAckTimeout,
    CallCancelled,
    CallConfirmed,
    CallEndedByPeer,
    CallOffered,
    CallPhase,
    CallReleased,
    Effect,
    Flow,
    ReofferConfirmed,
    Send,
    SessionReoffered,
    UserAgent,
)
from gateway.sip.auth import DigestConfig, authorization_header
from gateway.sip.headers import parse_credentials
from gateway.sip.message import SipRequest, parse_message
from tests.gateway.sip.factories import (
    SDP_OFFER,
    TCP,
    UDP,
    header,
    headers,
    invite,
    request,
    status_of,
    to_tag_of,
)

ANSWER = (
    b"v=0\r\no=ttg 1 0 IN IP4 127.0.0.1\r\ns=ttg\r\n"
    b"c=IN IP4 127.0.0.1\r\nt=0 0\r\nm=audio 20000 RTP/AVP 0\r\n"
)


def make_ua(**kw: Any) -> UserAgent:
    refs = iter(f"c{i}" for i in range(99))
    return UserAgent(AgentConfig(host="127.0.0.1", port=5060, **kw), new_call_ref=refs.__next__)


def sends(effects: list[Effect]) -> list[Send]:
    return [e for e in effects if isinstance(e, Send)]


def codes(effects: list[Effect]) -> list[int]:
    return [status_of(s.data) for s in sends(effects)]


def events(effects: list[Effect]) -> list[type]:
    return [type(e) for e in effects if not isinstance(e, Send)]


def offered(ua: UserAgent, data: bytes | None = None, flow: Flow = UDP, now: float = 0.0) -> str:
    effects = ua.receive(data or invite(), flow, now)
    assert codes(effects) == [100]
    (ev,) = [e for e in effects if isinstance(e, CallOffered)]
    return ev.call_ref


def answered(ua: UserAgent, now: float = 0.1) -> tuple[str, bytes]:
    ref = offered(ua)
    (ok,) = sends(ua.answer(ref, ANSWER, now))
    assert status_of(ok.data) == 200
    return ref, ok.data


def ack_for(ok: bytes, cseq: int = 1) -> bytes:
    return request("ACK", to_tag=to_tag_of(ok), cseq=cseq)


def confirmed(ua: UserAgent) -> tuple[str, bytes]:
    ref, ok = answered(ua)
    assert events(ua.receive(ack_for(ok), UDP, 0.2)) == [CallConfirmed]
    return ref, ok


def drive(ua: UserAgent, until: float) -> list[tuple[float, Effect]]:
    out: list[tuple[float, Effect]] = []
    while (d := ua.next_deadline()) is not None and d <= until:
        out += [(d, e) for e in ua.handle_timer(d)]
    return out


# --- INVITE / 200 / ACK ---------------------------------------------------------------------------


def test_invite_gets_100_at_once_and_is_offered_to_the_application() -> None:
    ua = make_ua()
    effects = ua.receive(invite(), UDP, 0.0)
    assert codes(effects) == [100]
    assert header(sends(effects)[0].data, "To") == "<sip:1000@127.0.0.1:5060>"  # no tag on 100
    (ev,) = [e for e in effects if isinstance(e, CallOffered)]
    assert ev.request.body == SDP_OFFER.encode()
    assert ua.active_calls == 1


def test_answer_sends_200_with_contact_tag_and_sdp_and_retransmits_until_ack() -> None:
    ua = make_ua()
    ref, ok = answered(ua)
    assert header(ok, "Contact") == "<sip:127.0.0.1:5060>"
    assert header(ok, "Content-Type") == "application/sdp"
    assert ok.endswith(ANSWER)
    assert to_tag_of(ok)
    assert "INVITE" in (header(ok, "Allow") or "")
    fired = drive(ua, 4.0)
    assert [round(t, 2) for t, e in fired if isinstance(e, Send)] == [0.6, 1.6, 3.6]
    assert all(e.data == ok for _, e in fired if isinstance(e, Send))
    assert events(ua.receive(ack_for(ok), UDP, 4.0)) == [CallConfirmed]
    assert ua.call_phase(ref) is CallPhase.CONFIRMED
    assert not [e for _, e in drive(ua, 40.0) if isinstance(e, Send)]


def test_retransmitted_invite_before_answer_gets_the_100_again_and_after_is_absorbed() -> None:
    ua = make_ua()
    data = invite()
    offered(ua, data)
    assert codes(ua.receive(data, UDP, 0.3)) == [100]
    assert not events(ua.receive(data, UDP, 0.3))  # not offered twice
    ref = "c0"
    ua.answer(ref, ANSWER, 0.4)
    assert ua.receive(data, UDP, 0.45) == []  # RFC 6026 Accepted state


def test_no_ack_for_200_reports_ack_timeout_after_64_t1_and_bye_follows_at_once() -> None:
    ua = make_ua()
    ref, _ok = answered(ua, now=0.0)
    fired = drive(ua, 40.0)
    timeouts = [(t, e) for t, e in fired if isinstance(e, CallAckTimeout)]
    assert timeouts == [(pytest.approx(32.0), CallAckTimeout(ref))]
    (bye,) = sends(ua.hangup(ref, 40.0, reason="no_ack"))
    assert bye.data.startswith(b"BYE sip:alice@127.0.0.1:5070 SIP/2.0")


# --- CANCEL ---------------------------------------------------------------------------------------


def test_cancel_before_answer_gets_200_and_the_invite_487() -> None:
    ua = make_ua()
    data = invite(branch="z9hG4bKinv1")
    ref = offered(ua, data)
    effects = ua.receive(request("CANCEL", branch="z9hG4bKinv1"), UDP, 0.5)
    assert codes(effects) == [200, 487]
    assert events(effects) == [CallCancelled]
    cancel_ok, terminated = sends(effects)
    assert header(cancel_ok, "CSeq") == "1 CANCEL"
    assert header(terminated, "CSeq") == "1 INVITE"
    assert to_tag_of(cancel_ok) == to_tag_of(terminated)  # §9.2
    assert not ua.has_call(ref) and ua.active_calls == 0
    # The ACK for the 487 is absorbed by the INVITE transaction; the 487 stops being retransmitted.
    assert ua.receive(request("ACK", branch="z9hG4bKinv1", to_tag=to_tag_of(terminated)), UDP, 0.6) == []
    assert ua.answer(ref, ANSWER, 0.7) == []  # too late to answer


def test_cancel_without_a_matching_invite_is_481_and_after_the_answer_only_200() -> None:
    ua = make_ua()
    assert codes(ua.receive(request("CANCEL", branch="z9hG4bKnone"), UDP, 0.0)) == [481]
    data = invite(branch="z9hG4bKinv2")
    ref = offered(ua, data)
    ua.answer(ref, ANSWER, 0.1)
    effects = ua.receive(request("CANCEL", branch="z9hG4bKinv2"), UDP, 0.2)
    assert codes(effects) == [200] and events(effects) == []


# --- BYE ------------------------------------------------------------------------------------------


def test_bye_after_ack_ends_the_call_and_its_retransmission_gets_the_same_200() -> None:
    ua = make_ua()
    ref, ok = confirmed(ua)
    bye = request("BYE", to_tag=to_tag_of(ok), cseq=2)
    effects = ua.receive(bye, UDP, 1.0)
    assert codes(effects) == [200] and events(effects) == [CallEndedByPeer]
    assert codes(ua.receive(bye, UDP, 1.5)) == [200]
    assert not ua.has_call(ref)


def test_bye_before_the_ack_also_ends_the_call() -> None:
    ua = make_ua()
    _ref, ok = answered(ua)
    effects = ua.receive(request("BYE", to_tag=to_tag_of(ok), cseq=2), UDP, 0.3)
    assert codes(effects) == [200] and events(effects) == [CallEndedByPeer]
    assert not [e for _, e in drive(ua, 40.0) if isinstance(e, Send | CallAckTimeout)]


def test_requests_for_unknown_dialogs_get_481() -> None:
    ua = make_ua()
    assert codes(ua.receive(request("BYE", to_tag="nope"), UDP, 0.0)) == [481]
    assert codes(ua.receive(request("BYE"), UDP, 0.0)) == [481]
    assert codes(ua.receive(invite(to_tag="nope"), UDP, 0.0)) == [481]
    assert ua.receive(request("ACK", to_tag="nope"), UDP, 0.0) == []  # never answer an ACK


def test_gateway_bye_waits_for_the_ack_then_goes_to_the_invite_source() -> None:
    ua = make_ua()
    ref, ok = answered(ua)
    assert ua.hangup(ref, 0.2, reason="shutdown") == []  # §15: not before the ACK
    assert ua.active_calls == 0  # no longer counted against max_calls
    effects = ua.receive(ack_for(ok), UDP, 0.3)
    (bye,) = sends(effects)
    assert bye.dest == UDP.remote
    msg = parse_message(bye.data)
    assert isinstance(msg, SipRequest) and msg.method == "BYE"
    assert msg.to.tag == "uac-tag" and msg.from_.tag == to_tag_of(ok)
    assert header(bye.data, "Reason") == 'SIP;cause=200;text="shutdown"'
    assert msg.via[0].has_rport and msg.via[0].branch and msg.via[0].branch.startswith("z9hG4bK")
    # Retransmitted by Timer E until answered; the answer releases the call.
    assert [t for t, e in drive(ua, 1.0) if isinstance(e, Send)] == [pytest.approx(0.8)]
    ok_bye = (
        "SIP/2.0 200 OK\r\n"
        f"Via: {header(bye.data, 'Via')}\r\n"
        f"From: {header(bye.data, 'From')}\r\nTo: {header(bye.data, 'To')}\r\n"
        f"Call-ID: {msg.call_id}\r\nCSeq: {msg.cseq}\r\nContent-Length: 0\r\n\r\n"
    ).encode()
    assert ua.receive(ok_bye, UDP, 1.0) == [CallReleased(ref, 200)]
    assert not ua.has_call(ref) and ua.pending_client_transactions == 0


def test_gateway_bye_unanswered_times_out_and_releases() -> None:
    ua = make_ua()
    ref, _ = confirmed(ua)
    assert len(sends(ua.hangup(ref, 1.0, reason="rtp_timeout"))) == 1
    fired = drive(ua, 100.0)
    assert (pytest.approx(33.0), CallReleased(ref, None)) in fired
    assert ua.pending_client_transactions == 0


def test_hangup_before_answer_is_480() -> None:
    ua = make_ua()
    ref = offered(ua)
    assert codes(ua.hangup(ref, 0.1, reason="shutdown")) == [480]
    assert not ua.has_call(ref)


# --- re-INVITE ------------------------------------------------------------------------------------


HOLD = SDP_OFFER.replace("a=sendrecv", "a=sendonly").replace("o=- 1 1", "o=- 1 2")


def test_reinvite_is_offered_and_answered_and_its_200_waits_for_its_own_ack() -> None:
    ua = make_ua()
    ref, ok = confirmed(ua)
    tag = to_tag_of(ok)
    effects = ua.receive(invite(to_tag=tag, cseq=2, body=HOLD), UDP, 1.0)
    assert codes(effects) == [100]
    (ev,) = [e for e in effects if isinstance(e, SessionReoffered)]
    assert b"a=sendonly" in ev.request.body
    (ok2,) = sends(ua.answer_reoffer(ref, ANSWER.replace(b"o=ttg 1 0", b"o=ttg 1 1"), 1.1))
    assert status_of(ok2) == 200 and to_tag_of(ok2) == tag
    assert [round(t, 2) for t, e in drive(ua, 2.0) if isinstance(e, Send)] == [1.6]
    assert ua.receive(request("ACK", to_tag=tag, cseq=2), UDP, 2.0) == [ReofferConfirmed(ref, b"")]
    assert ua.receive(request("ACK", to_tag=tag, cseq=2), UDP, 2.1) == []  # a retransmitted ACK: nothing
    assert not [e for _, e in drive(ua, 40.0) if isinstance(e, Send)]


def test_reinvite_with_old_cseq_is_500_and_a_second_pending_one_is_500_retry() -> None:
    ua = make_ua()
    _ref, ok = confirmed(ua)
    tag = to_tag_of(ok)
    assert codes(ua.receive(invite(to_tag=tag, cseq=1, branch="z9hG4bKold"), UDP, 1.0)) == [500]
    assert codes(ua.receive(invite(to_tag=tag, cseq=3), UDP, 1.0)) == [100]
    effects = ua.receive(invite(to_tag=tag, cseq=4), UDP, 1.1)
    assert codes(effects) == [500] and header(sends(effects)[0].data, "Retry-After") == "1"


def test_rejected_reinvite_keeps_the_call() -> None:
    ua = make_ua()
    ref, ok = confirmed(ua)
    ua.receive(invite(to_tag=to_tag_of(ok), cseq=2), UDP, 1.0)
    assert codes(ua.reject_reoffer(ref, 488, 1.1)) == [488]
    assert ua.call_phase(ref) is CallPhase.CONFIRMED


# --- other methods, checks, routing ---------------------------------------------------------------


def test_options_answers_200_with_allow_accept_supported() -> None:
    ua = make_ua(siprec=True)
    (ok,) = sends(ua.receive(request("OPTIONS"), UDP, 0.0))
    assert status_of(ok) == 200
    assert header(ok, "Allow") == "INVITE, ACK, BYE, CANCEL, OPTIONS"
    assert header(ok, "Accept") == (
        "application/sdp, multipart/mixed, application/rs-metadata+xml, application/rs-metadata"
    )
    assert header(ok, "Supported") == "siprec"
    assert to_tag_of(ok)
    (plain,) = sends(make_ua(siprec=False).receive(request("OPTIONS"), UDP, 0.0))
    assert header(plain, "Accept") == "application/sdp" and header(plain, "Supported") == ""


# --- SIPREC (RFC 7866) ------------------------------------------------------------------------------

SIPREC_BODY = "--b\r\nContent-Type: application/sdp\r\n\r\n" + SDP_OFFER + "\r\n--b--\r\n"
SRC = ("Require: siprec", "Contact: <sip:src@127.0.0.1:5070>;+sip.src")


def test_a_recording_session_is_offered_and_answered_as_an_srs() -> None:
    ua = make_ua(siprec=True)
    data = invite(extra=SRC, content_type="multipart/mixed;boundary=b", body=SIPREC_BODY)
    ref = offered(ua, data)
    (ok,) = sends(ua.answer(ref, ANSWER, 0.1, recording=True))
    assert status_of(ok.data) == 200
    assert header(ok.data, "Require") == "siprec"
    assert (header(ok.data, "Contact") or "").endswith(">;+sip.srs")
    assert header(ok.data, "Content-Type") == "application/sdp"


def test_siprec_is_only_required_in_the_answer_when_the_src_named_it() -> None:
    ua = make_ua(siprec=True)
    ref = offered(ua, invite(content_type="multipart/mixed;boundary=b", body=SIPREC_BODY))
    (ok,) = sends(ua.answer(ref, ANSWER, 0.1, recording=True))
    assert header(ok.data, "Require") is None and (header(ok.data, "Contact") or "").endswith(";+sip.srs")


def test_require_siprec_with_another_extension_names_only_the_other() -> None:
    ua = make_ua(siprec=True)
    (r,) = sends(ua.receive(invite(extra=("Require: siprec, 100rel",)), UDP, 0.0))
    assert status_of(r) == 420 and header(r, "Unsupported") == "100rel"


def test_capacity_counts_streams_so_a_two_leg_call_takes_two_places() -> None:
    ua = make_ua(admission=AdmissionConfig(max_calls=3, invite_rate_per_s=0))
    first = offered(ua, invite(call_id="a@h"))
    ua.set_streams(first, 2)  # a SIPREC session with two recorded streams
    offered(ua, invite(call_id="b@h"))
    assert (ua.active_calls, ua.active_streams) == (2, 3)
    (full,) = sends(ua.receive(invite(call_id="c@h"), UDP, 0.1))
    assert status_of(full) == 503 and header(full, "Retry-After")
    ua.hangup(first, 0.2)  # ending: its streams no longer count
    assert ua.active_streams == 1
    assert codes(ua.receive(invite(call_id="d@h"), UDP, 0.3)) == [100]


def test_with_siprec_off_a_recording_session_is_refused() -> None:
    ua = make_ua(siprec=False)
    (r,) = sends(ua.receive(invite(extra=SRC), UDP, 0.0))
    assert status_of(r) == 420 and header(r, "Unsupported") == "siprec"
    (r,) = sends(ua.receive(invite(content_type="multipart/mixed;boundary=b", body=SIPREC_BODY), UDP, 0.0))
    assert status_of(r) == 415 and header(r, "Accept") == "application/sdp"


def test_known_unsupported_methods_get_405_with_allow_and_unknown_ones_501() -> None:
    ua = make_ua()
    (r405,) = sends(ua.receive(request("REGISTER"), UDP, 0.0))
    assert status_of(r405) == 405 and header(r405, "Allow")
    assert codes(ua.receive(request("FROBNICATE"), UDP, 0.0)) == [501]


def test_unsupported_require_gets_420_listing_the_extensions() -> None:
    ua = make_ua()
    (r,) = sends(ua.receive(invite(extra=("Require: 100rel, timer",)), UDP, 0.0))
    assert status_of(r) == 420 and header(r, "Unsupported") == "100rel, timer"
    ref, ok = confirmed(ua)
    (r,) = sends(ua.receive(invite(to_tag=to_tag_of(ok), cseq=2, extra=("Require: timer",)), UDP, 1.0))
    assert status_of(r) == 420
    assert ua.call_phase(ref) is CallPhase.CONFIRMED


def test_invite_without_sdp_is_a_delayed_offer_answered_in_the_ack() -> None:
    ua = make_ua()
    effects = ua.receive(request("INVITE"), UDP, 0.0)
    assert codes(effects) == [100] and events(effects) == [CallOffered]
    (ok,) = sends(ua.answer("c0", ANSWER, 0.1))  # the application's offer
    ack = request("ACK", to_tag=to_tag_of(ok), body=SDP_OFFER)
    (confirmed,) = [e for e in ua.receive(ack, UDP, 0.2) if isinstance(e, CallConfirmed)]
    assert confirmed.body == SDP_OFFER.encode()


def test_invite_with_other_content_is_refused() -> None:
    ua = make_ua()
    assert codes(ua.receive(invite(content_type="text/plain"), UDP, 0.0)) == [415]
    assert codes(ua.receive(invite(extra=("Accept: text/html",)), UDP, 0.0)) == [406]
    assert ua.active_calls == 0


def test_merged_request_from_a_fork_is_482() -> None:
    ua = make_ua()
    offered(ua, invite(branch="z9hG4bKa"))
    assert codes(ua.receive(invite(branch="z9hG4bKb"), UDP, 0.1)) == [482]


def test_responses_follow_rport_received_and_via_port() -> None:
    ua = make_ua()
    nat = Flow("udp", ("127.0.0.9", 40000))
    (r,) = sends(ua.receive(request("OPTIONS", via_host="10.0.0.5:5070"), nat, 0.0))
    assert r.dest == ("127.0.0.9", 40000)
    assert header(r, "Via") is not None
    via = header(r, "Via") or ""
    assert "rport=40000" in via and "received=127.0.0.9" in via
    (r,) = sends(ua.receive(request("OPTIONS", via_host="10.0.0.5:5070", rport=False), nat, 0.0))
    assert r.dest == ("127.0.0.9", 5070)  # §18.2.2: the received address, the sent-by port
    (r,) = sends(ua.receive(request("OPTIONS", via_host="host.example.com", rport=False), nat, 0.0))
    assert r.dest == ("127.0.0.9", 5060)  # never the named host


def test_all_vias_are_copied_in_order() -> None:
    ua = make_ua()
    data = request("OPTIONS").replace(
        b"Max-Forwards",
        b"Via: SIP/2.0/UDP 127.0.0.2:5080;branch=z9hG4bKp1, SIP/2.0/UDP 127.0.0.3;branch=z9hG4bKp2"
        b"\r\nMax-Forwards",
    )
    (r,) = sends(ua.receive(data, UDP, 0.0))
    vias = headers(r, "Via")
    assert len(vias) == 2 and "z9hG4bKp1" in vias[1] and "z9hG4bKp2" in vias[1]


def test_tcp_answers_go_back_on_the_connection_and_contact_says_tcp() -> None:
    ua = make_ua()
    ref = offered(ua, invite(transport="TCP"), flow=TCP)
    (ok,) = sends(ua.answer(ref, ANSWER, 0.1))
    assert ok.flow == TCP
    assert header(ok.data, "Contact") == "<sip:127.0.0.1:5060;transport=tcp>"


def test_malformed_request_gets_400_at_the_source_and_is_counted() -> None:
    ua = make_ua()
    bad = invite().replace(b"CSeq: 1 INVITE", b"CSeq: x INVITE")
    (r,) = sends(ua.receive(bad, UDP, 0.0))
    assert status_of(r) == 400 and r.dest == UDP.remote
    assert "Warning" in r.data.decode()
    assert ua.take_counters().errors["malformed"] == 1
    assert ua.receive(b"\x00\x01binary junk", UDP, 0.0) == []
    assert ua.receive(b"SIP/2.0 200 OK\r\n\r\n", UDP, 0.0) == []
    assert ua.take_counters().errors.total() == 2


# --- admission ------------------------------------------------------------------------------------


def test_disallowed_source_gets_403_and_its_acks_are_dropped() -> None:
    ua = make_ua(admission=AdmissionConfig(allow_cidrs=("10.0.0.0/8",)))
    assert codes(ua.receive(invite(), UDP, 0.0)) == [403]
    assert codes(ua.receive(request("OPTIONS"), UDP, 0.0)) == [403]
    assert ua.receive(request("ACK", to_tag="x"), UDP, 0.0) == []
    assert ua.take_counters().calls["rejected_forbidden"] == 1


def test_over_max_calls_is_503_with_retry_after() -> None:
    ua = make_ua(admission=AdmissionConfig(max_calls=1, retry_after_s=9))
    offered(ua, invite(call_id="a"))
    (r,) = sends(ua.receive(invite(call_id="b"), UDP, 0.1))
    assert status_of(r) == 503 and header(r, "Retry-After") == "9"
    assert ua.take_counters().calls["rejected_capacity"] == 1


def test_draining_refuses_new_calls_but_keeps_dialogs() -> None:
    ua = make_ua()
    _ref, ok = confirmed(ua)
    ua.set_admitting(False)
    assert codes(ua.receive(invite(call_id="new"), UDP, 1.0)) == [503]
    assert codes(ua.receive(request("BYE", to_tag=to_tag_of(ok), cseq=2), UDP, 1.0)) == [200]


def test_rate_limited_source_gets_503() -> None:
    ua = make_ua(admission=AdmissionConfig(invite_rate_per_s=1.0, invite_burst=2))
    offered(ua, invite(call_id="1"))
    offered(ua, invite(call_id="2"))
    (r,) = sends(ua.receive(invite(call_id="3"), UDP, 0.0))
    assert status_of(r) == 503 and header(r, "Retry-After") == "1"


def test_digest_challenge_then_authorized_invite_is_offered() -> None:
    ua = make_ua(digest=DigestConfig(realm="ttg", username="pbx", password="pw"))
    (challenge,) = sends(ua.receive(invite(), UDP, 0.0))
    assert status_of(challenge) == 401
    values = headers(challenge, "WWW-Authenticate")
    assert len(values) == 2
    _, params = parse_credentials(values[0])
    auth = authorization_header(
        username="pbx", password="pw", realm="ttg", nonce=params["nonce"], method="INVITE",
        uri="sip:1000@127.0.0.1:5060", algorithm=params["algorithm"],
    )  # fmt: skip
    effects = ua.receive(invite(cseq=2, extra=(f"Authorization: {auth}",)), UDP, 0.1)
    assert codes(effects) == [100] and events(effects) == [CallOffered]
    wrong = auth.replace('response="', 'response="0')
    (r,) = sends(ua.receive(invite(call_id="other", extra=(f"Authorization: {wrong}",)), UDP, 0.2))
    assert status_of(r) == 403


def test_rfc2543_invite_without_branch_is_handled() -> None:
    ua = make_ua()
    data = invite().replace(b";branch=", b";x=").replace(b";rport", b"")
    ref = offered(ua, data)
    (ok,) = sends(ua.answer(ref, ANSWER, 0.1))
    ack = request("ACK", to_tag=to_tag_of(ok)).replace(b";branch=", b";x=")
    assert events(ua.receive(ack, UDP, 0.2)) == [CallConfirmed]


def test_a_full_transaction_table_answers_503_statelessly() -> None:
    ua = make_ua(max_transactions=3)
    for i in range(3):
        assert codes(ua.receive(request("OPTIONS", branch=f"z9hG4bKf{i}"), UDP, 0.0)) == [200]
    assert codes(ua.receive(request("OPTIONS", branch="z9hG4bKf9"), UDP, 0.0)) == [503]
    assert ua.take_counters().errors["overload"] == 1
    drive(ua, 40.0)  # Timer J frees them
    assert codes(ua.receive(request("OPTIONS", branch="z9hG4bKf10"), UDP, 40.0)) == [200]
