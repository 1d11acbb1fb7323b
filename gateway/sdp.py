"""SDP (RFC 4566) parsing and the RFC 3264 offer/answer model for a receive-only G.711 endpoint.

Pure functions and frozen data; no I/O. The SIP side drives it:

    offer = parse_sdp(body)                          # SdpParseError (status_hint 400) on garbage
    negotiation = negotiate(offer, codecs=...)       # NegotiationError (status_hint 488) if nothing fits
    media = await manager.open(negotiation.accepted[0], sink, ...)   # gateway.rtp.receiver
    answer = answerer.answer(negotiation, [media.port])              # one SdpAnswerer per dialog

A re-INVITE repeats the last three steps with `media.update(plan)` instead of `open`; the answerer keeps
the o= session id and bumps the version only when the answer changes (RFC 3264 §8). When the peer sends
no SDP (delayed offer), `answerer.offer(ports)` makes ours and `negotiate_answer` reads theirs.

What we accept, per `m=audio` line with proto `RTP/AVP`: PCMU (static 0) or PCMA (static 8), or either
under a dynamic payload type with an rtpmap; `telephone-event/8000` (dynamic, rtpmap required) and CN
(static 13 or `CN/8000`). The audio codec is the first of the offer's formats that we support (RFC 3264
§6.1 lets the answerer choose; following the offerer's preference is what PBXs expect). Anything else in
the offer (video, T.38, SRTP profiles, extra audio streams beyond `max_streams`) is rejected with port 0.
"""

from __future__ import annotations

import ipaddress
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from gateway.addresses import is_unspecified

Direction = Literal["sendrecv", "sendonly", "recvonly", "inactive"]
Codec = Literal["PCMU", "PCMA"]

DIRECTIONS: frozenset[str] = frozenset({"sendrecv", "sendonly", "recvonly", "inactive"})
SUPPORTED_CODECS: tuple[Codec, ...] = ("PCMU", "PCMA")
# RFC 3551 §6 static payload types we can meet (Table 4): encoding name and clock rate.
STATIC_PAYLOAD_TYPES: dict[int, tuple[str, int]] = {0: ("PCMU", 8000), 8: ("PCMA", 8000), 13: ("CN", 8000)}
STATIC_PT_OF: dict[str, int] = {"PCMU": 0, "PCMA": 8}
CLOCK_RATE = 8000
PTIME_MIN_MS = 10
PTIME_MAX_MS = 60
DEFAULT_PTIME_MS = 20
# DTMF events we report (RFC 4733 §3.2: 0-9, *, #, A-D); the answer advertises exactly these.
DTMF_EVENTS_FMTP = "0-15"

# Bounds that make garbage fail fast instead of costing time (a real offer is < 4 KiB, SIPREC ~3 KiB).
MAX_SDP_BYTES = 65536
MAX_MEDIA = 32
MAX_LINES = 2048

# RFC 4566 §5: "An SDP parser MUST completely ignore any session description that contains a type
# letter that it does not understand." So an unknown letter is a parse error, not a skipped line.
_SESSION_TYPES = frozenset("vosiuepcbtrzkam")
_MEDIA_TYPES = frozenset("icbka")
_TOKEN = re.compile(r"[!#$%&'*+\-.0-9A-Z^_`a-z{|}~]+")


class SdpError(ValueError):
    """An SDP the gateway cannot use. `status_hint` is the SIP response the dialog layer should send."""

    status_hint: int = 400
    # RFC 3261 §20.43 warn-code for a Warning header (399 = miscellaneous).
    warn_code: int = 399


class SdpParseError(SdpError):
    """Malformed SDP (RFC 4566 grammar): answer 400 Bad Request (or 488 if the dialog layer prefers)."""


class NegotiationError(SdpError):
    """Well-formed SDP but no stream we can receive: 488 Not Acceptable Here (RFC 3261 §21.4.26)."""

    status_hint = 488
    warn_code = 305  # "Incompatible media format"


# --- the parsed description -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Origin:
    """o=<username> <sess-id> <sess-version> <nettype> <addrtype> <unicast-address> (RFC 4566 §5.2)."""

    username: str
    session_id: str
    session_version: int
    nettype: str
    addrtype: str
    address: str

    def __str__(self) -> str:
        return (
            f"{self.username} {self.session_id} {self.session_version} "
            f"{self.nettype} {self.addrtype} {self.address}"
        )


