"""Hostile or sloppy peers: bytes that are not UTF-8, numbers that are not ASCII, password guessing.

Whatever arrives gets a SIP answer (or, for a banned guesser, a deliberate silence), never an
exception and never an unexplained drop."""

from __future__ import annotations

import pytest

from gateway.sip.admission import AdmissionConfig
from gateway.sip.agent import AuthFailure, CallOffered, Effect, Flow, UserAgent
from gateway.sip.auth import DigestConfig, authorization_header
from gateway.sip.headers import parse_credentials
from gateway.sip.message import FramingError, SipParseError, StreamFramer, parse_message
from tests.gateway.sip.factories import TCP, UDP, invite, request, status_of, to_tag_of
from tests.gateway.sip.test_agent import codes, make_ua, sends

LATIN1_FROM = 'From: "J\xfcrgen M\xfcller" <sip:juergen@127.0.0.1:5070>;tag=uac-tag'


def latin1(data: bytes) -> bytes:
    """The request with its From display name in ISO-8859-1 (as some old PBXs send it)."""
    new_from = LATIN1_FROM.encode("latin-1")
    return b"\r\n".join(new_from if line.startswith(b"From:") else line for line in data.split(b"\r\n"))


def test_a_latin1_display_name_gets_an_answer_that_echoes_its_bytes() -> None:
    ua = make_ua()
    data = latin1(request("OPTIONS"))
    assert b"J\xfcrgen" in data
    (answer,) = sends(ua.receive(data, UDP, 0.0))
    assert status_of(answer) == 200
    assert b'From: "J\xfcrgen M\xfcller" <sip:juergen@127.0.0.1:5070>;tag=uac-tag\r\n' in answer.data


def test_a_latin1_display_name_on_an_invite_makes_a_call_and_over_tcp_too() -> None:
    ua = make_ua()
    effects = ua.receive(latin1(invite()), TCP, 0.0)
    assert codes(effects) == [100] and any(isinstance(e, CallOffered) for e in effects)


def test_a_latin1_byte_in_the_request_uri_gets_400_naming_it() -> None:
    ua = make_ua()
    data = request("OPTIONS").replace(b"OPTIONS sip:1000@", b"OPTIONS sip:J\xfcrgen@", 1)
    (answer,) = sends(ua.receive(data, UDP, 0.0))
    assert status_of(answer) == 400
    assert b"byte 0xfc (not UTF-8)" in answer.data


@pytest.mark.parametrize("digits", ["²", "٣", "１２"])
def test_a_content_length_of_non_ascii_digits_is_400(digits: str) -> None:
    data = request("OPTIONS").replace(b"Content-Length: 0", f"Content-Length: {digits}".encode())
    with pytest.raises(SipParseError) as err:
        parse_message(data)
    assert err.value.status == 400
    (answer,) = sends(make_ua().receive(data, UDP, 0.0))
    assert status_of(answer) == 400


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b"CSeq: 1 OPTIONS", "CSeq: ² OPTIONS".encode()),
        (b"Max-Forwards: 70", "Max-Forwards: ٧٠".encode()),
        (b"127.0.0.1:5070;branch", "127.0.0.1:５０７０;branch".encode()),
    ],
)
def test_other_numeric_fields_with_non_ascii_digits_are_400(old: bytes, new: bytes) -> None:
    data = request("OPTIONS").replace(old, new, 1)
    assert data != request("OPTIONS")
    with pytest.raises(SipParseError):
        parse_message(data)


def test_over_tcp_a_non_ascii_content_length_cannot_be_framed_but_the_request_is_answered_400() -> None:
    data = request("OPTIONS", transport="TCP").replace(b"Content-Length: 0", "Content-Length: ²".encode())
    with pytest.raises(FramingError, match="Content-Length") as err:
        StreamFramer().feed(data)
    assert err.value.head == data  # the whole header section, for the answer before the close
    (answer,) = sends(make_ua().receive(err.value.head, TCP, 0.0))
    assert status_of(answer) == 400


# --- password guessing -------------------------------------------------------------------------

DIGEST = DigestConfig(realm="ttg", username="trunk", password="s3cret", secret=b"k" * 32)
GUESSER = UDP  # 127.0.0.1:5070


