"""Fuzz targets: the gateway's parsers of untrusted bytes, each with the errors it is allowed to raise.

A target takes one input (`bytes`) and must either return or raise one of its `allowed` exceptions
(the parser's own "this is not valid" error). Anything else escaping a target is a bug: a crash of the
message or packet, or of the daemon if the adapter did not catch it. Targets are plain functions, so
the coverage-guided runner (`python -m tools.fuzz`, atheris/libFuzzer) and a quick in-process run
(`run_inputs`) drive exactly the same code.

- `sip`: `parse_message` as a datagram and as a framed stream message; what parses must serialize
  and parse again (a reply echoes what it got).
- `framer`: `StreamFramer` fed the input in pieces (split points from the input); it only splits.
- `agent`: `UserAgent.receive` over UDP and TCP flows, then its timers: the whole request path, with
  and without digest auth; no exception at all.
- `sdp`: `parse_sdp`, then `negotiate` with the gateway's defaults.
- `rtp`: `parse_rtp`, `parse_rtcp` and the STUN test of the RFC 7983 demux.
- `dtmf`: `TelephoneEvent.parse` and `DtmfDecoder` over a sequence of events.
- `media`: `MediaCore` (jitter buffer, latching, timeline, DTMF, idle fill) over a sequence of
  datagrams.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gateway.rtp.dtmf import DtmfDecoder, TelephoneEvent
from gateway.rtp.media import MediaConfig, MediaCore
from gateway.rtp.packet import RtpParseError, is_stun, parse_rtcp, parse_rtp
from gateway.sdp import MediaPlan, SdpError, negotiate, parse_sdp
from gateway.sip.agent import AgentConfig, Flow, UserAgent
from gateway.sip.auth import DigestConfig
from gateway.sip.message import FramingError, SipParseError, StreamFramer, parse_message, serialize


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    run: Callable[[bytes], None]
    allowed: tuple[type[BaseException], ...]
    seeds: Callable[[], list[bytes]]
    tokens: tuple[bytes, ...] = ()  # a libFuzzer dictionary: words the mutator splices in


SIP_TOKENS = (
    b"SIP/2.0", b"\r\n", b"\r\n\r\n", b"\n", b" ", b"\t", b":", b";", b",", b"<", b">", b'"', b"\\", b"%",
    b"INVITE", b"ACK", b"BYE", b"CANCEL", b"OPTIONS", b"REGISTER", b"sip:", b"sips:", b"tel:", b"@",
    b"Via: SIP/2.0/UDP ", b"Via: SIP/2.0/TCP ", b"v: ", b";branch=z9hG4bK", b";rport", b";received=",
    b";tag=", b";lr", b";transport=tcp", b"From: ", b"f: ", b"To: ", b"t: ", b"Call-ID: ", b"i: ",
    b"CSeq: ", b"Contact: ", b"m: ", b"Record-Route: ", b"Route: ", b"Max-Forwards: ", b"Expires: ",
    b"Content-Length: ", b"l: ", b"Content-Type: application/sdp", b"Require: ", b"Accept: ",
    b"Authorization: Digest ", b'username="', b'realm="', b'nonce="', b'uri="', b'response="',
    b"algorithm=MD5", b"algorithm=SHA-256", b"qop=auth", b"nc=00000001", b'cnonce="', b"Date: ",
    b"0", b"65535", b"2147483648", b"\xc2\xb2", b"\xfc", b"\xff", b"\x00", b"[::1]", b"127.0.0.1",
)  # fmt: skip
SDP_TOKENS = (
    b"v=0\r\n", b"o=- 1 1 IN IP4 ", b"s=-\r\n", b"c=IN IP4 ", b"c=IN IP6 ", b"t=0 0\r\n", b"m=audio ",
    b"m=video ", b" RTP/AVP ", b" RTP/SAVP ", b"a=rtpmap:", b" PCMU/8000", b" PCMA/8000",
    b" telephone-event/8000", b" CN/8000", b"a=fmtp:", b"a=ptime:", b"a=sendonly", b"a=recvonly",
    b"a=inactive", b"a=sendrecv", b"a=rtcp:", b"a=rtcp-mux", b"a=label:", b"0.0.0.0", b"\r\n", b"/",
)  # fmt: skip


def _pieces(data: bytes) -> tuple[bytes, list[int]]:
    """Split points from the input's first byte (a libFuzzer-friendly way to vary TCP segmentation)."""
    if not data:
        return data, []
    step = data[0] % 64 * 4 + 3  # 3..255 bytes per read
    body = data[1:]
    return body, list(range(0, len(body), step))