@dataclass(frozen=True, slots=True)
class Connection:
    """c=<nettype> <addrtype> <connection-address> (RFC 4566 §5.7); `address` without /ttl or /count."""

    nettype: str
    addrtype: str
    address: str
    suffix: str = ""  # "/127" or "/127/3" for multicast; kept so a parsed SDP serializes back unchanged

    @property
    def is_null(self) -> bool:
        """RFC 3264 §8.4: c=0.0.0.0 (any spelling of the unspecified address) is the RFC 2543 way to
        put a stream on hold."""
        return is_unspecified(self.address)

    @property
    def is_multicast(self) -> bool:
        try:
            return ipaddress.ip_address(self.address).is_multicast
        except ValueError:
            return False  # an FQDN: never resolved here (DESIGN: the gateway does not resolve names)

    def __str__(self) -> str:
        return f"{self.nettype} {self.addrtype} {self.address}{self.suffix}"


Attribute = tuple[str, str | None]  # (name, value); value None for a property attribute like a=recvonly


@dataclass(frozen=True, slots=True)
class MediaDescription:
    """One m= section (RFC 4566 §5.14) with its own c=, b= and a= lines."""

    media: str
    port: int
    port_count: int | None
    proto: str
    formats: tuple[str, ...]
    connection: Connection | None = None
    bandwidths: tuple[str, ...] = ()
    attributes: tuple[Attribute, ...] = ()
    info: str | None = None

    def attribute(self, name: str) -> str | None:
        """Value of the first a=<name>:<value> (None when absent or a property attribute)."""
        for key, value in self.attributes:
            if key == name:
                return value
        return None

    def has_attribute(self, name: str) -> bool:
        return any(key == name for key, _ in self.attributes)

    def attribute_values(self, name: str) -> list[str]:
        return [value for key, value in self.attributes if key == name and value is not None]

    @property
    def direction(self) -> Direction | None:
        """The media-level direction attribute, if any (the session-level one is the default)."""
        for key, _ in self.attributes:
            if key in DIRECTIONS:
                return key  # type: ignore[return-value]
        return None


@dataclass(frozen=True, slots=True)
class SessionDescription:
    version: int
    origin: Origin
    session_name: str
    connection: Connection | None = None
    timing: tuple[str, ...] = ("0 0",)  # t= values; RFC 3264 §6: the answer's t= equals the offer's
    attributes: tuple[Attribute, ...] = ()
    media: tuple[MediaDescription, ...] = ()
    # Session-level lines we keep but do not interpret (i=, u=, e=, p=, b=, r=, z=, k=), as (letter, value).
    other: tuple[tuple[str, str], ...] = ()

    def direction_of(self, m: MediaDescription) -> Direction:
        """RFC 3264 §5.1: a media-level direction overrides the session-level one; default sendrecv."""
        direction = m.direction
        if direction is not None:
            return direction
        for key, _ in self.attributes:
            if key in DIRECTIONS:
                return key  # type: ignore[return-value]
        return "sendrecv"

    def connection_of(self, m: MediaDescription) -> Connection | None:
        """RFC 4566 §5.7: the media-level c= wins over the session-level one."""
        return m.connection if m.connection is not None else self.connection

    def serialize(self) -> str:
        lines = [f"v={self.version}", f"o={self.origin}", f"s={self.session_name}"]
        order = "iuep"
        lines += [f"{k}={v}" for letter in order for k, v in self.other if k == letter]
        if self.connection is not None:
            lines.append(f"c={self.connection}")
        lines += [f"b={v}" for k, v in self.other if k == "b"]
        for t in self.timing:
            lines.append(f"t={t}")
        lines += [f"{k}={v}" for letter in "rzk" for k, v in self.other if k == letter]
        lines += [_attr_line(a) for a in self.attributes]
        for m in self.media:
            fmt = " ".join(m.formats)
            port = f"{m.port}/{m.port_count}" if m.port_count is not None else str(m.port)
            lines.append(f"m={m.media} {port} {m.proto}" + (f" {fmt}" if fmt else ""))
            if m.info is not None:
                lines.append(f"i={m.info}")
            if m.connection is not None:
                lines.append(f"c={m.connection}")
            lines += [f"b={b}" for b in m.bandwidths]
            lines += [_attr_line(a) for a in m.attributes]
        return "\r\n".join(lines) + "\r\n"

    def __str__(self) -> str:
        return self.serialize()


