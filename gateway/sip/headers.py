"""Header-field grammar of RFC 3261 §25 (pure): Via, name-addr (From/To/Contact/Route), CSeq, SIP URIs,
generic parameters, comma lists and digest credentials; plus tag/branch generation.

Header values reach these functions already unfolded (every CRLF+WSP fold replaced by one SP, §7.3.1),
so "LWS" below is any run of SP/HTAB. Each parser raises `HeaderSyntaxError` with a one-line reason;
`gateway.sip.message` turns that into a 400 naming the header.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, replace

# RFC 3261 §25.1: token = 1*(alphanum / "-" / "." / "!" / "%" / "*" / "_" / "+" / "`" / "'" / "~")
TOKEN_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-.!%*_+`'~")
_WS = " \t"
# Characters that can never appear in a URI (§19.1 / RFC 3986): controls, space, quote, angle brackets.
# RFC 3261 §8.1.1.7: branches of RFC 3261 clients start with this cookie.
MAGIC_COOKIE = "z9hG4bK"

Params = tuple[tuple[str, str | None], ...]


class HeaderSyntaxError(ValueError):
    """A header value does not match the RFC 3261 §25 grammar."""


_TOKEN_RE = re.compile(r"[A-Za-z0-9\-.!%*_+`'~]+")
_HOST_RE = re.compile(r"[A-Za-z0-9.\-]+")
_SCHEME_RE = re.compile(r"([A-Za-z][A-Za-z0-9+\-.]*):")
# Lone surrogates stand for bytes that were not UTF-8 (message.py decodes with surrogateescape).
_BAD_URI_RE = re.compile(r'[<>"\s\x00-\x1f\x7f\\^{}|\ud800-\udfff]')


def is_token(text: str) -> bool:
    return _TOKEN_RE.fullmatch(text) is not None


def is_digits(text: str) -> bool:
    """1*DIGIT of RFC 5234 (ASCII 0-9 only): `str.isdigit` also takes "²" or "٣", which `int()` refuses
    or reads as another number, so every numeric field of SIP and SDP is checked with this."""
    return text.isascii() and text.isdigit()


def make_tag() -> str:
    """A To/From tag: §19.3 asks for at least 32 bits of randomness."""
    return secrets.token_hex(8)


def make_branch() -> str:
    """A Via branch unique across space and time (§8.1.1.7), with the RFC 3261 magic cookie."""
    return MAGIC_COOKIE + secrets.token_hex(10)


class _Scanner:
    """A cursor over one header value with the few lexical rules of §25.1."""

    __slots__ = ("i", "n", "s")

    def __init__(self, s: str) -> None:
        self.s = s
        self.i = 0
        self.n = len(s)

    def at_end(self) -> bool:
        return self.i >= self.n

    def peek(self) -> str:
        return self.s[self.i] if self.i < self.n else ""

    def skip_ws(self) -> None:
        while self.i < self.n and self.s[self.i] in _WS:
            self.i += 1

    def token(self, what: str) -> str:
        m = _TOKEN_RE.match(self.s, self.i)
        if m is None:
            raise HeaderSyntaxError(f"expected {what} at {self._here()}")
        self.i = m.end()
        return m.group()

    def quoted_string(self) -> str:
        """quoted-string = SWS DQUOTE *(qdtext / quoted-pair) DQUOTE; returns the text as written."""
        start = self.i
        if self.peek() != '"':
            raise HeaderSyntaxError(f"expected '\"' at {self._here()}")
        j = self.i + 1
        while j < self.n:
            c = self.s[j]
            if c == "\\":
                # quoted-pair = "\" (%x00-09 / %x0B-0C / %x0E-7F)
                if j + 1 >= self.n or self.s[j + 1] in "\r\n":
                    break
                j += 2
                continue
            if c == '"':
                self.i = j + 1
                return self.s[start : self.i]
            j += 1
        raise HeaderSyntaxError("unterminated quoted-string")

    def expect(self, ch: str) -> None:
        if self.peek() != ch:
            raise HeaderSyntaxError(f"expected {ch!r} at {self._here()}")
        self.i += 1

    def accept(self, ch: str) -> bool:
        if self.peek() == ch:
            self.i += 1
            return True
        return False

    def _here(self) -> str:
        return f"offset {self.i}" if self.i < self.n else "end of value"


def unquote(text: str) -> str:
    """The content of a quoted-string with quoted-pairs resolved (non-quoted text is returned as is)."""
    if len(text) >= 2 and text[0] == '"' and text[-1] == '"':
        body = text[1:-1]
        out: list[str] = []
        i = 0
        while i < len(body):
            if body[i] == "\\" and i + 1 < len(body):
                out.append(body[i + 1])
                i += 2
            else:
                out.append(body[i])
                i += 1
        return "".join(out)
    return text


def quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


# --- generic parameters --------------------------------------------------------------------------


def _param_value(sc: _Scanner) -> str:
    # gen-value = token / host / quoted-string (host covers IPv6 references)
    if sc.peek() == '"':
        return sc.quoted_string()
    if sc.peek() == "[":
        j = sc.s.find("]", sc.i)
        if j < 0:
            raise HeaderSyntaxError("unterminated IPv6 reference")
        out, sc.i = sc.s[sc.i : j + 1], j + 1
        return out
    return sc.token("parameter value")


def _params(sc: _Scanner, stop: str = ",") -> Params:
    """*( SEMI generic-param ), SEMI = SWS ";" SWS, EQUAL = SWS "=" SWS. Stops at `stop` or the end."""
    out: list[tuple[str, str | None]] = []
    while True:
        sc.skip_ws()
        if sc.at_end() or sc.peek() in stop:
            return tuple(out)
        sc.expect(";")
        sc.skip_ws()
        name = sc.token("parameter name")
        sc.skip_ws()
        value: str | None = None
        if sc.accept("="):
            sc.skip_ws()
            value = _param_value(sc)
        out.append((name, value))


def param(params: Params, name: str) -> str | None:
    """Value of a parameter by case-insensitive name; '' for a flag without a value; None if absent."""
    lname = name.lower()
    for k, v in params:
        if k.lower() == lname:
            return "" if v is None else v
    return None


def has_param(params: Params, name: str) -> bool:
    lname = name.lower()
    return any(k.lower() == lname for k, _ in params)


def format_params(params: Params) -> str:
    return "".join(f";{k}" if v is None else f";{k}={v}" for k, v in params)


def set_param(params: Params, name: str, value: str | None) -> Params:
    lname = name.lower()
    kept = [(k, v) for k, v in params if k.lower() != lname]
    return (*kept, (name, value))


# --- comma-separated lists ------------------------------------------------------------------------


def split_list(value: str) -> list[str]:
    """Split a header value at commas that are outside quoted-strings and <...> (§7.3.1)."""
    parts: list[str] = []
    depth_angle = False
    in_quote = False
    start = 0
    i = 0
    n = len(value)
    while i < n:
        c = value[i]
        if in_quote:
            if c == "\\":
                i += 1
            elif c == '"':
                in_quote = False
        elif c == '"':
            in_quote = True
        elif c == "<":
            depth_angle = True
        elif c == ">":
            depth_angle = False
        elif c == "," and not depth_angle:
            parts.append(value[start:i].strip(_WS))
            start = i + 1
        i += 1
    parts.append(value[start:].strip(_WS))
    return parts


def tokens_list(values: Iterable[str]) -> list[str]:
    """Option-tag / method / media-range style lists (Require, Supported, Allow): the items, trimmed."""
    out: list[str] = []
    for v in values:
        out.extend(p for p in (x.strip(_WS) for x in v.split(",")) if p)
    return out


# --- host / port ----------------------------------------------------------------------------------


def _host(sc: _Scanner) -> str:
    """host = hostname / IPv4address / IPv6reference (§25.1)."""
    if sc.peek() == "[":
        j = sc.s.find("]", sc.i)
        if j < 0:
            raise HeaderSyntaxError("unterminated IPv6 reference")
        inner = sc.s[sc.i + 1 : j]
        if not inner or any(c not in "0123456789abcdefABCDEF:." for c in inner):
            raise HeaderSyntaxError("bad IPv6 reference")
        out, sc.i = sc.s[sc.i : j + 1], j + 1
        return out
    m = _HOST_RE.match(sc.s, sc.i)
    host = m.group() if m is not None else ""
    if not host or host.startswith(".") or host.startswith("-") or ".." in host:
        raise HeaderSyntaxError(f"bad host at {sc._here()}")
    sc.i = m.end() if m is not None else sc.i
    return host


def _port(text: str) -> int:
    if not is_digits(text) or len(text) > 5 or int(text) > 65535:
        raise HeaderSyntaxError(f"bad port {text!r}")
    return int(text)


# --- Via (§20.42) ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Via:
    """via-parm = sent-protocol LWS sent-by *( SEMI via-params )"""

    transport: str  # "UDP", "TCP", ... (upper case)
    host: str
    port: int | None
    params: Params = ()
    protocol: str = "SIP/2.0"

    @property
    def branch(self) -> str | None:
        return param(self.params, "branch")

    @property
    def sent_by(self) -> str:
        return self.host if self.port is None else f"{self.host}:{self.port}"

    @property
    def has_rport(self) -> bool:
        return has_param(self.params, "rport")

    def with_param(self, name: str, value: str | None) -> Via:
        if has_param(self.params, name):
            params = tuple((k, value) if k.lower() == name.lower() else (k, v) for k, v in self.params)
        else:
            params = (*self.params, (name, value))
        return replace(self, params=params)

    def __str__(self) -> str:
        return f"{self.protocol}/{self.transport} {self.sent_by}{format_params(self.params)}"


def parse_via(value: str) -> list[Via]:
    """All via-parms of one Via header field value (it may hold several, comma-separated)."""
    sc = _Scanner(value)
    out: list[Via] = []
    while True:
        sc.skip_ws()
        # sent-protocol = protocol-name SLASH protocol-version SLASH transport; SLASH = SWS "/" SWS
        name = sc.token("protocol name")
        sc.skip_ws()
        sc.expect("/")
        sc.skip_ws()
        version = sc.token("protocol version")
        sc.skip_ws()
        sc.expect("/")
        sc.skip_ws()
        transport = sc.token("transport")
        if not sc.peek() or sc.peek() not in _WS:
            raise HeaderSyntaxError("expected LWS before sent-by")
        sc.skip_ws()
        host = _host(sc)
        sc.skip_ws()
        port: int | None = None
        if sc.accept(":"):
            sc.skip_ws()
            j = sc.i
            while j < sc.n and "0" <= sc.s[j] <= "9":
                j += 1
            port = _port(sc.s[sc.i : j])
            sc.i = j
        params = _params(sc)
        branch = param(params, "branch")
        if branch is not None and not branch:
            raise HeaderSyntaxError("empty branch")
        out.append(Via(transport.upper(), host, port, params, f"{name.upper()}/{version}"))
        sc.skip_ws()
        if sc.at_end():
            return out
        sc.expect(",")


# --- URIs (§19.1, §25.1) --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SipUri:
    """SIP-URI / SIPS-URI: sip:user:password@host:port;uri-parameters?headers (text kept escaped)."""

    scheme: str  # "sip" or "sips"
    user: str | None
    host: str
    port: int | None = None
    params: Params = ()
    headers: str | None = None
    password: str | None = None

    @property
    def user_unescaped(self) -> str | None:
        return None if self.user is None else unescape(self.user)

    def __str__(self) -> str:
        userinfo = ""
        if self.user is not None:
            userinfo = self.user + ("" if self.password is None else ":" + self.password) + "@"
        port = "" if self.port is None else f":{self.port}"
        hdrs = "" if self.headers is None else "?" + self.headers
        return f"{self.scheme}:{userinfo}{self.host}{port}{format_params(self.params)}{hdrs}"


def unescape(text: str) -> str:
    """%HH escapes of a URI component, decoded as UTF-8 (invalid sequences kept as escaped)."""
    if "%" not in text:
        return text
    raw = bytearray()
    i = 0
    while i < len(text):
        c = text[i]
        if c == "%" and i + 2 < len(text) + 0 and _is_hex(text[i + 1 : i + 3]):
            raw.append(int(text[i + 1 : i + 3], 16))
            i += 3
        else:
            raw.extend(c.encode())
            i += 1
    return raw.decode("utf-8", "backslashreplace")


def _is_hex(s: str) -> bool:
    return len(s) == 2 and all(c in "0123456789abcdefABCDEF" for c in s)


def uri_scheme(text: str) -> str:
    """The scheme of an absolute URI (lower case), or raise: scheme = ALPHA *( ALPHA / DIGIT / + - . )."""
    m = _SCHEME_RE.match(text)
    if m is None:
        raise HeaderSyntaxError(f"not an absolute URI: {text[:40]!r}")
    return m.group(1).lower()


def check_uri_chars(text: str) -> None:
    bad = _BAD_URI_RE.search(text)
    if bad is not None:
        c = bad.group()
        stray = "\udc80" <= c <= "\udcff"  # a byte that was not UTF-8
        what = f"byte 0x{ord(c) - 0xDC00:02x} (not UTF-8)" if stray else f"character {c!r}"
        raise HeaderSyntaxError(f"{what} not allowed in a URI")
    if "%" in text:
        i = text.find("%")
        while i >= 0:
            if not _is_hex(text[i + 1 : i + 3]):
                # A bare '%' is not an escape; RFC 4475 esc02's Via branch shows it only in tokens.
                raise HeaderSyntaxError("bad %-escape in URI")
            i = text.find("%", i + 3)


def parse_sip_uri(text: str) -> SipUri:
    """Parse a sip:/sips: URI; other schemes raise (callers check `uri_scheme` first)."""
    check_uri_chars(text)
    scheme = uri_scheme(text)
    if scheme not in ("sip", "sips"):
        raise HeaderSyntaxError(f"not a SIP URI: {scheme}")
    rest = text[len(scheme) + 1 :]
    user: str | None = None
    password: str | None = None
    # userinfo may hold ';', '?', ',' (user-unreserved, RFC 4475 semiuri/intmeth); '@' never appears
    # unescaped after it, so the last '@' ends the userinfo.
    at = rest.rfind("@")
    if at >= 0:
        userinfo, rest = rest[:at], rest[at + 1 :]
        user, sep, pw = userinfo.partition(":")
        password = pw if sep else None
        if not user:
            raise HeaderSyntaxError("empty user part")
    hdrs: str | None = None
    q = rest.find("?")
    if q >= 0:
        rest, hdrs = rest[:q], rest[q + 1 :]
    sc = _Scanner(rest)
    host = _host(sc)
    port: int | None = None
    if sc.accept(":"):
        j = sc.i
        while j < sc.n and "0" <= sc.s[j] <= "9":
            j += 1
        port = _port(sc.s[sc.i : j])
        sc.i = j
    params: list[tuple[str, str | None]] = []
    tail = sc.s[sc.i :]
    if tail:
        if tail[0] != ";":
            raise HeaderSyntaxError(f"unexpected {tail[0]!r} after host")
        for item in tail[1:].split(";"):
            name, eq, value = item.partition("=")
            if not name:
                raise HeaderSyntaxError("empty URI parameter")
            params.append((name, value if eq else None))
    return SipUri(scheme, user, host, port, tuple(params), hdrs, password)


# --- name-addr / addr-spec (From, To, Contact, Route, P-Asserted-Identity) -----------------------


@dataclass(frozen=True, slots=True)
class NameAddr:
    """( name-addr / addr-spec ) *( SEMI param ): the URI text, its display name and header params."""

    uri: str
    display: str | None = None  # as written (quoted-string keeps its quotes)
    params: Params = ()

    @property
    def tag(self) -> str | None:
        t = param(self.params, "tag")
        return t or None

    @property
    def display_name(self) -> str | None:
        return None if self.display is None else unquote(self.display)

    def with_tag(self, tag: str) -> NameAddr:
        return replace(self, params=set_param(self.params, "tag", tag))

    def __str__(self) -> str:
        display = f"{self.display} " if self.display else ""
        return f"{display}<{self.uri}>{format_params(self.params)}"


def parse_name_addr(value: str, *, allow_star: bool = False) -> NameAddr:
    sc = _Scanner(value)
    sc.skip_ws()
    if allow_star and value.strip(_WS) == "*":
        return NameAddr("*")
    display: str | None = None
    if sc.peek() == '"':
        display = sc.quoted_string()
        sc.skip_ws()
        if sc.peek() != "<":
            raise HeaderSyntaxError("expected '<' after display name")
    elif "<" in value:
        # display-name = *(token LWS) / quoted-string: only tokens may precede an unquoted '<'.
        lt = value.index("<", sc.i)
        words = value[sc.i : lt].split()
        if any(not is_token(w) for w in words):
            raise HeaderSyntaxError("display name must be tokens or a quoted-string")
        display = " ".join(words) or None
        sc.i = lt
    if sc.accept("<"):
        gt = value.find(">", sc.i)
        if gt < 0:
            raise HeaderSyntaxError("missing '>'")
        uri = value[sc.i : gt]
        sc.i = gt + 1
    else:
        # addr-spec form: §20 — a URI containing ',', ';' or '?' must be in angle brackets, so the
        # URI ends at the first ';' (header parameters follow) and may not contain '?' or ','.
        j = sc.i
        while j < sc.n and sc.s[j] not in ";" + _WS:
            j += 1
        uri = value[sc.i : j]
        sc.i = j
        if "?" in uri or "," in uri:
            raise HeaderSyntaxError("URI with '?' or ',' must be enclosed in '<>'")
    if not uri:
        raise HeaderSyntaxError("empty URI")
    check_uri_chars(uri)
    scheme = uri_scheme(uri)
    if scheme in ("sip", "sips"):
        parse_sip_uri(uri)
    params = _params(sc, stop="")
    return NameAddr(uri, display, params)


def parse_name_addr_list(values: Iterable[str]) -> list[NameAddr]:
    return [parse_name_addr(item) for v in values for item in split_list(v)]


# --- CSeq (§20.16) --------------------------------------------------------------------------------

# §8.1.1.5: the sequence number MUST be expressible as a 32-bit unsigned integer and less than 2**31.
CSEQ_MAX = 2**31 - 1


@dataclass(frozen=True, slots=True)
class CSeq:
    seq: int
    method: str

    def __str__(self) -> str:
        return f"{self.seq} {self.method}"


def parse_cseq(value: str) -> CSeq:
    parts = value.split()
    if len(parts) != 2 or not is_digits(parts[0]) or not is_token(parts[1]):
        raise HeaderSyntaxError("CSeq must be '<number> <method>'")
    if len(parts[0]) > 12 or int(parts[0]) > CSEQ_MAX:
        raise HeaderSyntaxError("CSeq number out of range (must be < 2**31)")
    return CSeq(int(parts[0]), parts[1])


# --- credentials (RFC 7616 §3.4, RFC 3261 §25.1 "credentials") --------------------------------------


def parse_credentials(value: str) -> tuple[str, dict[str, str]]:
    """auth-scheme LWS auth-param *(COMMA auth-param) -> (scheme, {name(lower): unquoted value})."""
    sc = _Scanner(value)
    sc.skip_ws()
    scheme = sc.token("auth scheme")
    out: dict[str, str] = {}
    while True:
        sc.skip_ws()
        if sc.at_end():
            return scheme, out
        name = sc.token("auth-param name").lower()
        sc.skip_ws()
        sc.expect("=")
        sc.skip_ws()
        raw = sc.quoted_string() if sc.peek() == '"' else sc.token("auth-param value")
        if name in out:
            raise HeaderSyntaxError(f"duplicate auth-param {name}")
        out[name] = unquote(raw)
        sc.skip_ws()
        if sc.at_end():
            return scheme, out
        sc.expect(",")
