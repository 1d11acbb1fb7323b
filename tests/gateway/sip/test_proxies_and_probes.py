"""Behind a proxy (Kamailio, an SBC): the route set (RFC 3261 §12.1.1, §12.2.1.1) and health probes."""

from __future__ import annotations

from gateway.sip.admission import AdmissionConfig
from gateway.sip.agent import CallEndedByPeer
from gateway.sip.dialog import Dialog
from gateway.sip.headers import Via
from gateway.sip.message import SipRequest, parse_message
from tests.gateway.sip.factories import UDP, header, headers, invite, request, status_of, to_tag_of
from tests.gateway.sip.test_agent import ANSWER, ack_for, codes, make_ua, offered, sends

PROXY_RR = (
    "Record-Route: <sip:10.0.0.1;lr;ftag=uac-tag;did=a1>",
    "Record-Route: <sip:10.0.0.2:5062;transport=tcp;lr>, <sip:10.0.0.3;lr>",
)


def test_the_2xx_copies_record_route_values_in_order_with_their_parameters() -> None:
    ua = make_ua()
    ref = offered(ua, invite(extra=PROXY_RR))
    (ok,) = sends(ua.answer(ref, ANSWER, 0.1))
    assert status_of(ok) == 200
    assert headers(ok, "Record-Route") == [
        "<sip:10.0.0.1;lr;ftag=uac-tag;did=a1>",
        "<sip:10.0.0.2:5062;transport=tcp;lr>",
        "<sip:10.0.0.3;lr>",
    ]


def test_a_180_with_our_tag_creates_the_early_dialog_and_copies_record_route_too() -> None:
    ua = make_ua()
    ref = offered(ua, invite(extra=PROXY_RR[:1]))
    (ringing,) = sends(ua.ring(ref, 0.05))
    assert status_of(ringing) == 180 and headers(ringing, "Record-Route") == [PROXY_RR[0][14:]]


def test_responses_outside_a_dialog_and_without_record_route_carry_none() -> None:
    ua = make_ua()
    (ok,) = sends(ua.receive(request("OPTIONS", extra=PROXY_RR), UDP, 0.0))
    assert status_of(ok) == 200 and header(ok, "Record-Route") is None
    ref = offered(ua, invite(call_id="plain@x"))
    (ok,) = sends(ua.answer(ref, ANSWER, 0.1))
    assert header(ok, "Record-Route") is None


def test_the_callers_bye_through_the_proxy_ends_the_call_and_our_bye_follows_the_route_set() -> None:
    ua = make_ua()
    ref = offered(ua, invite(extra=PROXY_RR))
    (ok,) = sends(ua.answer(ref, ANSWER, 0.1))
    ua.receive(ack_for(ok), UDP, 0.2)
    (bye,) = sends(ua.hangup(ref, 1.0, reason="shutdown"))
    sent = parse_message(bye.data)
    assert isinstance(sent, SipRequest) and sent.method == "BYE"
    assert sent.uri == "sip:alice@127.0.0.1:5070"  # the remote target (Contact): loose routing
    assert sent.headers.get_all("Route") == [
        "<sip:10.0.0.1;lr;ftag=uac-tag;did=a1>",
        "<sip:10.0.0.2:5062;transport=tcp;lr>",
        "<sip:10.0.0.3;lr>",
    ]
    assert bye.dest == UDP.remote  # to the proxy the INVITE came from

    ua2 = make_ua()
    ref2 = offered(ua2, invite(extra=PROXY_RR))
    (ok2,) = sends(ua2.answer(ref2, ANSWER, 0.1))
    effects = ua2.receive(request("BYE", cseq=2, to_tag=to_tag_of(ok2)), UDP, 1.0)
    assert codes(effects) == [200] and any(isinstance(e, CallEndedByPeer) for e in effects)


def test_a_strict_router_first_hop_gets_the_request_uri_and_the_target_goes_last_in_route() -> None:
    r = parse_message(invite(extra=("Record-Route: <sip:10.0.0.9>, <sip:10.0.0.3;lr>",)))
    assert isinstance(r, SipRequest)
    d = Dialog.from_invite(r, "gwtag")
    d.apply("answer")
    bye = d.make_request("BYE", Via("UDP", "127.0.0.1", 5060, (("branch", "z9hG4bKx"),)))
    assert bye.uri == "sip:10.0.0.9"
    assert bye.headers.get_all("Route") == ["<sip:10.0.0.3;lr>", "<sip:alice@127.0.0.1:5070>"]


def test_options_gets_503_with_retry_after_while_draining_so_a_dispatcher_probe_marks_us_down() -> None:
    ua = make_ua(admission=AdmissionConfig(retry_after_s=9))
    (ok,) = sends(ua.receive(request("OPTIONS"), UDP, 0.0))
    assert status_of(ok) == 200
    ua.set_admitting(False)
    (probe,) = sends(ua.receive(request("OPTIONS"), UDP, 1.0))
    assert status_of(probe) == 503 and header(probe, "Retry-After") == "9"
    assert codes(ua.receive(invite(call_id="late@x"), UDP, 1.1)) == [503]
    ua.set_admitting(True)
    assert codes(ua.receive(request("OPTIONS"), UDP, 2.0)) == [200]


def test_in_dialog_options_still_gets_200_while_draining() -> None:
    ua = make_ua()
    ref = offered(ua)
    (ok,) = sends(ua.answer(ref, ANSWER, 0.1))
    ua.receive(ack_for(ok), UDP, 0.2)
    ua.set_admitting(False)
    effects = ua.receive(request("OPTIONS", cseq=2, to_tag=to_tag_of(ok)), UDP, 1.0)
    assert codes(effects) == [200]