def _attr_line(attr: Attribute) -> str:
    name, value = attr
    return f"a={name}" if value is None else f"a={name}:{value}"


# --- parsing --------------------------------------------------------------------------------------


def parse_sdp(data: str | bytes) -> SessionDescription:
    """Parse an SDP body strictly enough to reject garbage with a message naming the line.

    Accepts CRLF or bare LF line ends and a missing final line end (some stacks drop it, and losing the
    last a= line is a known interop bug). Rejects: non-UTF-8 bytes, a first line other than v=0, a
    missing o=/s=/t=, unknown type letters (RFC 4566 §5), malformed o=/c=/m= lines, bad ports.
    """
    if isinstance(data, bytes | bytearray | memoryview):
        if len(data) > MAX_SDP_BYTES:
            raise SdpParseError(f"SDP body is {len(data)} bytes (limit {MAX_SDP_BYTES})")
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SdpParseError(f"SDP is not UTF-8 (byte {exc.start})") from None
    else:
        text = data
        if len(text) > MAX_SDP_BYTES:
            raise SdpParseError(f"SDP body is {len(text)} characters (limit {MAX_SDP_BYTES})")
    raw_lines = text.replace("\r\n", "\n").split("\n")
    while raw_lines and raw_lines[-1] == "":
        raw_lines.pop()
    if not raw_lines:
        raise SdpParseError("empty SDP body")
    if len(raw_lines) > MAX_LINES:
        raise SdpParseError(f"SDP has {len(raw_lines)} lines (limit {MAX_LINES})")

    version: int | None = None
    origin: Origin | None = None
    session_name: str | None = None
    connection: Connection | None = None
    timing: list[str] = []
    attributes: list[Attribute] = []
    other: list[tuple[str, str]] = []
    media: list[_MediaBuilder] = []

    for lineno, line in enumerate(raw_lines, 1):
        if len(line) < 2 or line[1] != "=":
            raise SdpParseError(f"line {lineno}: expected '<type>=<value>', got {line[:40]!r}")
        kind, value = line[0], line[2:]
        if "\r" in value or "\x00" in value:
            raise SdpParseError(f"line {lineno}: control character in value")
        if lineno == 1:
            if kind != "v":
                raise SdpParseError("first line must be v=0 (RFC 4566 §5)")
            if value != "0":
                raise SdpParseError(f"unsupported SDP version v={value[:20]}")
            version = 0
            continue
        if kind not in _SESSION_TYPES:
            raise SdpParseError(f"line {lineno}: unknown type letter {kind!r} (RFC 4566 §5)")
        if kind == "m":
            if len(media) >= MAX_MEDIA:
                raise SdpParseError(f"more than {MAX_MEDIA} m= lines")
            media.append(_parse_media_line(value, lineno))
            continue
        if media:
            # Inside a media section only i= c= b= k= a= may appear.
            if kind not in _MEDIA_TYPES:
                raise SdpParseError(f"line {lineno}: {kind}= is not allowed after an m= line")
            current = media[-1]
            if kind == "c":
                if current.connection is None:  # further c= lines are multicast layers; the first wins
                    current.connection = _parse_connection(value, lineno)
            elif kind == "a":
                current.attributes.append(_parse_attribute(value, lineno))
            elif kind == "b":
                current.bandwidths.append(value)
            elif kind == "i":
                current.info = value
            continue
        if kind == "v":
            raise SdpParseError(f"line {lineno}: repeated v= line")
        if kind == "o":
            if origin is not None:
                raise SdpParseError(f"line {lineno}: repeated o= line")
            origin = _parse_origin(value, lineno)
        elif kind == "s":
            if session_name is not None:
                raise SdpParseError(f"line {lineno}: repeated s= line")
            session_name = value
        elif kind == "c":
            if connection is not None:
                raise SdpParseError(f"line {lineno}: repeated session-level c= line")
            connection = _parse_connection(value, lineno)
        elif kind == "t":
            if not re.fullmatch(r"\d+ \d+", value):
                raise SdpParseError(f"line {lineno}: malformed t= line {value[:40]!r}")
            timing.append(value)
        elif kind == "a":
            attributes.append(_parse_attribute(value, lineno))
        else:
            other.append((kind, value))

    if version is None:  # pragma: no cover - the first-line check covers it
        raise SdpParseError("missing v= line")
    if origin is None:
        raise SdpParseError("missing o= line (RFC 4566 §5.2)")
    if session_name is None:
        raise SdpParseError("missing s= line (RFC 4566 §5.3)")
    if not timing:
        raise SdpParseError("missing t= line (RFC 4566 §5.9)")
    return SessionDescription(
        version=version,
        origin=origin,
        session_name=session_name,
        connection=connection,
        timing=tuple(timing),
        attributes=tuple(attributes),
        media=tuple(m.build() for m in media),
        other=tuple(other),
    )


