"""multipart/mixed bodies as SIPREC SRCs send them (RFC 2046 §5.1, RFC 5621)."""

from __future__ import annotations

import pytest

from gateway.siprec.multipart import MAX_PARTS, BodyError, media_type, parse_multipart

SDP = b"v=0\r\no=- 1 1 IN IP4 192.0.2.1\r\ns=-\r\nc=IN IP4 192.0.2.1\r\nt=0 0\r\nm=audio 4000 RTP/AVP 0\r\n"
XML = b'<?xml version="1.0"?>\r\n<recording xmlns="urn:ietf:params:xml:ns:recording:1"/>\r\n'


def body(boundary: str, *parts: tuple[str, bytes], close: bool = True, eol: bytes = b"\r\n") -> bytes:
    out = b""
    for headers, content in parts:
        out += (
            f"--{boundary}".encode()
            + eol
            + headers.encode().replace(b"\r\n", eol)
            + eol
            + eol
            + content
            + eol
        )
    if close:
        out += f"--{boundary}--".encode() + eol
    return out


def test_two_parts_with_types_and_dispositions() -> None:
    data = body(
        "b1",
        ("Content-Type: application/sdp", SDP),
        ("Content-Type: application/rs-metadata+xml\r\nContent-Disposition: recording-session", XML),
    )
    parts = parse_multipart("multipart/mixed;boundary=b1", data)
    assert [p.content_type for p in parts] == ["application/sdp", "application/rs-metadata+xml"]
    assert [p.disposition for p in parts] == [None, "recording-session"]
    # The CRLF before a delimiter belongs to the delimiter (RFC 2046 §5.1.1): the content is exact.
    assert parts[0].body == SDP
    assert parts[1].body == XML


def test_quoted_boundary_preamble_epilogue_and_transport_padding() -> None:
    data = b"preamble to ignore\r\n" + body("a b'c", ("Content-Type: application/sdp", SDP))
    data = data.replace(b"--a b'c\r\n", b"--a b'c   \r\n", 1) + b"epilogue\r\n"
    parts = parse_multipart('multipart/mixed; boundary="a b\'c"', data)
    assert len(parts) == 1 and parts[0].body == SDP


def test_handling_parameter_and_vendor_part() -> None:
    data = body(
        "x",
        ("Content-Disposition: session;handling=required\r\nContent-Type: application/sdp", SDP),
        ("Content-Disposition: signal;handling=optional\r\nContent-Type: application/gtd", b"IAM,\r\nGCI,1"),
    )
    sdp, gtd = parse_multipart("multipart/mixed;boundary=x", data)
    assert (sdp.disposition, sdp.handling, sdp.required) == ("session", "required", True)
    assert (gtd.content_type, gtd.disposition, gtd.handling, gtd.required) == (
        "application/gtd",
        "signal",
        "optional",
        False,
    )


def test_a_part_without_headers_is_text_plain() -> None:
    data = b"--x\r\n\r\nhello\r\n--x--\r\n"
    (part,) = parse_multipart("multipart/mixed;boundary=x", data)
    assert part.content_type == "text/plain" and part.body == b"hello"


def test_bare_lf_line_ends_and_missing_close_delimiter_are_tolerated() -> None:
    data = body("x", ("Content-Type: application/sdp", SDP.replace(b"\r\n", b"\n")), close=False, eol=b"\n")
    (part,) = parse_multipart("multipart/mixed;boundary=x", data)
    assert part.content_type == "application/sdp"
    assert part.body.rstrip(b"\n") == SDP.replace(b"\r\n", b"\n").rstrip(b"\n")


@pytest.mark.parametrize(
    ("content_type", "data", "why"),
    [
        ("multipart/mixed", body("x", ("Content-Type: application/sdp", SDP)), "without a boundary"),
        ("multipart/mixed;boundary=other", body("x", ("Content-Type: application/sdp", SDP)), "no line"),
        ("multipart/mixed;boundary=x", b"just text, no delimiter at all\r\n", "no line"),
        ("multipart/mixed;boundary=" + "b" * 71, body("b" * 71, ("", b"x")), "longer than 70"),
    ],
)
def test_unframeable_bodies_are_400(content_type: str, data: bytes, why: str) -> None:
    with pytest.raises(BodyError) as err:
        parse_multipart(content_type, data)
    assert err.value.status == 400
    assert why in str(err.value)


def test_too_many_parts_is_400() -> None:
    data = body("x", *[("Content-Type: text/plain", b"p")] * (MAX_PARTS + 1))
    with pytest.raises(BodyError, match="parts"):
        parse_multipart("multipart/mixed;boundary=x", data)


def test_a_non_multipart_type_is_415() -> None:
    with pytest.raises(BodyError) as err:
        parse_multipart("application/sdp", SDP)
    assert err.value.status == 415


def test_media_type() -> None:
    assert media_type(" Multipart/Mixed ; boundary=x") == "multipart/mixed"
    assert media_type(None) == ""