def attempt(ua: UserAgent, password: str, n: int, now: float, flow: Flow = GUESSER) -> list[Effect]:
    """One guess as a cracker makes it: an INVITE, its 401, the INVITE again with the password."""
    first = ua.receive(invite(call_id=f"g{n}@x", cseq=1), flow, now)
    challenge = sends(first)
    if not challenge:
        return first  # dropped: banned
    assert status_of(challenge[0]) == 401
    www = [line for line in challenge[0].data.decode().split("\r\n") if line.startswith("WWW-Authenticate:")]
    params = parse_credentials(www[0].split(":", 1)[1].strip())[1]
    auth = authorization_header(
        username="trunk", password=password, realm="ttg", nonce=params["nonce"], method="INVITE",
        uri="sip:1000@127.0.0.1:5060", algorithm=params["algorithm"],
    )  # fmt: skip
    return ua.receive(invite(call_id=f"g{n}@x", cseq=2, extra=(f"Authorization: {auth}",)), flow, now)


def test_each_wrong_password_is_a_403_and_an_auth_failure_naming_source_and_user() -> None:
    ua = make_ua(digest=DIGEST)
    effects = attempt(ua, "guess", 1, 0.0)
    assert codes(effects) == [403]
    (failure,) = [e for e in effects if isinstance(e, AuthFailure)]
    assert failure == AuthFailure(GUESSER.remote, "trunk", "ttg", "bad credentials", 1, 0.0)


def test_a_guesser_is_banned_after_max_failures_and_then_gets_nothing_even_with_the_password() -> None:
    ua = make_ua(
        digest=DIGEST,
        admission=AdmissionConfig(auth_max_failures=5, auth_failure_window_s=60.0, auth_ban_s=600.0),
    )
    failures = []
    for n in range(5):
        effects = attempt(ua, f"wrong{n}", n, float(n))
        failures += [e for e in effects if isinstance(e, AuthFailure)]
    assert [f.failures for f in failures] == [1, 2, 3, 4, 5]
    assert failures[-1].banned_for_s == 600.0
    # The right password now: no challenge, no answer at all (the dictionary loses its last words).
    assert attempt(ua, "s3cret", 99, 10.0) == []
    assert ua.receive(request("OPTIONS"), GUESSER, 11.0) == []
    assert ua.take_counters().errors["banned"] == 2
    # Another source is not affected, and the ban ends.
    other = Flow("udp", ("127.0.0.9", 5070))
    assert codes(attempt(ua, "s3cret", 100, 12.0, flow=other)) == [100]
    assert codes(attempt(ua, "s3cret", 101, 611.0)) == [100]


def test_failures_spread_wider_than_the_window_do_not_ban() -> None:
    ua = make_ua(digest=DIGEST, admission=AdmissionConfig(auth_max_failures=3, auth_failure_window_s=10.0))
    for n in range(6):
        effects = attempt(ua, "typo", n, 6.0 * n)
        assert codes(effects) == [403]
    assert codes(attempt(ua, "s3cret", 50, 40.0)) == [100]


def test_calls_already_up_from_a_banned_source_go_on() -> None:
    ua = make_ua(digest=DIGEST, admission=AdmissionConfig(auth_max_failures=1))
    effects = attempt(ua, "s3cret", 0, 0.0)
    (offer,) = [e for e in effects if isinstance(e, CallOffered)]
    (ok,) = sends(ua.answer(offer.call_ref, b"v=0\r\n", 0.1))
    attempt(ua, "wrong", 1, 0.5)  # the same IP starts guessing: banned now
    assert ua.receive(request("OPTIONS"), GUESSER, 0.6) == []
    bye = request("BYE", call_id="g0@x", cseq=3, to_tag=to_tag_of(ok))
    assert codes(ua.receive(bye, GUESSER, 1.0)) == [200]


def test_unauthenticated_invites_take_rate_tokens_so_challenges_cannot_be_farmed() -> None:
    ua = make_ua(digest=DIGEST, admission=AdmissionConfig(invite_rate_per_s=1.0, invite_burst=2))
    got = [codes(ua.receive(invite(call_id=f"r{n}@x"), GUESSER, 0.0)) for n in range(4)]
    assert got == [[401], [401], [503], [503]]