@dataclass(slots=True)
class _MediaBuilder:
    media: str
    port: int
    port_count: int | None
    proto: str
    formats: tuple[str, ...]
    connection: Connection | None = None
    bandwidths: list[str] = field(default_factory=list)
    attributes: list[Attribute] = field(default_factory=list)
    info: str | None = None

    def build(self) -> MediaDescription:
        return MediaDescription(
            media=self.media,
            port=self.port,
            port_count=self.port_count,
            proto=self.proto,
            formats=self.formats,
            connection=self.connection,
            bandwidths=tuple(self.bandwidths),
            attributes=tuple(self.attributes),
            info=self.info,
        )


def _parse_origin(value: str, lineno: int) -> Origin:
    parts = value.split(" ")
    if len(parts) != 6 or not all(parts):
        raise SdpParseError(f"line {lineno}: o= needs 6 fields, got {value[:60]!r}")
    username, sess_id, sess_version, nettype, addrtype, address = parts
    if not sess_id.isdigit() or not sess_version.isdigit():
        raise SdpParseError(f"line {lineno}: o= session id and version must be numeric")
    if len(sess_version) > 20:
        raise SdpParseError(f"line {lineno}: o= version too long")
    return Origin(username, sess_id, int(sess_version), nettype, addrtype, address)


def _parse_connection(value: str, lineno: int) -> Connection:
    parts = value.split(" ")
    if len(parts) != 3 or not all(parts):
        raise SdpParseError(f"line {lineno}: c= needs 3 fields, got {value[:60]!r}")
    nettype, addrtype, address = parts
    if nettype != "IN":
        raise SdpParseError(f"line {lineno}: unsupported network type {nettype[:10]!r}")
    if addrtype not in ("IP4", "IP6"):
        raise SdpParseError(f"line {lineno}: unsupported address type {addrtype[:10]!r}")
    host, slash, suffix = address.partition("/")
    if not host:
        raise SdpParseError(f"line {lineno}: empty connection address")
    return Connection(nettype, addrtype, host, slash + suffix)


def _parse_media_line(value: str, lineno: int) -> _MediaBuilder:
    parts = value.split(" ")
    if len(parts) < 3 or not all(parts):
        raise SdpParseError(f"line {lineno}: m= needs '<media> <port> <proto> <fmt> ...', got {value[:60]!r}")
    media, port_text, proto, *formats = parts
    if not _TOKEN.fullmatch(media):
        raise SdpParseError(f"line {lineno}: bad media type {media[:20]!r}")
    port_str, slash, count_str = port_text.partition("/")
    if not port_str.isdigit() or int(port_str) > 65535 or (slash and not count_str.isdigit()):
        raise SdpParseError(f"line {lineno}: bad port {port_text[:20]!r}")
    port = int(port_str)
    count = int(count_str) if slash else None
    if not formats and port != 0:
        raise SdpParseError(f"line {lineno}: m= line lists no formats")
    return _MediaBuilder(media, port, count, proto, tuple(formats))


def _parse_attribute(value: str, lineno: int) -> Attribute:
    name, colon, rest = value.partition(":")
    if not _TOKEN.fullmatch(name):
        raise SdpParseError(f"line {lineno}: bad attribute name {name[:30]!r}")
    return (name, rest if colon else None)


