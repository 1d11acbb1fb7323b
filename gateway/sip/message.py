"""SIP messages (RFC 3261 §7, §25): parse bytes into validated requests/responses and serialize them back.

Pure and bounded: `parse_message(data)` never reads past `data`, caps header count and size, and
raises `SipParseError` with a status hint (400, 505, 513) and whatever header fields it could read, so
the caller can still answer a malformed request (§8.2.6) or drop it when no answer can be routed.

Why an own parser: RFC 4475's torture set needs both leniency (folding, compact forms, odd tokens,
RFC 2543 syntax) and strictness (unterminated quotes, spaces in the Request-URI, duplicated
single-instance fields, out-of-range CSeq/Max-Forwards); the candidate library (sipmessage 0.7.1)
rejected 2 valid messages and accepted most invalid ones. Every message of the set is a test here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from gateway.sip.headers import (
    CSeq,
    HeaderSyntaxError,
    NameAddr,
    Via,
    check_uri_chars,
    is_digits,
    is_token,
    parse_cseq,
    parse_name_addr,
    parse_sip_uri,
    parse_via,
    split_list,
    uri_scheme,
)

# Limits (per message). A UDP datagram is at most 64 KiB anyway; TCP framing enforces the same.
MAX_HEADER_BYTES = 32 * 1024
MAX_HEADERS = 200
MAX_BODY_BYTES = 64 * 1024

# §7.3.3 compact forms (plus the later RFCs' letters).
COMPACT_FORMS = {
    "i": "Call-ID",
    "m": "Contact",
    "e": "Content-Encoding",
    "l": "Content-Length",
    "c": "Content-Type",
    "f": "From",
    "s": "Subject",
    "k": "Supported",
    "t": "To",
    "v": "Via",
    "o": "Event",
    "r": "Refer-To",
    "b": "Referred-By",
    "u": "Allow-Events",
    "x": "Session-Expires",
    "a": "Accept-Contact",
    "j": "Reject-Contact",
    "d": "Request-Disposition",
    "y": "Identity",
    "n": "Identity-Info",
}
_KNOWN = (  # noqa: SIM905 (a word list reads better than 60 quoted names)
    "Accept Accept-Encoding Accept-Language Alert-Info Allow Authentication-Info Authorization Call-ID "
    "Call-Info Contact Content-Disposition Content-Encoding Content-Language Content-Length Content-Type "
    "CSeq Date Error-Info Expires From In-Reply-To Max-Forwards Min-Expires MIME-Version Organization "
    "Priority Proxy-Authenticate Proxy-Authorization Proxy-Require Reason Record-Route Reply-To Require "
    "Retry-After Route Server Subject Supported Timestamp To Unsupported User-Agent Via Warning "
    "WWW-Authenticate P-Asserted-Identity P-Preferred-Identity Privacy Diversion Session-Expires Min-SE "
    "Allow-Events Event RAck RSeq Refer-To Referred-By Identity"
).split()
CANONICAL_NAMES = {n.lower(): n for n in _KNOWN}
# §7.3.1: these may appear once only (multi01, mcl01 of RFC 4475 duplicate them).
SINGLE_INSTANCE = ("call-id", "cseq", "from", "to", "max-forwards", "content-length", "content-type")

# Date: rfc1123-date with the literal "GMT" (§20.17; RFC 4475 baddate uses "EST").
_DATE_RE = re.compile(
    r"^(Mon|Tue|Wed|Thu|Fri|Sat|Sun), [0-9]{2} (Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) [0-9]{4} "
    r"[0-9]{2}:[0-9]{2}:[0-9]{2} GMT$"
)
_VERSION_RE = re.compile(r"^SIP/([0-9]+)\.([0-9]+)$", re.IGNORECASE)


def canonical_name(name: str) -> str:
    low = name.lower()
    if low in COMPACT_FORMS:
        return COMPACT_FORMS[low]
    return CANONICAL_NAMES.get(low, name)


@dataclass(frozen=True, slots=True)
class Headers:
    """Header fields in order, names canonical (compact forms expanded), values unfolded."""

    items: tuple[tuple[str, str], ...] = ()
    _lower: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_lower", tuple(k.lower() for k, _ in self.items))

    def get(self, name: str) -> str | None:
        low = name.lower()
        for i, k in enumerate(self._lower):
            if k == low:
                return self.items[i][1]
        return None

    def get_all(self, name: str) -> list[str]:
        low = name.lower()
        return [self.items[i][1] for i, k in enumerate(self._lower) if k == low]

    def values(self, name: str) -> list[str]:
        """All comma-separated elements of a list header across its lines (§7.3.1)."""
        return [p for v in self.get_all(name) for p in split_list(v) if p]

    def count(self, name: str) -> int:
        return self._lower.count(name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    @classmethod
    def of(cls, pairs: Iterable[tuple[str, str]]) -> Headers:
        return cls(tuple((canonical_name(k), v) for k, v in pairs))


@dataclass(frozen=True, slots=True)
class SipRequest:
    method: str
    uri: str
    headers: Headers
    body: bytes
    via: tuple[Via, ...]
    from_: NameAddr
    to: NameAddr
    call_id: str
    cseq: CSeq
    max_forwards: int | None = None

    @property
    def content_type(self) -> str | None:
        ct = self.headers.get("Content-Type")
        return None if ct is None else ct.split(";", 1)[0].strip().lower()


@dataclass(frozen=True, slots=True)
class SipResponse:
    status: int
    reason: str
    headers: Headers
    body: bytes
    via: tuple[Via, ...]
    from_: NameAddr
    to: NameAddr
    call_id: str
    cseq: CSeq


SipMessage = SipRequest | SipResponse


@dataclass(slots=True)
class SipParseError(Exception):
    """The bytes are not an acceptable SIP message.

    `status` is the response a UAS should send for a request (400 unless the RFC names another);
    `headers`/`method`/`is_request` carry what could be read, for building that response.
    """

    reason: str
    status: int = 400
    kind: str = "malformed"  # bounded label for metrics: malformed, truncated, too_large, version, binary
    is_request: bool | None = None
    method: str | None = None
    headers: Headers = field(default_factory=Headers)

    def __str__(self) -> str:
        return f"{self.status} {self.reason}"


# --- framing -----------------------------------------------------------------------------------------


def find_header_end(data: bytes | bytearray, start: int = 0) -> tuple[int, int] | None:
    """(end of the header section, start of the body) or None: CRLFCRLF, tolerating bare LFs."""
    crlf = data.find(b"\r\n\r\n", start)
    lf = data.find(b"\n\n", start)
    if crlf < 0 and lf < 0:
        return None
    if lf >= 0 and (crlf < 0 or lf < crlf):
        return lf, lf + 2
    return crlf, crlf + 4


def parse_content_length(headers: Headers) -> int | None:
    """Content-Length (§20.14) or None when absent; raises SipParseError when repeated or not a number."""
    values = headers.get_all("Content-Length")
    if not values:
        return None
    if len(values) > 1:
        raise SipParseError("repeated Content-Length", headers=headers)
    text = values[0].strip()
    if not is_digits(text) or len(text) > 9:
        raise SipParseError(f"bad Content-Length {text[:20]!r}", headers=headers)
    return int(text)


# --- parsing -----------------------------------------------------------------------------------------


def _header_lines(text: str) -> list[str]:
    """Split the header section into logical lines, unfolding §7.3.1 continuations (CRLF + WSP)."""
    raw = text.replace("\r\n", "\n").split("\n")
    lines: list[str] = []
    for line in raw:
        if line[:1] in (" ", "\t") and lines:
            lines[-1] = lines[-1].rstrip(" \t") + " " + line.lstrip(" \t")
        else:
            lines.append(line)
    return lines


def _parse_header_fields(lines: list[str]) -> Headers:
    items: list[tuple[str, str]] = []
    for line in lines:
        if not line:
            continue
        # header = field-name HCOLON field-value; HCOLON = *( SP / HTAB ) ":" SWS
        name, colon, value = line.partition(":")
        name = name.rstrip(" \t")
        if not colon or not is_token(name):
            raise SipParseError(f"bad header line {line[:40]!r}", headers=Headers(tuple(items)))
        items.append((canonical_name(name), value.strip(" \t")))
        if len(items) > MAX_HEADERS:
            raise SipParseError(
                "too many header fields", status=513, kind="too_large", headers=Headers(tuple(items))
            )
    return Headers(tuple(items))


def _essentials(headers: Headers) -> tuple[tuple[Via, ...], NameAddr, NameAddr, str, CSeq]:
    """Via, From, To, Call-ID, CSeq: present, single where required, and well formed (§8.1.1)."""
    for name in SINGLE_INSTANCE:
        if headers.count(name) > 1:
            raise SipParseError(f"repeated {canonical_name(name)} header", headers=headers)
    for name in ("Via", "From", "To", "Call-ID", "CSeq"):
        if headers.get(name) is None:
            raise SipParseError(f"missing {name} header", headers=headers)
    try:
        vias = tuple(v for value in headers.get_all("Via") for v in parse_via(value))
    except HeaderSyntaxError as e:
        raise SipParseError(f"bad Via: {e}", headers=headers) from None
    parsed: list[NameAddr] = []
    for name in ("From", "To"):
        try:
            parsed.append(parse_name_addr(headers.get(name) or ""))
        except HeaderSyntaxError as e:
            raise SipParseError(f"bad {name}: {e}", headers=headers) from None
    call_id = (headers.get("Call-ID") or "").strip()
    # callid = word [ "@" word ]: no whitespace inside.
    if not call_id or any(c in " \t" for c in call_id):
        raise SipParseError("bad Call-ID", headers=headers)
    try:
        cseq = parse_cseq(headers.get("CSeq") or "")
    except HeaderSyntaxError as e:
        raise SipParseError(f"bad CSeq: {e}", headers=headers) from None
    return vias, parsed[0], parsed[1], call_id, cseq


def _check_request_fields(method: str, headers: Headers, cseq: CSeq) -> int | None:
    if cseq.method != method:
        # §8.1.1.5: the CSeq method MUST match the request method (RFC 4475 mismatch01/02).
        raise SipParseError("CSeq method does not match the request method", headers=headers, method=method)
    max_forwards: int | None = None
    mf = headers.get("Max-Forwards")
    if mf is not None:
        text = mf.strip()
        # Max-Forwards = 1*DIGIT, 0-255 (RFC 4475 scalar02 sends 300).
        if not is_digits(text) or len(text) > 10 or int(text) > 255:
            raise SipParseError("Max-Forwards out of range", headers=headers, method=method)
        max_forwards = int(text)
    for value in headers.values("Contact"):
        try:
            parse_name_addr(value, allow_star=True)
        except HeaderSyntaxError as e:
            raise SipParseError(f"bad Contact: {e}", headers=headers, method=method) from None
    for name in ("Route", "Record-Route"):
        for value in headers.values(name):
            try:
                parse_name_addr(value)
            except HeaderSyntaxError as e:
                raise SipParseError(f"bad {name}: {e}", headers=headers, method=method) from None
    date = headers.get("Date")
    if date is not None and not _DATE_RE.match(date.strip()):
        raise SipParseError("Date must be an RFC 1123 date in GMT", headers=headers, method=method)
    expires = headers.get("Expires")
    if expires is not None and (not is_digits(expires.strip()) or len(expires.strip()) > 10):
        raise SipParseError("bad Expires", headers=headers, method=method)
    return max_forwards


def _check_request_uri(uri: str, headers: Headers, method: str) -> None:
    try:
        check_uri_chars(uri)
        scheme = uri_scheme(uri)
        if scheme in ("sip", "sips"):
            sip_uri = parse_sip_uri(uri)
            if sip_uri.headers is not None:
                # §19.1.1 table: the headers component is not allowed in a Request-URI (RFC 4475 escruri).
                raise HeaderSyntaxError("headers are not allowed in a Request-URI")
    except HeaderSyntaxError as e:
        raise SipParseError(f"bad Request-URI: {e}", headers=headers, method=method) from None


def parse_message(data: bytes, *, stream: bool = False) -> SipMessage:
    """Parse one SIP message.

    `stream=False` (UDP, §18.3): the datagram is the message; a Content-Length shorter than the data
    discards the extra octets, a longer one is an error; without Content-Length the body runs to the
    end. `stream=True` (TCP): `data` is exactly one framed message (see `StreamFramer`).
    """
    # §7.5: implementations SHOULD ignore CRLFs before the start line.
    start = 0
    while data[start : start + 2] == b"\r\n" or data[start : start + 1] == b"\n":
        start += 2 if data[start : start + 1] == b"\r" else 1
    bounds = find_header_end(data, start)
    if bounds is None and not stream and data.endswith(b"\n"):
        # A datagram that ends right after its last header line (no empty line): read it as a
        # message without a body so its real defect gets reported (RFC 4475 baddn is sent this way).
        bounds = (len(data), len(data))
    if bounds is None:
        # No blank line: a truncated message (or binary junk).
        head_text = data[start : start + MAX_HEADER_BYTES].decode("utf-8", "replace")
        kind = "binary" if not _looks_textual(data[start : start + 64]) else "truncated"
        raise SipParseError("no end of header section", kind=kind, headers=_salvage(head_text))
    head_end, body_start = bounds
    head = data[start:head_end]
    if len(head) > MAX_HEADER_BYTES:
        text = head[:MAX_HEADER_BYTES].decode("utf-8", "replace")
        first = text.split("\n", 1)[0].split(" ", 1)[0]
        raise SipParseError(
            "header section too large",
            status=513,
            kind="too_large",
            is_request=not first.startswith("SIP/"),
            method=first if is_token(first) else None,
            headers=_salvage(text),
        )
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        if _has_controls(head[:64]):
            raise SipParseError(
                "header section is not text", kind="binary", headers=_salvage(head.decode("utf-8", "replace"))
            ) from None
        # Text that is not UTF-8 (an ISO-8859-1 display name, "Jürgen"): RFC 3261 §7.3.1 asks for
        # UTF-8, but the message is still routable and answerable. The stray bytes become lone
        # surrogates: kept byte for byte when a header is echoed (serialize uses surrogateescape),
        # refused where the grammar is ASCII (URIs, tokens: 400 naming the header).
        text = head.decode("utf-8", "surrogateescape")
    lines = _header_lines(text)
    start_line = lines[0]
    is_request = not start_line.startswith("SIP/")
    method: str | None = None
    headers = Headers()
    try:
        headers = _parse_header_fields(lines[1:])
        if is_request:
            parts = start_line.split(" ")
            method = parts[0] if parts and is_token(parts[0]) else None
            # Request-Line = Method SP Request-URI SP SIP-Version CRLF: exactly single spaces
            # (RFC 4475 lwsstart, lwsruri and trws break this).
            if len(parts) != 3 or not all(parts) or method is None:
                raise SipParseError("malformed Request-Line")
            version = _VERSION_RE.match(parts[2])
            if version is None:
                raise SipParseError("malformed SIP-Version")
            if (version.group(1), version.group(2)) != ("2", "0"):
                raise SipParseError("SIP version not supported", status=505, kind="version")
        else:
            status_parts = start_line.split(" ", 2)
            if len(status_parts) < 2 or status_parts[0].upper() != "SIP/2.0":
                raise SipParseError("malformed Status-Line")
            code = status_parts[1]
            if len(code) != 3 or not is_digits(code) or not 100 <= int(code) <= 699:
                raise SipParseError("bad status code")
        if len(data) - body_start > MAX_BODY_BYTES and not stream:
            raise SipParseError("body too large", status=513, kind="too_large")
        content_length = parse_content_length(headers)
        rest = data[body_start:]
        if content_length is None:
            if stream:
                raise SipParseError("Content-Length is required over stream transports")
            body = bytes(rest)
        elif content_length > len(rest):
            raise SipParseError("message shorter than its Content-Length", kind="truncated")
        else:
            body = bytes(rest[:content_length])
        if len(body) > MAX_BODY_BYTES:
            raise SipParseError("body too large", status=513, kind="too_large")
        vias, from_, to, call_id, cseq = _essentials(headers)
        if is_request:
            assert method is not None
            uri = start_line.split(" ")[1]
            _check_request_uri(uri, headers, method)
            max_forwards = _check_request_fields(method, headers, cseq)
            return SipRequest(method, uri, headers, body, vias, from_, to, call_id, cseq, max_forwards)
        status_parts = start_line.split(" ", 2)
        reason = status_parts[2] if len(status_parts) > 2 else ""
        return SipResponse(int(status_parts[1]), reason, headers, body, vias, from_, to, call_id, cseq)
    except SipParseError as e:
        e.is_request = is_request
        e.method = method
        if not e.headers:
            e.headers = headers if headers else _salvage(text)
        raise


def _has_controls(sample: bytes) -> bool:
    return any((b < 32 and b not in (9, 10, 13)) or b == 127 for b in sample)


def _looks_textual(sample: bytes) -> bool:
    """Printable UTF-8 (a cut multi-byte sequence at the end is fine): text, else binary junk."""
    if not sample or _has_controls(sample):
        return False
    try:
        sample.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start >= len(sample) - 3 and e.reason == "unexpected end of data"
    return True


def _salvage(text: str) -> Headers:
    """Best-effort header fields of a message that cannot be parsed, to route a 400 (never raises)."""
    items: list[tuple[str, str]] = []
    for line in _header_lines(text)[1:MAX_HEADERS]:
        name, colon, value = line.partition(":")
        name = name.rstrip(" \t")
        if colon and is_token(name):
            items.append((canonical_name(name), value.strip(" \t")))
    return Headers(tuple(items))


# --- serializing -------------------------------------------------------------------------------------


def _serialize(start_line: str, headers: Headers, body: bytes) -> bytes:
    lines = [start_line]
    lines.extend(f"{k}: {v}" for k, v in headers.items if k.lower() != "content-length")
    lines.append(f"Content-Length: {len(body)}")
    # surrogateescape: header bytes that were not UTF-8 go back out exactly as they came (see parse).
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body


def serialize(message: SipMessage) -> bytes:
    """Wire form; Content-Length is always written last and always matches the body."""
    if isinstance(message, SipRequest):
        return _serialize(f"{message.method} {message.uri} SIP/2.0", message.headers, message.body)
    return _serialize(f"SIP/2.0 {message.status} {message.reason}", message.headers, message.body)


# --- stream framing (§18.3) ----------------------------------------------------------------------------


class FramingError(Exception):
    """A byte stream cannot be split into SIP messages any more (the connection must be closed).

    `head` is the header section of the message that could not be framed, when it was complete (a
    bad Content-Length): enough to answer that request with a 400 before closing."""

    def __init__(self, reason: str, head: bytes = b"") -> None:
        super().__init__(reason)
        self.head = head


class StreamFramer:
    """Splits a TCP byte stream into whole SIP messages by Content-Length (RFC 3261 §18.3).

    Pure: `feed(data)` returns the complete messages (bytes) found so far. CRLF keep-alives between
    messages (RFC 5626 §4.4.1 "\\r\\n\\r\\n" pings) are reported as `b"\\r\\n\\r\\n"` entries so the
    adapter can answer them with a single CRLF pong. A message without a usable Content-Length, or a
    header section or body over the limits, raises `FramingError`: the stream cannot be resynchronised.
    """

    def __init__(
        self, max_header_bytes: int = MAX_HEADER_BYTES, max_body_bytes: int = MAX_BODY_BYTES
    ) -> None:
        self._buf = bytearray()
        self._max_header = max_header_bytes
        self._max_body = max_body_bytes
        # Where the search for the end of the header section resumes: a peer sending its header a byte
        # at a time must not make every byte rescan the whole buffer (quadratic CPU per connection).
        self._scanned = 0

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out: list[bytes] = []
        while True:
            # Leading CRLFs: a double CRLF is a keep-alive ping; a lone CRLF is ignored (§7.5).
            if self._buf.startswith(b"\r\n\r\n"):
                del self._buf[:4]
                self._scanned = 0
                out.append(b"\r\n\r\n")
                continue
            if self._buf in (b"\r\n", b"\r", b"\n"):
                return out
            if self._buf.startswith(b"\r\n") and not self._buf.startswith(b"\r\n\r"):
                del self._buf[:2]
                self._scanned = 0
                continue
            if not self._buf:
                return out
            bounds = find_header_end(self._buf, self._scanned)
            if bounds is None:
                if len(self._buf) > self._max_header:
                    raise FramingError("header section too large")
                self._scanned = max(0, len(self._buf) - 3)  # a terminator may straddle two reads
                return out
            head_end, body_start = bounds
            if head_end > self._max_header:
                raise FramingError("header section too large")
            try:
                length = self._content_length(bytes(self._buf[:head_end]))
            except FramingError as e:
                raise FramingError(str(e), bytes(self._buf[:body_start])) from None
            if length > self._max_body:
                raise FramingError("body too large")
            if len(self._buf) < body_start + length:
                return out
            out.append(bytes(self._buf[: body_start + length]))
            del self._buf[: body_start + length]
            self._scanned = 0

    @staticmethod
    def _content_length(head: bytes) -> int:
        lengths: list[str] = []
        for line in head.replace(b"\r\n", b"\n").split(b"\n")[1:]:
            name, colon, value = line.partition(b":")
            if colon and name.strip().lower() in (b"content-length", b"l"):
                lengths.append(value.strip().decode("latin-1"))
        if len(lengths) != 1 or not is_digits(lengths[0]) or len(lengths[0]) > 9:
            raise FramingError("a stream message needs exactly one valid Content-Length")
        return int(lengths[0])

    @property
    def buffered(self) -> int:
        return len(self._buf)