# --- SIP -------------------------------------------------------------------------------------------


def sip_message(data: bytes) -> None:
    for stream in (False, True):
        try:
            message = parse_message(data, stream=stream)
        except SipParseError:
            continue
        # What we parsed we can write back, and what we write back parses (a reply echoes headers).
        parse_message(serialize(message), stream=True)


def sip_framer(data: bytes) -> None:
    body, cuts = _pieces(data)
    framer = StreamFramer()
    framed = 0
    for i, start in enumerate(cuts):
        end = cuts[i + 1] if i + 1 < len(cuts) else len(body)
        for message in framer.feed(body[start:end]):
            framed += len(message)
    # Framing only splits: what came out and what is still buffered never exceed what went in.
    if framed + framer.buffered > len(body):
        raise AssertionError(f"framer produced {framed} + {framer.buffered} bytes from {len(body)}")


_AGENT_DIGEST = DigestConfig(realm="ttg", username="trunk", password="secret", secret=b"k" * 32)


def sip_agent(data: bytes) -> None:
    # A fresh agent per input keeps inputs independent (libFuzzer needs reproducible crashes).
    digest = _AGENT_DIGEST if data[:1] == b"A" else None
    ua = UserAgent(AgentConfig(host="127.0.0.1", port=5060, digest=digest))
    flows = (Flow("udp", ("127.0.0.1", 5070)), Flow("tcp", ("127.0.0.1", 5071), conn_id=1))
    now = 0.0
    for part in data.split(b"\x00\x00\x00"):
        for flow in flows:
            ua.receive(part, flow, now)
            now += 0.01
    for _ in range(4):
        deadline = ua.next_deadline()
        if deadline is None:
            break
        ua.handle_timer(deadline)


# --- SDP -------------------------------------------------------------------------------------------


def sdp(data: bytes) -> None:
    offer = parse_sdp(data)
    negotiate(offer, codecs=("PCMU", "PCMA"), max_streams=2)


# --- RTP / RTCP / DTMF -----------------------------------------------------------------------------

_PLAN = MediaPlan(
    index=0,
    codec="PCMU",
    payload_type=0,
    remote_host="127.0.0.1",
    remote_port=6000,
    remote_rtcp_port=6001,
    dtmf_payload_type=101,
    cn_payload_type=13,
)


def rtp(data: bytes) -> None:
    for parse in (parse_rtp, parse_rtcp):
        with contextlib.suppress(RtpParseError):
            parse(data)
    is_stun(data)


def media(data: bytes) -> None:
    # The media core over a sequence of datagrams, some from a second address, with time advancing:
    # no datagram may raise, whatever it holds.
    core = MediaCore(_PLAN, MediaConfig(), 0.0)
    now = 0.0
    for i, part in enumerate(data.split(b"\xff\xfe")):
        addr = ("127.0.0.1", 6000) if i % 5 != 4 else ("127.0.0.2", 7000)
        core.datagram(part, addr, now)
        now += 0.02 * (1 + (part[-1] % 200 if part else 0))
        deadline = core.next_deadline()
        if deadline is not None and deadline <= now:
            core.handle_timer(now)
    core.close(now)


_EVENT = struct.Struct("!IBBH")  # timestamp, event, E|R|volume, duration


def dtmf(data: bytes) -> None:
    with contextlib.suppress(ValueError):
        TelephoneEvent.parse(data)
    decoder = DtmfDecoder()
    now = 0.0
    for off in range(0, len(data) - _EVENT.size + 1, _EVENT.size):
        ts, event, flags, duration = _EVENT.unpack_from(data, off)
        ev = TelephoneEvent.parse(struct.pack("!BBH", event, flags, duration))
        decoder.packet(ts, ts, ev, now)
        now += 0.05
        decoder.handle_timer(now)
    decoder.finish()


# --- seeds -----------------------------------------------------------------------------------------

_OFFER = (
    b"v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
    b"m=audio 6000 RTP/AVP 0 8 101 13\r\na=rtpmap:101 telephone-event/8000\r\na=fmtp:101 0-15\r\n"
    b"a=ptime:20\r\na=sendrecv\r\n"
)