# --- negotiation ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MediaPlan:
    """What one accepted audio stream carries: everything the RTP receiver needs, nothing SIP-specific.

    `direction` is the offerer's view (what they will do); `on_hold` is sendonly/inactive or c=0.0.0.0;
    `media_expected` says whether RTP should flow to us at all, which decides which inactivity timeout
    applies and whether we answer recvonly or inactive.
    """

    index: int  # the m= line in the offer (0-based)
    codec: Codec
    payload_type: int
    remote_host: str
    remote_port: int
    remote_rtcp_port: int
    dtmf_payload_type: int | None = None
    cn_payload_type: int | None = None
    ptime_ms: int = DEFAULT_PTIME_MS
    clock_rate: int = CLOCK_RATE
    rtcp_mux: bool = False
    direction: Direction = "sendrecv"
    on_hold: bool = False
    label: str | None = None  # SIPREC a=label, echoed in the answer

    @property
    def media_expected(self) -> bool:
        return self.direction in ("sendrecv", "sendonly") and not is_unspecified(self.remote_host)

    @property
    def payload_types(self) -> tuple[int, ...]:
        return tuple(
            pt for pt in (self.payload_type, self.cn_payload_type, self.dtmf_payload_type) if pt is not None
        )


@dataclass(frozen=True, slots=True)
class Negotiation:
    """The outcome for every offered m= line: a plan, or a rejection with the reason."""

    offer: SessionDescription
    plans: tuple[MediaPlan | None, ...]
    reasons: tuple[str | None, ...]

    @property
    def accepted(self) -> tuple[MediaPlan, ...]:
        return tuple(p for p in self.plans if p is not None)


@dataclass(frozen=True, slots=True)
class RtpMap:
    encoding: str  # upper-cased
    clock_rate: int
    channels: int = 1


def rtpmaps(m: MediaDescription) -> dict[int, RtpMap]:
    """a=rtpmap:<pt> <encoding>/<clock>[/<channels>] for every payload type that has one."""
    out: dict[int, RtpMap] = {}
    for value in m.attribute_values("rtpmap"):
        match = re.fullmatch(r"(\d{1,3}) +([^/\s]+)/(\d+)(?:/(\d+))?\s*", value)
        if match is None:
            continue  # a broken rtpmap only matters if it is for a format we would pick (then: no mapping)
        pt = int(match.group(1))
        if pt <= 127 and pt not in out:
            out[pt] = RtpMap(match.group(2).upper(), int(match.group(3)), int(match.group(4) or 1))
    return out


def negotiate(
    offer: SessionDescription,
    *,
    codecs: Sequence[str] = SUPPORTED_CODECS,
    max_streams: int = 1,
    default_ptime_ms: int = DEFAULT_PTIME_MS,
    recording: bool = False,
) -> Negotiation:
    """RFC 3264 §6: decide, for each offered m= line, whether we receive it and with what.

    `codecs` is the operator's allow list (subset of PCMU/PCMA); the offerer's order picks among them.
    `max_streams` caps accepted audio streams (1 for a trunk call; SIPREC offers one per leg): the first
    `max_streams` acceptable m= lines are taken, the rest answered with port 0.
    `recording`: the offer is a SIPREC recording session (RFC 7866), whose streams are `sendonly`
    by design, so `sendonly` is not hold there (only `inactive` or c=0.0.0.0 is).
    Raises NegotiationError when no stream is acceptable: the SIP side answers 488.
    """
    allowed = {c.upper() for c in codecs}
    unknown = allowed - set(SUPPORTED_CODECS)
    if unknown:
        raise ValueError(f"unsupported codecs in the allow list: {sorted(unknown)}")
    plans: list[MediaPlan | None] = []
    reasons: list[str | None] = []
    for index, m in enumerate(offer.media):
        plan, reason = _negotiate_stream(offer, index, m, allowed, default_ptime_ms, recording)
        if plan is not None and sum(p is not None for p in plans) >= max_streams:
            plan, reason = None, f"only {max_streams} audio stream(s) accepted"
        plans.append(plan)
        reasons.append(reason)
    if not any(p is not None for p in plans):
        why = "; ".join(f"m[{i}] {r}" for i, r in enumerate(reasons) if r) or "no m= lines"
        if len(why) > 300:
            why = why[:297] + "..."
        raise NegotiationError(f"no acceptable audio stream: {why}")
    return Negotiation(offer=offer, plans=tuple(plans), reasons=tuple(reasons))


