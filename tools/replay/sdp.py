"""SDP for the UAC (RFC 4566 syntax, RFC 3264 offer/answer): our offer, and reading the answer (pure)."""

from __future__ import annotations

from dataclasses import dataclass, field

STATIC_PT = {"PCMU": 0, "PCMA": 8}
TELEPHONE_EVENT_PT = 101


class SdpError(ValueError):
    """An answer the call cannot use (named in the message)."""


@dataclass(frozen=True, slots=True)
class MediaAnswer:
    """What the answerer accepted for our audio stream."""

    host: str
    port: int
    codec: str  # PCMU or PCMA
    payload_type: int
    telephone_event_pt: int | None
    ptime_ms: int | None
    direction: str
    label: str | None = None  # a=label (SIPREC: which recorded stream this is)


def build_offer(
    ip: str, rtp_port: int, first_codec: str, ptime_ms: int, session_id: int, user: str = "replay"
) -> bytes:
    """Both G.711 laws (preferred one first) plus RFC 4733 telephone-event, as a PBX trunk offers, and
    RTCP multiplexed on the RTP port (RFC 5761 §5.1.1), so the gateway's receiver reports come back to
    the one socket a call has."""
    codecs = [first_codec, *(c for c in STATIC_PT if c != first_codec)]
    pts = [STATIC_PT[c] for c in codecs]
    ipver = "IP6" if ":" in ip else "IP4"
    lines = [
        "v=0",
        f"o={user} {session_id} {session_id} IN {ipver} {ip}",
        "s=ttg replay",
        f"c=IN {ipver} {ip}",
        "t=0 0",
        f"m=audio {rtp_port} RTP/AVP {' '.join(map(str, pts))} {TELEPHONE_EVENT_PT}",
        *(f"a=rtpmap:{STATIC_PT[c]} {c}/8000" for c in codecs),
        f"a=rtpmap:{TELEPHONE_EVENT_PT} telephone-event/8000",
        f"a=fmtp:{TELEPHONE_EVENT_PT} 0-16",
        f"a=ptime:{ptime_ms}",
        "a=rtcp-mux",
        "a=sendrecv",
        "",
    ]
    return "\r\n".join(lines).encode("ascii")


def parse_answer(body: bytes) -> MediaAnswer:
    """The first audio m-line of an answer. RFC 3264 §6: the answerer lists the formats it will use
    in the order it prefers; we send the first G.711 one. Port 0 means the stream was refused."""
    answers = parse_answers(body)
    if not answers:
        raise SdpError("no audio m-line in the answer")
    first = answers[0]
    if isinstance(first, SdpError):
        raise first
    return first


def parse_answers(body: bytes) -> list[MediaAnswer | SdpError]:
    """Every audio m-line of an answer in order (RFC 3264 §6: one per offered m-line): what to send
    on it, or why nothing can be (refused with port 0, no G.711, a direction that forbids sending)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SdpError("SDP is not UTF-8") from exc
    session_host: str | None = None
    session = _Section(audio=False)  # session-level ptime and direction
    sections: list[_Section] = []
    for raw in text.splitlines():
        line = raw.strip()
        if len(line) < 2 or line[1] != "=":
            continue
        kind, value = line[0], line[2:]
        current = sections[-1] if sections else None
        if kind == "m":
            parts = value.split()
            section = _Section(audio=len(parts) >= 4 and parts[0] == "audio")
            if section.audio:
                try:
                    section.port = int(parts[1].split("/")[0])
                    section.fmts = [int(p) for p in parts[3:]]
                except ValueError as exc:
                    raise SdpError(f"bad m-line {line!r}") from exc
            sections.append(section)
        elif kind == "c":
            parts = value.split()
            if len(parts) < 3:
                raise SdpError(f"bad c-line {line!r}")
            host = parts[2].split("/")[0]
            if current is not None:
                current.host = host
            else:
                session_host = host
        elif kind == "a":
            name, _, rest = value.partition(":")
            target = current if current is not None else session
            if name == "rtpmap" and current is not None:
                pt, _, enc = rest.partition(" ")
                if pt.strip().isdigit():
                    current.rtpmap[int(pt)] = enc.strip()
            elif name == "ptime" and rest.strip().isdigit():
                target.ptime = int(rest.strip())
            elif name == "label" and current is not None:
                current.label = rest.strip()
            elif name in ("sendrecv", "sendonly", "recvonly", "inactive"):
                target.direction = name
    # RFC 4566 §5.14 / RFC 3264 §5.1: session-level attributes are the defaults of every m= section.
    return [m.answer(session_host, session) for m in sections if m.audio]


@dataclass(slots=True)
class _Section:
    """One m= section of an answer while it is read."""

    audio: bool
    port: int = 0
    fmts: list[int] = field(default_factory=list)
    host: str | None = None
    rtpmap: dict[int, str] = field(default_factory=dict)
    ptime: int | None = None
    direction: str | None = None
    label: str | None = None

    def encoding(self, pt: int) -> str:
        if pt in self.rtpmap:
            return self.rtpmap[pt].split("/")[0].upper()
        return {0: "PCMU", 8: "PCMA"}.get(pt, "")

    def answer(self, session_host: str | None, session: _Section) -> MediaAnswer | SdpError:
        direction = self.direction or session.direction or "sendrecv"
        ptime = self.ptime if self.ptime is not None else session.ptime
        if self.port == 0:
            return SdpError("the answer refused the audio stream (port 0)")
        address = self.host or session_host
        if address is None:
            return SdpError("no c-line for the audio stream")
        if direction in ("sendonly", "inactive"):
            return SdpError(f"the answer does not let us send audio (a={direction})")
        codec_pt = next((pt for pt in self.fmts if self.encoding(pt) in STATIC_PT), None)
        if codec_pt is None:
            return SdpError(f"the answer has no G.711 format (formats {self.fmts})")
        te = next((pt for pt in self.fmts if self.encoding(pt) == "TELEPHONE-EVENT"), None)
        return MediaAnswer(
            address, self.port, self.encoding(codec_pt), codec_pt, te, ptime, direction, self.label
        )
