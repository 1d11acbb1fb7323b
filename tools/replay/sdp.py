"""SDP for the UAC (RFC 4566 syntax, RFC 3264 offer/answer): our offer, and reading the answer (pure)."""

from __future__ import annotations

from dataclasses import dataclass

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


def build_offer(
    ip: str, rtp_port: int, first_codec: str, ptime_ms: int, session_id: int, user: str = "replay"
) -> bytes:
    """Both G.711 laws (preferred one first) plus RFC 4733 telephone-event, as a PBX trunk offers."""
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
        "a=sendrecv",
        "",
    ]
    return "\r\n".join(lines).encode("ascii")


def parse_answer(body: bytes) -> MediaAnswer:
    """The first audio m-line of an answer. RFC 3264 §6: the answerer lists the formats it will use
    in the order it prefers; we send the first G.711 one. Port 0 means the stream was refused."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SdpError("SDP is not UTF-8") from exc
    session_host: str | None = None
    media_host: str | None = None
    port: int | None = None
    fmts: list[int] = []
    rtpmap: dict[int, str] = {}
    ptime: int | None = None
    direction = "sendrecv"
    in_audio = False
    seen_audio = False
    for raw in text.splitlines():
        line = raw.strip()
        if len(line) < 2 or line[1] != "=":
            continue
        kind, value = line[0], line[2:]
        if kind == "m":
            if seen_audio:
                in_audio = False
                continue
            parts = value.split()
            if len(parts) >= 4 and parts[0] == "audio":
                in_audio = seen_audio = True
                try:
                    port = int(parts[1].split("/")[0])
                    fmts = [int(p) for p in parts[3:]]
                except ValueError as exc:
                    raise SdpError(f"bad m-line {line!r}") from exc
            else:
                in_audio = False
        elif kind == "c":
            parts = value.split()
            if len(parts) < 3:
                raise SdpError(f"bad c-line {line!r}")
            host = parts[2].split("/")[0]
            if in_audio:
                media_host = host
            elif not seen_audio:
                session_host = host
        elif kind == "a" and (in_audio or not seen_audio):
            name, _, rest = value.partition(":")
            if name == "rtpmap" and in_audio:
                pt, _, enc = rest.partition(" ")
                if pt.strip().isdigit():
                    rtpmap[int(pt)] = enc.strip()
            elif name == "ptime" and rest.strip().isdigit():
                ptime = int(rest.strip())
            elif name in ("sendrecv", "sendonly", "recvonly", "inactive"):
                direction = name
    if port is None:
        raise SdpError("no audio m-line in the answer")
    if port == 0:
        raise SdpError("the answer refused the audio stream (port 0)")
    address = media_host or session_host
    if address is None:
        raise SdpError("no c-line for the audio stream")
    if direction in ("sendonly", "inactive"):
        raise SdpError(f"the answer does not let us send audio (a={direction})")

    def encoding(pt: int) -> str:
        if pt in rtpmap:
            return rtpmap[pt].split("/")[0].upper()
        return {0: "PCMU", 8: "PCMA"}.get(pt, "")

    codec_pt = next((pt for pt in fmts if encoding(pt) in STATIC_PT), None)
    if codec_pt is None:
        raise SdpError(f"the answer has no G.711 format (formats {fmts})")
    te = next((pt for pt in fmts if encoding(pt) == "TELEPHONE-EVENT"), None)
    return MediaAnswer(address, port, encoding(codec_pt), codec_pt, te, ptime, direction)