def negotiate_answer(
    our_offer: SessionDescription,
    answer: SessionDescription,
    *,
    codecs: Sequence[str] = SUPPORTED_CODECS,
    max_streams: int = 1,
    default_ptime_ms: int = DEFAULT_PTIME_MS,
) -> Negotiation:
    """The peer's answer to an offer we made (`SdpAnswerer.offer`: INVITE or re-INVITE without SDP,
    answer in the ACK). RFC 3264 §6: "the answer MUST contain exactly the same number of m= lines as
    the offer". The answer's `sendonly` is the normal case here (we offered `recvonly`), so only
    `inactive` or c=0.0.0.0 puts a stream on hold."""
    if len(answer.media) != len(our_offer.media):
        raise NegotiationError(
            f"answer has {len(answer.media)} m= line(s), our offer had {len(our_offer.media)} (RFC 3264 §6)"
        )
    neg = negotiate(answer, codecs=codecs, max_streams=max_streams, default_ptime_ms=default_ptime_ms)
    plans = tuple(
        None if p is None else replace(p, on_hold=p.direction == "inactive" or is_unspecified(p.remote_host))
        for p in neg.plans
    )
    return replace(neg, plans=plans)


def _negotiate_stream(
    offer: SessionDescription,
    index: int,
    m: MediaDescription,
    allowed: set[str],
    default_ptime_ms: int,
    recording: bool = False,
) -> tuple[MediaPlan | None, str | None]:
    if m.media != "audio":
        return None, f"media {m.media!r} not supported"
    if m.port == 0:
        return None, "stream disabled by the offerer (port 0)"
    if m.proto != "RTP/AVP":
        # SRTP (RTP/SAVP, RTP/SAVPF, UDP/TLS/RTP/SAVPF) needs keys we do not handle; AVPF needs feedback.
        return None, f"transport {m.proto!r} not supported (RTP/AVP only)"
    if m.port_count not in (None, 1):
        return None, "layered encoding (port count) not supported"
    conn = offer.connection_of(m)
    if conn is None:
        return None, "no c= line for the stream (RFC 4566 §5.7)"
    if conn.is_multicast:
        return None, "multicast media not supported"

    maps = rtpmaps(m)
    codec: Codec | None = None
    pt_audio = pt_dtmf = pt_cn = None
    for fmt in m.formats:
        if not fmt.isdigit() or int(fmt) > 127:
            return None, f"format {fmt[:10]!r} is not an RTP payload type"
        pt = int(fmt)
        # Static payload types need no rtpmap (RFC 3551 §6); an explicit rtpmap wins if present.
        mapping = maps.get(pt)
        if mapping is None and pt in STATIC_PAYLOAD_TYPES:
            name, rate = STATIC_PAYLOAD_TYPES[pt]
            mapping = RtpMap(name, rate)
        if mapping is None or mapping.clock_rate != CLOCK_RATE or mapping.channels != 1:
            continue
        if mapping.encoding in allowed and codec is None:
            codec, pt_audio = mapping.encoding, pt  # type: ignore[assignment]
        elif mapping.encoding == "TELEPHONE-EVENT" and pt_dtmf is None:
            pt_dtmf = pt
        elif mapping.encoding == "CN" and pt_cn is None:
            pt_cn = pt
    if codec is None or pt_audio is None:
        offered = ",".join(m.formats[:8])
        return None, f"no common codec (offered {offered}, we accept {'/'.join(sorted(allowed))})"

    ptime = default_ptime_ms
    ptime_text = m.attribute("ptime")
    if ptime_text is None:
        ptime_text = next((v for k, v in offer.attributes if k == "ptime"), None)
    if ptime_text is not None:
        try:
            offered_ptime = round(float(ptime_text))
        except ValueError:
            offered_ptime = 0
        # Honour a ptime in range; do not depend on it (the receiver sizes frames from timestamps).
        if PTIME_MIN_MS <= offered_ptime <= PTIME_MAX_MS:
            ptime = offered_ptime

    rtcp_mux = m.has_attribute("rtcp-mux")
    rtcp_port = m.port if rtcp_mux else m.port + 1
    rtcp_attr = m.attribute("rtcp")  # RFC 3605: a=rtcp:<port> [IN IP4 <addr>]
    if rtcp_attr is not None and not rtcp_mux:
        head = rtcp_attr.split(" ", 1)[0]
        if head.isdigit() and 0 < int(head) <= 65535:
            rtcp_port = int(head)

    direction = offer.direction_of(m)
    # RFC 7866: an SRC offers the streams it records sendonly; for a trunk call sendonly is hold.
    hold_directions = ("inactive",) if recording else ("sendonly", "inactive")
    on_hold = direction in hold_directions or conn.is_null
    plan = MediaPlan(
        index=index,
        codec=codec,
        payload_type=pt_audio,
        remote_host=conn.address,
        remote_port=m.port,
        remote_rtcp_port=rtcp_port,
        dtmf_payload_type=pt_dtmf,
        cn_payload_type=pt_cn,
        ptime_ms=ptime,
        rtcp_mux=rtcp_mux,
        direction=direction,
        on_hold=on_hold,
        label=m.attribute("label"),
    )
    return plan, None


