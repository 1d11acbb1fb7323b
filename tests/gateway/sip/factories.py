"""Builders of SIP requests as a UAC would send them (text templates, CRLF line ends)."""

from __future__ import annotations

import itertools

from gateway.sip.agent import Flow

_counter = itertools.count(1)

UAC = ("127.0.0.1", 5070)
UDP = Flow("udp", UAC)
TCP = Flow("tcp", UAC, conn_id=7)

SDP_OFFER = (
    "v=0\r\n"
    "o=- 1 1 IN IP4 127.0.0.1\r\n"
    "s=-\r\n"
    "c=IN IP4 127.0.0.1\r\n"
    "t=0 0\r\n"
    "m=audio 6000 RTP/AVP 0 8 101\r\n"
    "a=rtpmap:0 PCMU/8000\r\n"
    "a=rtpmap:8 PCMA/8000\r\n"
    "a=rtpmap:101 telephone-event/8000\r\n"
    "a=fmtp:101 0-15\r\n"
    "a=ptime:20\r\n"
    "a=sendrecv\r\n"
)


def request(
    method: str,
    *,
    call_id: str = "call-1@127.0.0.1",
    cseq: int = 1,
    cseq_method: str | None = None,
    branch: str | None = None,
    from_tag: str = "uac-tag",
    to_tag: str | None = None,
    uri: str = "sip:1000@127.0.0.1:5060",
    via_host: str = "127.0.0.1:5070",
    rport: bool = True,
    transport: str = "UDP",
    body: str = "",
    content_type: str | None = None,
    extra: tuple[str, ...] = (),
) -> bytes:
    branch = branch or f"z9hG4bK-test-{next(_counter)}"
    to = "<sip:1000@127.0.0.1:5060>" + (f";tag={to_tag}" if to_tag else "")
    lines = [
        f"{method} {uri} SIP/2.0",
        f"Via: SIP/2.0/{transport} {via_host};branch={branch}" + (";rport" if rport else ""),
        "Max-Forwards: 70",
        f'From: "Alice" <sip:alice@127.0.0.1:5070>;tag={from_tag}',
        f"To: {to}",
        f"Call-ID: {call_id}",
        f"CSeq: {cseq} {cseq_method or method}",
        "Contact: <sip:alice@127.0.0.1:5070>",
        *extra,
    ]
    if body:
        lines.append(f"Content-Type: {content_type or 'application/sdp'}")
    lines.append(f"Content-Length: {len(body.encode())}")
    return ("\r\n".join(lines) + "\r\n\r\n" + body).encode()


def invite(**kw: object) -> bytes:
    kw.setdefault("body", SDP_OFFER)
    return request("INVITE", **kw)  # type: ignore[arg-type]


def branch_of(data: bytes) -> str:
    for line in data.decode().split("\r\n"):
        if line.startswith("Via:"):
            return line.split("branch=")[1].split(";")[0]
    raise ValueError("no Via")


def _bytes(data: object) -> bytes:
    """The wire bytes of a message or of a `Send` effect."""
    raw = getattr(data, "data", data)
    assert isinstance(raw, bytes)
    return raw


def status_of(data: object) -> int:
    return int(_bytes(data).split(b" ", 2)[1])


def header(data: object, name: str) -> str | None:
    head = _bytes(data).split(b"\r\n\r\n", 1)[0].decode()
    for line in head.split("\r\n")[1:]:
        k, _, v = line.partition(":")
        if k.strip().lower() == name.lower():
            return v.strip()
    return None


def headers(data: object, name: str) -> list[str]:
    head = _bytes(data).split(b"\r\n\r\n", 1)[0].decode()
    out = []
    for line in head.split("\r\n")[1:]:
        k, _, v = line.partition(":")
        if k.strip().lower() == name.lower():
            out.append(v.strip())
    return out


def to_tag_of(data: object) -> str:
    to = header(data, "To") or ""
    return to.split("tag=")[1].split(";")[0]
