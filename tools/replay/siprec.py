"""SIPREC recording offers (RFC 7866 INVITE bodies with RFC 7865 metadata) shaped like real SRCs' (pure).

`ttg replay --siprec VENDOR` places recording sessions: one INVITE per call whose `multipart/mixed`
body holds an SDP offer with one `sendonly` m=audio per recorded leg and the recording metadata, then
one RTP stream per leg. Vendors' offers differ in ways an SRS must tolerate; each builder below
follows the shape documented in the project's research notes (telephony §1.2, from captures that SRS
projects ship as test data):

- cisco (CUBE): namespace `…:recording:1`, `participant_id`; `<participantstreamassoc>` with send and
  recv; labels 1/2; no roles; SDP part `session;handling=required`, a third part `application/gtd`
  (`signal;handling=optional`); c= in each m= section.
- oracle (Acme Packet): draft namespace `…:recording`, `id`/`session` attributes; `<send>` inside
  `<participant>`; labels 16777227…; roles from `<apkt:callingParty>`; UCID in `<extensiondata>`.
- avaya: draft namespace, `id`/`session`, `<send>` inside `<participant>`; labels 201835599…; no
  roles; leg 1 offers `PCMA G729 telephone-event`, leg 2 static PT 8 without an rtpmap.
- sonus (Ribbon): `tns:` prefix on the draft namespace; `<participantstreamassoc>`; the **caller
  sends label 2**; the original From/To in `<group><callData>` give the roles; AoRs without `sip:`.
- broadworks: `…:recording:1` with `dataMode`; `<participantstreamassoc>` send only; labels 10/20;
  PCMA + telephone-event 97; the session c= differs from o=.
- audiocodes, twilio, telnyx: RFC 7865 as written (send and recv); twilio labels inbound/outbound and
  no telephone-event (Twilio sends no DTMF); telnyx adds Session-Expires 90.
- opensips (its siprec module): `…:recording:1` in single quotes, `<participantstreamassoc>` with send
  and recv, numeric labels, boundary `OSS-unique-boundary-42`; caller from From, callee from To, no
  roles.

Each recorded stream carries the leg name the gateway should give it (docs/events.md): `caller`/
`callee` where the metadata has roles, else the sending participant's id.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

NS_RFC = "urn:ietf:params:xml:ns:recording:1"
NS_DRAFT = "urn:ietf:params:xml:ns:recording"
LEGS = 2  # every vendor shape records a two-party call: one stream per party
METADATA_PART = (
    ("Content-Type", "application/rs-metadata+xml"),
    ("Content-Disposition", "recording-session"),
)
SDP_PART = (("Content-Type", "application/sdp"),)


@dataclass(frozen=True, slots=True)
class Party:
    """A participant of the recorded call."""

    id: str
    user: str  # the AoR's user part (a number)
    name: str  # display name


@dataclass(frozen=True, slots=True)
class RecordedLeg:
    """One recorded stream of the offer: its m= line, who speaks on it, and the leg name expected."""

    index: int  # m= line
    label: str
    stream_id: str
    sender: Party
    expected_leg: str


@dataclass(frozen=True, slots=True)
class RecordingOffer:
    """What goes into the INVITE: body, its Content-Type, extra headers, and the legs it offers."""

    body: bytes
    content_type: str
    headers: tuple[tuple[str, str], ...]
    legs: tuple[RecordedLeg, ...]


@dataclass(frozen=True, slots=True)
class _Call:
    """The per-call inputs every builder gets."""

    index: int
    ip: str
    ports: tuple[int, ...]
    domain: str
    session_id: int

    @property
    def token(self) -> str:
        return f"{self.session_id:x}{self.index:06x}"

    @property
    def ipver(self) -> str:
        return "IP6" if ":" in self.ip else "IP4"

    def parties(self, prefix: str) -> tuple[Party, Party]:
        """The customer (who placed the call) and the agent."""
        return (
            Party(f"{prefix}{self.token}p0", f"+1555010{self.index % 10000:04d}", f"Customer {self.index}"),
            Party(f"{prefix}{self.token}p1", f"{7000 + self.index % 1000}", f"Agent {self.index}"),
        )

    def aor(self, p: Party, scheme: bool = True) -> str:
        return f"{'sip:' if scheme else ''}{p.user}@{self.domain}"

    def legs(
        self, parties: Sequence[Party], labels: Sequence[str], expected: Sequence[str]
    ) -> tuple[RecordedLeg, ...]:
        return tuple(
            RecordedLeg(i, label, f"st{self.token}{i}", parties[i], expected[i])
            for i, label in enumerate(labels)
        )


# --- SDP and MIME ---------------------------------------------------------------------------------------


def _sdp(
    c: _Call, origin: str, name: str, media: Sequence[str], *, per_media_c: bool, session_c: str = ""
) -> str:
    """One m=audio section per entry of `media` ("<formats>\\n<a= lines>"), on the call's ports."""
    head = ["v=0", f"o={origin} {c.session_id} {c.session_id} IN {c.ipver} {c.ip}", f"s={name}"]
    if not per_media_c:
        head.append(f"c=IN {c.ipver} {session_c or c.ip}")
    lines = [*head, "t=0 0"]
    for port, section in zip(c.ports, media, strict=True):
        formats, *attributes = section.strip().splitlines()
        lines.append(f"m=audio {port} RTP/AVP {formats}")
        if per_media_c:
            lines.append(f"c=IN {c.ipver} {c.ip}")
        lines += [f"a={a.strip()}" for a in attributes]
    return "\r\n".join(lines) + "\r\n"