def answer_direction(plan: MediaPlan) -> Direction:
    """Our direction for a stream we only ever receive (RFC 3264 §6.1).

    "If a media stream is listed as sendonly in the offer, the answer MUST list it as recvonly or
    inactive. If it is listed as recvonly, the answer MUST list it as sendonly or inactive. If it is
    listed as sendrecv, the answer MAY list it as sendrecv, sendonly, recvonly or inactive. If it is
    listed as inactive, the answer MUST list it as inactive."  We never send, so recvonly when the
    offerer sends (sendrecv/sendonly, hold with music included), inactive otherwise (recvonly/inactive
    offers and c=0.0.0.0 holds, where the offerer will not send either).
    """
    if plan.media_expected:
        return "recvonly"
    return "inactive"


# --- answers --------------------------------------------------------------------------------------


def _addrtype(address: str) -> str:
    try:
        return "IP6" if ipaddress.ip_address(address).version == 6 else "IP4"
    except ValueError:
        return "IP4"  # an FQDN; RFC 4566 allows it and IP4 is the usual label


class SdpAnswerer:
    """Builds the SDP answers of one dialog.

    RFC 3264 §8: "the 'o=' line of the new SDP MUST be identical to that in the previous SDP, except
    that the version in the origin field MUST increment by one from the previous SDP. If the version in
    the origin line does not increment, the SDP MUST be identical to the SDP with that version number."
    So the session id is fixed per dialog, and the version moves only when the body changes (a session
    refresh re-INVITE gets the same answer, same version).
    """

    def __init__(
        self,
        address: str,
        *,
        username: str = "ttg",
        session_name: str = "ttg",
        session_id: int | None = None,
    ) -> None:
        self.address = address
        self.username = username
        self.session_name = session_name
        self.session_id = session_id if session_id is not None else secrets.randbelow(2**62) + 1
        self.version = 0
        self._last: SessionDescription | None = None

    def answer(self, negotiation: Negotiation, ports: Sequence[int]) -> str:
        """The answer text; `ports[i]` is our RTP port for `negotiation.accepted[i]`."""
        return self.answer_description(negotiation, ports).serialize()

    def answer_description(self, negotiation: Negotiation, ports: Sequence[int]) -> SessionDescription:
        accepted = negotiation.accepted
        if len(ports) != len(accepted):
            raise ValueError(f"{len(accepted)} accepted stream(s) but {len(ports)} port(s) given")
        port_of = {plan.index: port for plan, port in zip(accepted, ports, strict=True)}
        offer = negotiation.offer
        media: list[MediaDescription] = []
        for index, (m, plan) in enumerate(zip(offer.media, negotiation.plans, strict=True)):
            if plan is None:
                # RFC 3264 §6: "To reject an offered stream, the port number in the corresponding stream
                # in the answer MUST be set to zero. Any media formats listed are ignored. At least one
                # MUST be present".
                formats = m.formats or ("0",)
                media.append(MediaDescription(m.media, 0, None, m.proto, formats))
                continue
            media.append(self._answer_stream(plan, port_of[index]))
        return self._stamp(tuple(media), offer.timing[:1] or ("0 0",))

    def offer(
        self,
        ports: Sequence[int],
        *,
        codecs: Sequence[str] = SUPPORTED_CODECS,
        ptime_ms: int = DEFAULT_PTIME_MS,
        dtmf_payload_type: int = 101,
    ) -> str:
        """Our offer when the peer sent none (RFC 3261 §13.2.1 delayed offer; a re-INVITE without a body):
        one recvonly audio stream per port with the allowed codecs, CN and telephone-event. The peer's
        answer goes to `negotiate_answer(parse_sdp(this), parse_sdp(answer))`."""
        formats: list[str] = []
        attrs: list[Attribute] = []
        for codec in codecs:
            pt = STATIC_PT_OF[codec.upper()]
            formats.append(str(pt))
            attrs.append(("rtpmap", f"{pt} {codec.upper()}/{CLOCK_RATE}"))
        formats += ["13", str(dtmf_payload_type)]
        attrs += [
            ("rtpmap", f"13 CN/{CLOCK_RATE}"),
            ("rtpmap", f"{dtmf_payload_type} telephone-event/{CLOCK_RATE}"),
            ("fmtp", f"{dtmf_payload_type} {DTMF_EVENTS_FMTP}"),
            ("ptime", str(ptime_ms)),
            ("recvonly", None),
        ]
        media = tuple(
            MediaDescription("audio", port, None, "RTP/AVP", tuple(formats), attributes=tuple(attrs))
            for port in ports
        )
        return self._stamp(media, ("0 0",)).serialize()

    def _stamp(self, media: tuple[MediaDescription, ...], timing: tuple[str, ...]) -> SessionDescription:
        """Our SDP with the o= line of this dialog: version +1 whenever the body changes (RFC 3264 §8)."""
        addrtype = _addrtype(self.address)
        desc = SessionDescription(
            version=0,
            origin=Origin(self.username, str(self.session_id), self.version, "IN", addrtype, self.address),
            session_name=self.session_name,
            connection=Connection("IN", addrtype, self.address),
            timing=timing,
            media=media,
        )
        if self._last is not None and replace(self._last, origin=desc.origin) != desc:
            self.version += 1
        desc = replace(desc, origin=replace(desc.origin, session_version=self.version))
        self._last = desc
        return desc

    @staticmethod
    def _answer_stream(plan: MediaPlan, port: int) -> MediaDescription:
        formats = [str(plan.payload_type)]
        attrs: list[Attribute] = [("rtpmap", f"{plan.payload_type} {plan.codec}/{plan.clock_rate}")]
        if plan.cn_payload_type is not None:
            formats.append(str(plan.cn_payload_type))
            attrs.append(("rtpmap", f"{plan.cn_payload_type} CN/{plan.clock_rate}"))
        if plan.dtmf_payload_type is not None:
            formats.append(str(plan.dtmf_payload_type))
            attrs.append(("rtpmap", f"{plan.dtmf_payload_type} telephone-event/{plan.clock_rate}"))
            attrs.append(("fmtp", f"{plan.dtmf_payload_type} {DTMF_EVENTS_FMTP}"))
        attrs.append(("ptime", str(plan.ptime_ms)))
        if plan.rtcp_mux:
            attrs.append(("rtcp-mux", None))  # RFC 5761 §5.1.1: the answerer agrees by echoing it
        if plan.label is not None:
            attrs.append(("label", plan.label))  # RFC 7866 §8.1.1 (SIPREC): labels are echoed
        attrs.append((answer_direction(plan), None))
        return MediaDescription("audio", port, None, "RTP/AVP", tuple(formats), attributes=tuple(attrs))


def same_offer_version(previous: SessionDescription, offer: SessionDescription) -> bool:
    """True when a re-offer repeats the previous o= line exactly (RFC 3264 §8: then the SDP is the same,
    e.g. a session-timer refresh), so the media need not be touched."""
    return previous.origin == offer.origin
