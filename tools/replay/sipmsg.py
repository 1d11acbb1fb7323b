"""SIP messages for the replay UAC: a small RFC 3261 parser/serializer (pure).

The UAC parses what a UAS sends it (responses, and in-dialog BYE/OPTIONS) and builds its own requests.
It has its own parser on purpose: a load tool that shared the gateway's parser would hide that
parser's bugs from both sides.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# RFC 3261 §7.3.3 compact forms.
_COMPACT = {
    "i": "call-id",
    "m": "contact",
    "e": "content-encoding",
    "l": "content-length",
    "c": "content-type",
    "f": "from",
    "s": "subject",
    "k": "supported",
    "t": "to",
    "v": "via",
}
_MAX_MESSAGE = 65535


class SipParseError(ValueError):
    """A datagram or stream segment that is not a SIP message."""


@dataclass(frozen=True, slots=True)
class SipMessage:
    """A request (`method`, `uri`) or a response (`status`, `reason`); headers in wire order."""

    headers: tuple[tuple[str, str], ...]
    body: bytes = b""
    method: str | None = None
    uri: str | None = None
    status: int | None = None
    reason: str = ""

    @property
    def is_request(self) -> bool:
        return self.method is not None

    def get(self, name: str) -> str | None:
        key = _canonical(name)
        for k, v in self.headers:
            if _canonical(k) == key:
                return v
        return None

    def get_all(self, name: str) -> list[str]:
        key = _canonical(name)
        return [v for k, v in self.headers if _canonical(k) == key]

    @property
    def call_id(self) -> str:
        return self.get("call-id") or ""

    @property
    def cseq(self) -> tuple[int, str]:
        raw = self.get("cseq") or ""
        parts = raw.split()
        if len(parts) != 2 or not parts[0].isdigit():
            raise SipParseError(f"bad CSeq {raw!r}")
        return int(parts[0]), parts[1].upper()

    @property
    def top_via_branch(self) -> str | None:
        via = self.get("via")
        if via is None:
            return None
        first = split_header_list(via)[0]
        return header_param(first, "branch")


def _canonical(name: str) -> str:
    low = name.strip().lower()
    return _COMPACT.get(low, low)


def split_header_list(value: str) -> list[str]:
    """Split a comma-separated header value, not inside quotes or <...> (RFC 3261 §7.3.1)."""
    out: list[str] = []
    depth, quoted, start = 0, False, 0
    for i, ch in enumerate(value):
        if ch == '"' and (i == 0 or value[i - 1] != "\\"):
            quoted = not quoted
        elif not quoted and ch == "<":
            depth += 1
        elif not quoted and ch == ">":
            depth = max(0, depth - 1)
        elif not quoted and depth == 0 and ch == ",":
            out.append(value[start:i].strip())
            start = i + 1
    out.append(value[start:].strip())
    return [v for v in out if v]


def header_param(value: str, name: str) -> str | None:
    """A `;name=value` parameter of a header value (outside the <uri>)."""
    tail = value.rsplit(">", 1)[-1] if "<" in value else value
    for part in tail.split(";")[1:]:
        k, _, v = part.partition("=")
        if k.strip().lower() == name:
            return v.strip().strip('"')
    return None


def name_addr_uri(value: str) -> str:
    """The URI of a name-addr or addr-spec (From/To/Contact): `"A" <sip:a@h>;tag=x` → `sip:a@h`."""
    if "<" in value:
        m = re.search(r"<([^>]*)>", value)
        if m is None:
            raise SipParseError(f"unterminated <uri> in {value!r}")
        return m.group(1).strip()
    return value.split(";", 1)[0].strip()


def parse(data: bytes) -> SipMessage:
    """One whole message (a UDP datagram, or one frame cut from a TCP stream by `StreamFramer`)."""
    if len(data) > _MAX_MESSAGE:
        raise SipParseError("message too large")
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        head, sep, body = data.partition(b"\n\n")  # RFC 3261 §7: be lenient with bare LF
        if not sep:
            raise SipParseError("no end of headers")
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SipParseError("headers are not UTF-8") from exc
    lines = text.replace("\r\n", "\n").split("\n")
    while lines and not lines[0]:
        lines.pop(0)  # RFC 3261 §7.5: ignore CRLFs before the start line
    if not lines:
        raise SipParseError("empty message")
    start = lines[0]
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        if line[:1] in (" ", "\t"):  # header folding (§7.3.1)
            if not headers:
                raise SipParseError("continuation line before any header")
            k, v = headers[-1]
            headers[-1] = (k, v + " " + line.strip())
            continue
        name, colon, value = line.partition(":")
        if not colon or not name.strip() or " " in name.strip():
            raise SipParseError(f"bad header line {line!r}")
        headers.append((name.strip(), value.strip()))
    msg_headers = tuple(headers)
    length_raw = next((v for k, v in msg_headers if _canonical(k) == "content-length"), None)
    if length_raw is not None:
        if not length_raw.isdigit():
            raise SipParseError(f"bad Content-Length {length_raw!r}")
        length = int(length_raw)
        if length > len(body):
            raise SipParseError(f"body shorter than Content-Length {length}")
        body = body[:length]
    if start.startswith("SIP/"):
        m = re.fullmatch(r"SIP/2\.0 (\d{3}) ?(.*)", start)
        if m is None:
            raise SipParseError(f"bad status line {start!r}")
        msg = SipMessage(msg_headers, body, status=int(m.group(1)), reason=m.group(2))
    else:
        m = re.fullmatch(r"([A-Za-z0-9.!%*_+`'~-]+) (\S+) SIP/2\.0", start)
        if m is None:
            raise SipParseError(f"bad request line {start!r}")
        msg = SipMessage(msg_headers, body, method=m.group(1).upper(), uri=m.group(2))
    for required in ("call-id", "cseq", "from", "to", "via"):
        if msg.get(required) is None:
            raise SipParseError(f"missing {required} header")
    msg.cseq  # noqa: B018  (validates CSeq)
    return msg


def serialize(start_line: str, headers: list[tuple[str, str]], body: bytes = b"") -> bytes:
    lines = [start_line, *(f"{k}: {v}" for k, v in headers), f"Content-Length: {len(body)}", "", ""]
    return "\r\n".join(lines).encode("utf-8") + body


def response_to(request: SipMessage, status: int, reason: str, to_tag: str | None = None) -> bytes:
    """A response to an incoming request (RFC 3261 §8.2.6.2: copy Via, From, To, Call-ID, CSeq)."""
    headers: list[tuple[str, str]] = [("Via", v) for v in request.get_all("via")]
    to = request.get("to") or ""
    if to_tag and header_param(to, "tag") is None:
        to = f"{to};tag={to_tag}"
    headers += [
        ("From", request.get("from") or ""),
        ("To", to),
        ("Call-ID", request.call_id),
        ("CSeq", request.get("cseq") or ""),
        ("Server", "ttg-replay"),
    ]
    return serialize(f"SIP/2.0 {status} {reason}", headers)


class StreamFramer:
    """Cuts a TCP byte stream into messages by Content-Length (RFC 3261 §18.3); skips keep-alive CRLFs."""

    def __init__(self, max_message: int = _MAX_MESSAGE) -> None:
        self._buf = bytearray()
        self._max = max_message

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out: list[bytes] = []
        while True:
            while self._buf[:2] == b"\r\n":
                del self._buf[:2]
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > self._max:
                    raise SipParseError("header block too large")
                return out
            head = bytes(self._buf[:end]).decode("utf-8", errors="replace")
            m = re.search(r"(?im)^(?:content-length|l)[ \t]*:[ \t]*(\d+)[ \t]*$", head)
            if m is None:
                raise SipParseError("no Content-Length on a stream transport")
            total = end + 4 + int(m.group(1))
            if total > self._max:
                raise SipParseError("message too large")
            if len(self._buf) < total:
                return out
            out.append(bytes(self._buf[:total]))
            del self._buf[:total]