def _multipart(boundary: str, parts: Sequence[tuple[Sequence[tuple[str, str]], str]]) -> bytes:
    chunks = []
    for headers, text in parts:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers)
        chunks.append(f"--{boundary}\r\n{head}\r\n{text.strip()}\r\n")
    return ("".join(chunks) + f"--{boundary}--\r\n").encode("utf-8")


def _document(root: str, parts: Sequence[str], end: str) -> str:
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + "\n".join([root, *parts, end])


def _name_id(c: _Call, p: Party, prefix: str = "", scheme: bool = True, lang: bool = True) -> str:
    lang_attr = ' xml:lang="en"' if lang else ""
    return (
        f"<{prefix}nameID aor={quoteattr(c.aor(p, scheme))}>"
        f"<{prefix}name{lang_attr}>{escape(p.name)}</{prefix}name></{prefix}nameID>"
    )


# --- vendors --------------------------------------------------------------------------------------------

_PCMU_TE = "0 101\nrtpmap:0 PCMU/8000\nrtpmap:101 telephone-event/8000\nfmtp:101 0-16\nptime:20"


def _rfc_document(c: _Call, legs: Sequence[RecordedLeg], *, recv: bool, datamode: str) -> str:
    """RFC 7865 §6: session, participants, streams, participantstreamassoc (send, and recv if asked)."""
    sid = f"s{c.token}"
    parts = [
        f"<{datamode}>complete</{datamode}>",
        f'<session session_id="{sid}"><sipSessionID>{c.token}</sipSessionID></session>',
    ]
    for leg in legs:
        parts.append(f'<participant participant_id="{leg.sender.id}">{_name_id(c, leg.sender)}</participant>')
        parts.append(
            f'<stream stream_id="{leg.stream_id}" session_id="{sid}"><label>{leg.label}</label></stream>'
        )
    for leg in legs:
        heard = "".join(f"<recv>{o.stream_id}</recv>" for o in legs if o is not leg) if recv else ""
        parts.append(
            f'<participantstreamassoc participant_id="{leg.sender.id}"><send>{leg.stream_id}</send>{heard}'
            "</participantstreamassoc>"
        )
    return _document(f'<recording xmlns="{NS_RFC}">', parts, "</recording>")


def cisco(c: _Call) -> RecordingOffer:
    parties = c.parties("kQ")
    legs = c.legs(parties, ["1", "2"], [p.id for p in parties])
    sdp = _sdp(
        c,
        "CiscoSystemsSIP-GW-UserAgent",
        "SIP Call",
        [f"{_PCMU_TE}\nsendonly\nlabel:{leg.label}" for leg in legs],
        per_media_c=True,
    )
    xml = _rfc_document(c, legs, recv=True, datamode="datamode")
    body = _multipart(
        "uniqueBoundary",
        [
            (
                (("Content-Disposition", "session;handling=required"), ("Content-Type", "application/sdp")),
                sdp,
            ),
            (METADATA_PART[::-1], xml),
            (
                (("Content-Disposition", "signal;handling=optional"), ("Content-Type", "application/gtd")),
                f"IAM,\r\nGCI,{c.token}",
            ),
        ],
    )
    return RecordingOffer(body, "multipart/mixed;boundary=uniqueBoundary", (), legs)


