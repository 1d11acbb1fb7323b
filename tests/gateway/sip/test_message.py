"""SIP message grammar: parse/serialize round trips, framing (§18.3), limits and the header parsers."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.sip.headers import (
    HeaderSyntaxError,
    parse_credentials,
    parse_cseq,
    parse_name_addr,
    parse_sip_uri,
    parse_via,
    split_list,
)
from gateway.sip.message import (
    MAX_HEADER_BYTES,
    FramingError,
    SipParseError,
    SipRequest,
    SipResponse,
    StreamFramer,
    parse_message,
    serialize,
)
from tests.gateway.sip.factories import SDP_OFFER, invite, request


def test_request_round_trips_through_serialize() -> None:
    data = invite(extra=("X-Language: uk-UA", "P-Asserted-Identity: <sip:+380441234567@pbx>"))
    message = parse_message(data)
    assert isinstance(message, SipRequest)
    again = parse_message(serialize(message))
    assert again == message
    assert message.body == SDP_OFFER.encode()
    assert message.headers.get("x-language") == "uk-UA"


def test_response_round_trips_through_serialize() -> None:
    data = (
        b"SIP/2.0 180 Ringing\r\nVia: SIP/2.0/UDP 127.0.0.1:5060;branch=z9hG4bKabc;rport=5060\r\n"
        b"From: <sip:a@127.0.0.1>;tag=1\r\nTo: <sip:b@127.0.0.1>;tag=2\r\nCall-ID: x\r\nCSeq: 1 INVITE\r\n"
        b"Content-Length: 0\r\n\r\n"
    )
    message = parse_message(data)
    assert isinstance(message, SipResponse)
    assert (message.status, message.reason) == (180, "Ringing")
    assert parse_message(serialize(message)) == message


def test_serialize_always_writes_a_true_content_length() -> None:
    message = parse_message(invite())
    assert isinstance(message, SipRequest)
    wire = serialize(message)
    assert wire.count(b"Content-Length") == 1
    assert f"Content-Length: {len(message.body)}".encode() in wire


def test_compact_forms_and_case_are_canonical() -> None:
    data = (
        b"OPTIONS sip:x@127.0.0.1 SIP/2.0\r\nv: SIP/2.0/UDP 127.0.0.1;branch=z9hG4bK1\r\n"
        b"f: <sip:a@h>;tag=1\r\nt: <sip:b@h>\r\ni: cid\r\ncseq: 2 OPTIONS\r\nl: 0\r\n\r\n"
    )
    message = parse_message(data)
    assert [k for k, _ in message.headers] == ["Via", "From", "To", "Call-ID", "CSeq", "Content-Length"]


def test_udp_extra_octets_after_content_length_are_discarded() -> None:
    message = parse_message(invite() + b"garbage after the body")
    assert message.body == SDP_OFFER.encode()


def test_udp_message_shorter_than_its_content_length_is_a_400() -> None:
    with pytest.raises(SipParseError) as info:
        parse_message(invite()[:-10])
    assert info.value.status == 400 and info.value.kind == "truncated"
    assert info.value.headers.get("Call-ID") == "call-1@127.0.0.1"  # enough to route a 400


def test_udp_without_content_length_takes_the_rest_of_the_datagram() -> None:
    data = invite().replace(b"Content-Length: %d\r\n" % len(SDP_OFFER), b"")
    assert parse_message(data).body == SDP_OFFER.encode()


def test_stream_transport_requires_content_length() -> None:
    data = invite().replace(b"Content-Length: %d\r\n" % len(SDP_OFFER), b"")
    with pytest.raises(SipParseError):
        parse_message(data, stream=True)


def test_binary_junk_is_rejected_as_binary() -> None:
    with pytest.raises(SipParseError) as info:
        parse_message(bytes(range(256)) * 4)
    assert info.value.kind in ("binary", "malformed", "truncated")
    with pytest.raises(SipParseError) as info:
        parse_message(b"\x80\x00\x12\x34" * 40)
    assert info.value.kind == "binary"


def test_huge_header_section_is_513() -> None:
    filler = tuple(f"X-Filler-{i}: {'a' * 200}" for i in range(MAX_HEADER_BYTES // 200 + 10))
    with pytest.raises(SipParseError) as info:
        parse_message(request("OPTIONS", extra=filler))
    assert info.value.status == 513 and info.value.kind == "too_large"
    assert info.value.headers.get("Via") is not None


def test_too_many_headers_is_513() -> None:
    with pytest.raises(SipParseError) as info:
        parse_message(request("OPTIONS", extra=tuple(f"X-H: {i}" for i in range(300))))
    assert info.value.status == 513


def test_leading_crlfs_before_the_start_line_are_ignored() -> None:
    assert isinstance(parse_message(b"\r\n\r\n" + request("OPTIONS")), SipRequest)


def test_bare_lf_line_ends_are_tolerated() -> None:
    data = request("OPTIONS").replace(b"\r\n", b"\n")
    assert isinstance(parse_message(data), SipRequest)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_parser_never_raises_anything_but_sip_parse_error(data: bytes) -> None:
    with contextlib.suppress(SipParseError):
        parse_message(data)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=len(invite()) - 1))
def test_any_truncation_of_a_request_is_a_clean_error(cut: int) -> None:
    data = invite()[:cut]
    try:
        parse_message(data)
    except SipParseError as e:
        assert e.status in (400, 505, 513)


# --- stream framing ---------------------------------------------------------------------------------


def test_framer_splits_messages_arriving_in_pieces() -> None:
    a, b = invite(), request("OPTIONS")
    stream = a + b"\r\n\r\n" + b
    framer = StreamFramer()
    out: list[bytes] = []
    for i in range(0, len(stream), 7):
        out += framer.feed(stream[i : i + 7])
    assert out == [a, b"\r\n\r\n", b]
    assert framer.buffered == 0


def test_framer_refuses_a_message_without_content_length() -> None:
    data = request("OPTIONS").replace(b"Content-Length: 0\r\n", b"")
    with pytest.raises(FramingError):
        StreamFramer().feed(data)


def test_framer_refuses_endless_headers() -> None:
    framer = StreamFramer(max_header_bytes=1000)
    with pytest.raises(FramingError):
        framer.feed(b"OPTIONS sip:x SIP/2.0\r\n" + b"X-A: b\r\n" * 200)


def test_framer_handles_a_large_sdp_offer() -> None:
    body = SDP_OFFER + "a=x-filler:" + "y" * 3000 + "\r\n"
    data = invite(body=body)
    assert len(data) > 3000
    assert StreamFramer().feed(data) == [data]


# --- header grammar ---------------------------------------------------------------------------------


def test_via_with_received_rport_and_ipv6() -> None:
    (via,) = parse_via("SIP/2.0/UDP [2001:db8::1]:5062;branch=z9hG4bKx;rport;received=192.0.2.1")
    assert (via.transport, via.host, via.port, via.branch, via.has_rport) == (
        "UDP",
        "[2001:db8::1]",
        5062,
        "z9hG4bKx",
        True,
    )
    assert str(via) == "SIP/2.0/UDP [2001:db8::1]:5062;branch=z9hG4bKx;rport;received=192.0.2.1"


@pytest.mark.parametrize(
    "value",
    [
        "SIP/2.0/UDP",
        "SIP/2.0/UDP host;;",
        "SIP/2.0/UDP host:99999",
        "SIP/2.0/UDP ho st",
        "SIP/2.0/UDP host;branch=",
    ],
)
def test_bad_vias_are_refused(value: str) -> None:
    with pytest.raises(HeaderSyntaxError):
        parse_via(value)


def test_name_addr_forms() -> None:
    a = parse_name_addr('"Bob \\"B\\"" <sip:bob@h;transport=tcp>;tag=9;x')
    assert (a.display_name, a.uri, a.tag) == ('Bob "B"', "sip:bob@h;transport=tcp", "9")
    b = parse_name_addr("sip:carol@h;tag=3")  # addr-spec: ';' starts header parameters
    assert (b.uri, b.tag) == ("sip:carol@h", "3")
    c = parse_name_addr("Carol Smith <tel:+15551234>")
    assert (c.display_name, c.uri) == ("Carol Smith", "tel:+15551234")
    assert parse_name_addr("*", allow_star=True).uri == "*"


@pytest.mark.parametrize(
    "value", ['"open <sip:a@h>', "Bell, A <sip:a@h>", "< sip:a@h >", "sip:a@h?x=y", "<>", "<sip:a@h"]
)
def test_bad_name_addrs_are_refused(value: str) -> None:
    with pytest.raises(HeaderSyntaxError):
        parse_name_addr(value)


def test_sip_uri_parts() -> None:
    uri = parse_sip_uri("sips:+49%2030@gw.example.net:5061;user=phone;lr?subject=x")
    assert (uri.scheme, uri.user_unescaped, uri.host, uri.port) == ("sips", "+49 30", "gw.example.net", 5061)
    assert uri.params == (("user", "phone"), ("lr", None))
    assert uri.headers == "subject=x"
    assert str(uri) == "sips:+49%2030@gw.example.net:5061;user=phone;lr?subject=x"


def test_cseq_range() -> None:
    assert parse_cseq("2147483647 INVITE").seq == 2**31 - 1
    with pytest.raises(HeaderSyntaxError):
        parse_cseq("2147483648 INVITE")
    with pytest.raises(HeaderSyntaxError):
        parse_cseq("-1 INVITE")


def test_split_list_respects_quotes_and_brackets() -> None:
    assert split_list('"a, b" <sip:x@h;p=1,2>, <sip:y@h>') == ['"a, b" <sip:x@h;p=1,2>', "<sip:y@h>"]


def test_credentials() -> None:
    scheme, p = parse_credentials('Digest username="bob", realm="r", nc=00000001, qop=auth, response="ab"')
    assert scheme == "Digest"
    assert p == {"username": "bob", "realm": "r", "nc": "00000001", "qop": "auth", "response": "ab"}