def _sip(method: str, extra: Iterable[str] = (), body: bytes = b"", cseq: int = 1, to_tag: str = "") -> bytes:
    lines = [
        f"{method} sip:1000@127.0.0.1:5060 SIP/2.0",
        "Via: SIP/2.0/UDP 127.0.0.1:5070;branch=z9hG4bK-seed;rport",
        "Max-Forwards: 70",
        'From: "Alice" <sip:alice@127.0.0.1:5070>;tag=a1',
        "To: <sip:1000@127.0.0.1:5060>" + (f";tag={to_tag}" if to_tag else ""),
        "Call-ID: seed@127.0.0.1",
        f"CSeq: {cseq} {method}",
        "Contact: <sip:alice@127.0.0.1:5070>",
        *extra,
    ]
    if body:
        lines.append("Content-Type: application/sdp")
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def sip_seeds() -> list[bytes]:
    return [
        _sip("INVITE", ["Record-Route: <sip:10.0.0.1;lr>"], _OFFER),
        _sip("OPTIONS"),
        _sip("BYE", cseq=2, to_tag="b2"),
        _sip("ACK", to_tag="b2"),
        _sip("CANCEL"),
        b"SIP/2.0 200 OK\r\nVia: SIP/2.0/UDP 127.0.0.1:5060;branch=z9hG4bK1\r\nFrom: <sip:a@b>;tag=1\r\n"
        b"To: <sip:c@d>;tag=2\r\nCall-ID: x\r\nCSeq: 2 BYE\r\nContent-Length: 0\r\n\r\n",
        _sip("INVITE", ['Authorization: Digest username="trunk", realm="ttg", nonce="x", response="0"']),
    ]


def framer_seeds() -> list[bytes]:
    return [b"\x05" + _sip("OPTIONS") + b"\r\n\r\n" + _sip("INVITE", body=_OFFER)]


def agent_seeds() -> list[bytes]:
    invite = _sip("INVITE", ["Record-Route: <sip:10.0.0.1;lr>"], _OFFER)
    return [invite, b"A" + invite, invite + b"\x00\x00\x00" + _sip("BYE", cseq=2, to_tag="b2")]


def sdp_seeds() -> list[bytes]:
    hold = _OFFER.replace(b"a=sendrecv", b"a=sendonly").replace(b"IP4 127.0.0.1\r\nt", b"IP4 0.0.0.0\r\nt")
    return [_OFFER, hold]


def _rtp(seq: int, ts: int, pt: int = 0, payload: bytes = b"\xff" * 160, ssrc: int = 0x1234) -> bytes:
    return struct.pack("!BBHII", 0x80, pt, seq, ts, ssrc) + payload


_RR = struct.pack("!BBHI", 0x80, 201, 1, 0x1234)
_APP = struct.pack("!BBHI4s", 0x80, 204, 2, 0x1234, b"PING")
_STUN = struct.pack("!HHI12s", 0x0001, 0, 0x2112A442, b"\x00" * 12)


def rtp_seeds() -> list[bytes]:
    return [_rtp(1, 160), _rtp(7, 960, 101, struct.pack("!BBH", 5, 0x8A, 800)), _RR, _APP, _STUN]


def media_seeds() -> list[bytes]:
    stream = b"\xff\xfe".join(_rtp(i, 160 * i) for i in range(6))
    dtmf_pkt = _rtp(7, 960, 101, struct.pack("!BBH", 5, 0x8A, 800))
    return [b"\xff\xfe".join([stream, dtmf_pkt, _RR, _APP, _STUN, _rtp(8, 1120, ssrc=0x99)])]


def dtmf_seeds() -> list[bytes]:
    return [b"".join(_EVENT.pack(800, 5, flags, d) for flags, d in ((10, 160), (10, 320), (0x8A, 480)))]


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("sip", sip_message, (), sip_seeds, SIP_TOKENS),
        Target("framer", sip_framer, (FramingError,), framer_seeds, SIP_TOKENS),
        Target("agent", sip_agent, (), agent_seeds, (*SIP_TOKENS, b"\x00\x00\x00")),
        Target("sdp", sdp, (SdpError,), sdp_seeds, SDP_TOKENS),
        Target("rtp", rtp, (), rtp_seeds),
        Target("dtmf", dtmf, (), dtmf_seeds),
        Target("media", media, (), media_seeds),
    )
}


def check(target: Target, data: bytes) -> None:
    """Run one input; the target's own errors are fine, anything else propagates."""
    with contextlib.suppress(*target.allowed):
        target.run(data)


def run_inputs(target: Target, inputs: Iterable[bytes]) -> int:
    n = 0
    for data in inputs:
        check(target, data)
        n += 1
    return n