def _draft_document(c: _Call, legs: Sequence[RecordedLeg], *, calling_party: bool, ucid: str = "") -> str:
    """The pre-RFC shape (Oracle/Acme, Avaya): `id`/`session` attributes, <send> inside <participant>."""
    sid = f"Aav{c.token}=="
    ext = (
        '<extensiondata xmlns:apkt="http://acmepacket.com/siprec/extensiondata">'
        f"<apkt:ucid>{ucid};encoding=hex</apkt:ucid><apkt:callerOrig>true</apkt:callerOrig></extensiondata>"
    )
    parts = ["<datamode>complete</datamode>", f'<session id="{sid}">{ext if ucid else ""}</session>']
    for leg in legs:
        flag = "true" if leg.index == 0 else "false"
        calling = (
            '<extensiondata xmlns:apkt="http://acmepacket.com/siprec/extensiondata">'
            f"<apkt:callingParty>{flag}</apkt:callingParty></extensiondata>"
        )
        parts.append(
            f'<participant id="{leg.sender.id}" session="{sid}">{_name_id(c, leg.sender, lang=False)}'
            f"<send>{leg.stream_id}</send><associate-time>2026-01-01T00:00:00</associate-time>"
            f"{calling if calling_party else ''}</participant>"
        )
    for leg in legs:
        parts.append(
            f'<stream id="{leg.stream_id}" session="{sid}"><label>{leg.label}</label>'
            "<mode>separate</mode></stream>"
        )
    return _document(f"<recording xmlns='{NS_DRAFT}'>", parts, "</recording>")


def oracle(c: _Call) -> RecordingOffer:
    base = 16777227 + 2 * (c.index % 1000)
    legs = c.legs(c.parties("fSD"), [str(base), str(base + 1)], ["caller", "callee"])
    sdp = _sdp(
        c,
        "-",
        "-",
        [
            f"0\nrtpmap:0 PCMU/8000\nlabel:{legs[0].label}\nsendonly",
            f"0\nrtpmap:0 PCMU/8000\nmaxptime:150\nlabel:{legs[1].label}\nsendonly",
        ],
        per_media_c=False,
    )
    xml = _draft_document(c, legs, calling_party=True, ucid=f"00FA0800{c.token.upper()[:14]}")
    body = _multipart("unique-boundary-1", [(SDP_PART, sdp), (METADATA_PART, xml)])
    return RecordingOffer(body, "multipart/mixed;boundary=unique-boundary-1", (), legs)


def avaya(c: _Call) -> RecordingOffer:
    parties = c.parties("av")
    base = 201835599 + 2 * (c.index % 1000)
    legs = c.legs(parties, [str(base), str(base + 1)], [p.id for p in parties])
    sdp = _sdp(
        c,
        "-",
        "-",
        [
            "8 18 101\nrtpmap:8 PCMA/8000\nrtpmap:18 G729/8000\nfmtp:18 annexb=no\n"
            "rtpmap:101 telephone-event/8000\n"
            f"fmtp:101 0-15\nlabel:{legs[0].label}\nsendonly",
            f"8\nlabel:{legs[1].label}\nsendonly",  # static PT 8, no rtpmap
        ],
        per_media_c=False,
    )
    xml = _draft_document(c, legs, calling_party=False)
    body = _multipart("avaya-boundary", [(SDP_PART, sdp), (METADATA_PART, xml)])
    return RecordingOffer(body, 'multipart/mixed; boundary="avaya-boundary"', (), legs)


def sonus(c: _Call) -> RecordingOffer:
    caller, callee = c.parties("MTQ")
    # The calling party sends the stream labelled 2 (research notes: Sonus maps label 2 to the caller).
    legs = (
        RecordedLeg(0, "1", f"st{c.token}0", callee, "callee"),
        RecordedLeg(1, "2", f"st{c.token}1", caller, "caller"),
    )
    sdp = _sdp(
        c,
        "Sonus_UAC",
        "SIP Media Capabilities",
        [f"0\nlabel:{leg.label}\nrtpmap:0 PCMU/8000\nsendonly\nmaxptime:20" for leg in legs],
        per_media_c=True,
    )
    gid, sid = f"grp{c.token}", f"ses{c.token}"
    from_hdr = escape(f'"{caller.name}" <{c.aor(caller)}>;tag=a{c.token}')
    to_hdr = escape(f"<{c.aor(callee)}>;tag=b{c.token}")
    parts = [
        "<tns:datamode>complete</tns:datamode>",
        f'<tns:group group_id="{gid}"><callData xmlns="urn:ietf:params:xml:ns:callData">'
        f"<fromhdr>{from_hdr}</fromhdr><tohdr>{to_hdr}</tohdr><callid>{c.token}-orig</callid></callData></tns:group>",
        f'<tns:session session_id="{sid}"><tns:group-ref>{gid}</tns:group-ref></tns:session>',
    ]
    for p in (caller, callee):
        name_id = _name_id(c, p, prefix="tns:", scheme=False)
        parts.append(f'<tns:participant participant_id="{p.id}">{name_id}</tns:participant>')
    for leg in legs:
        parts.append(
            f'<tns:stream stream_id="{leg.stream_id}" session_id="{sid}">'
            f"<tns:label>{leg.label}</tns:label></tns:stream>"
        )
    for leg in legs:
        other = legs[1 - leg.index]
        parts.append(
            f'<tns:participantstreamassoc participant_id="{leg.sender.id}">'
            f"<tns:send>{leg.stream_id}</tns:send><tns:recv>{other.stream_id}</tns:recv></tns:participantstreamassoc>"
        )
    xml = _document(f"<tns:recording xmlns:tns='{NS_DRAFT}'>", parts, "</tns:recording>")
    body = _multipart(
        "sonus-content-delim",
        [
            (
                (("Content-Disposition", "session; handling=required"), ("Content-Type", "application/sdp")),
                sdp,
            ),
            (METADATA_PART[::-1], xml),
        ],
    )
    return RecordingOffer(body, "multipart/mixed;boundary=sonus-content-delim", (), legs)


def broadworks(c: _Call) -> RecordingOffer:
    parties = c.parties("9a2d")
    legs = c.legs(parties, ["10", "20"], [p.id for p in parties])
    formats = "8 97\nrtpmap:8 PCMA/8000\nrtpmap:97 telephone-event/8000"
    media = [f"{formats}\nlabel:{leg.label}\nsendonly\nptime:20" for leg in legs]
    sdp = _sdp(c, "-", "SipCall", media, per_media_c=False)
    xml = _rfc_document(c, legs, recv=False, datamode="dataMode")
    body = _multipart("foobar", [(SDP_PART, sdp), (METADATA_PART, xml)])
    return RecordingOffer(body, "multipart/mixed;boundary=foobar", (), legs)


def _rfc_vendor(
    labels: Sequence[str],
    *,
    dtmf: bool,
    boundary: str = "rs-boundary",
    headers: tuple[tuple[str, str], ...] = (),
) -> Callable[[_Call], RecordingOffer]:
    def build(c: _Call) -> RecordingOffer:
        parties = c.parties("p")
        legs = c.legs(parties, labels, [p.id for p in parties])
        formats = _PCMU_TE if dtmf else "0 8\nrtpmap:0 PCMU/8000\nrtpmap:8 PCMA/8000\nptime:20"
        sdp = _sdp(
            c, "-", "-", [f"{formats}\nlabel:{leg.label}\nsendonly" for leg in legs], per_media_c=False
        )
        xml = _rfc_document(c, legs, recv=True, datamode="datamode")
        body = _multipart(boundary, [(SDP_PART, sdp), (METADATA_PART, xml)])
        return RecordingOffer(body, f"multipart/mixed;boundary={boundary}", headers, legs)

    return build


VENDORS: dict[str, Callable[[_Call], RecordingOffer]] = {
    "cisco": cisco,
    "oracle": oracle,
    "avaya": avaya,
    "sonus": sonus,
    "broadworks": broadworks,
    "audiocodes": _rfc_vendor(["1", "2"], dtmf=True),
    "twilio": _rfc_vendor(["inbound", "outbound"], dtmf=False),
    "telnyx": _rfc_vendor(["1", "2"], dtmf=True, headers=(("Session-Expires", "90;refresher=uac"),)),
    "opensips": _rfc_vendor(["1", "2"], dtmf=True, boundary="OSS-unique-boundary-42"),
}


def vendor_of_call(choice: str, index: int) -> str:
    """The vendor shape of call `index`: `choice`, or round robin over all of them for "all"."""
    return list(VENDORS)[index % len(VENDORS)] if choice == "all" else choice


def build_offer(
    vendor: str, *, index: int, ip: str, ports: Sequence[int], session_id: int, domain: str = "src.example"
) -> RecordingOffer:
    """The recording offer of call `index`, with its legs' RTP at `ip`:`ports` (one per leg)."""
    if vendor not in VENDORS:
        raise ValueError(f"unknown SIPREC vendor {vendor!r} (one of {', '.join(VENDORS)})")
    if len(ports) != LEGS:
        raise ValueError(f"a recording offer has {LEGS} legs, got {len(ports)} ports")
    return VENDORS[vendor](_Call(index, ip, tuple(ports), domain, session_id))
