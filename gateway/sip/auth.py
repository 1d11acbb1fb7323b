"""Digest authentication of incoming INVITEs (RFC 7616 over SIP as in RFC 3261 §22.4, RFC 8760) — pure.

The gateway is a UAS, so it challenges with 401 + WWW-Authenticate (§22.2). Nonces are stateless:
`base64(timestamp || HMAC-SHA256(secret, timestamp || realm)[:16])`, valid for `nonce_ttl_s`; an
expired but genuine nonce gets a new challenge with `stale=true` (RFC 7616 §3.3) so the caller retries
without asking its user. With qop=auth the nonce count must grow per nonce (replay guard; the table of
seen nonces is bounded). `-sess` variants are accepted. Comparisons are constant-time.

Algorithms (RFC 8760): one WWW-Authenticate per algorithm of `algorithms`, in that order, sharing
one nonce. §2.4 asks UACs to use the topmost challenge they support; clients that know only MD5 and
read just the first challenge give up, or crash, when it names SHA-256 (sipvicious 0.3). So the
default order is MD5, then SHA-256: such clients and every client that picks the challenge it
supports authenticate, and a SHA-256-only client still finds its challenge. The price is that a
client supporting both also picks MD5; deployments whose peers all speak SHA-256 list it first or
alone (TTG_SIP__DIGEST_ALGORITHMS). One known client survives no order: libre up to 1.1 (baresip
1.0, Debian 12) refuses a 401 in which *any* challenge is not MD5 ("Function not implemented");
for such peers the list must be ["MD5"]. Either way the password never crosses the wire; what MD5
weakens is an offline guess from a captured exchange.

Throttling and bans of guessers live in admission.py; this core only says OK, MISSING, STALE or
REJECTED.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import hmac
import secrets
import struct
from collections import OrderedDict
from dataclasses import dataclass, field

from gateway.sip.headers import HeaderSyntaxError, parse_credentials, parse_sip_uri, quote

_HASHES = {"MD5": hashlib.md5, "SHA-256": hashlib.sha256}


@dataclass(frozen=True, slots=True)
class DigestConfig:
    realm: str
    username: str
    password: str
    algorithms: tuple[str, ...] = ("MD5", "SHA-256")  # challenge order: see the module docstring
    nonce_ttl_s: float = 300.0
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))


class AuthResult(enum.Enum):
    OK = "ok"
    MISSING = "missing"  # no (usable) credentials: challenge
    STALE = "stale"  # a genuine nonce that expired: challenge with stale=true
    REJECTED = "rejected"  # wrong password, user, realm, uri, or a replay: 403


def _h(algorithm: str, text: str) -> str:
    # surrogateescape: a user name that was not UTF-8 is hashed as the bytes the client hashed.
    return _HASHES[algorithm](text.encode("utf-8", "surrogateescape")).hexdigest()


class DigestAuthenticator:
    """Builds challenges and verifies `Authorization` header values for one realm/user."""

    def __init__(self, config: DigestConfig, max_tracked_nonces: int = 4096) -> None:
        for alg in config.algorithms:
            if alg not in _HASHES:
                raise ValueError(f"unsupported digest algorithm {alg!r} (MD5, SHA-256)")
        self.config = config
        self._nc_seen: OrderedDict[str, int] = OrderedDict()
        self._max_tracked = max_tracked_nonces

    # --- nonces ---

    def make_nonce(self, now: float) -> str:
        stamp = struct.pack(">d", now)
        mac = hmac.new(self.config.secret, stamp + self.config.realm.encode(), hashlib.sha256).digest()[:16]
        return base64.b64encode(stamp + mac).decode("ascii")

    def _nonce_state(self, nonce: str, now: float) -> AuthResult:
        try:
            raw = base64.b64decode(nonce.encode("ascii"), validate=True)
        except (ValueError, UnicodeEncodeError):
            return AuthResult.MISSING
        if len(raw) != 24:
            return AuthResult.MISSING
        stamp, mac = raw[:8], raw[8:]
        good = hmac.new(self.config.secret, stamp + self.config.realm.encode(), hashlib.sha256).digest()[:16]
        if not hmac.compare_digest(mac, good):
            return AuthResult.MISSING  # not ours (e.g. from before a restart): a fresh challenge
        (issued,) = struct.unpack(">d", stamp)
        if not issued <= now + 1.0 or now - issued > self.config.nonce_ttl_s:
            return AuthResult.STALE
        return AuthResult.OK

    # --- challenge ---

    def challenges(self, now: float, *, stale: bool = False) -> list[str]:
        """WWW-Authenticate values, one per algorithm, sharing one nonce."""
        nonce = self.make_nonce(now)
        out = []
        for alg in self.config.algorithms:
            value = (
                f'Digest realm={quote(self.config.realm)}, nonce={quote(nonce)}, algorithm={alg}, qop="auth"'
            )
            if stale:
                value += ", stale=true"
            out.append(value)
        return out

    # --- verification ---

    def verify(self, method: str, request_uri: str, authorizations: list[str], now: float) -> AuthResult:
        """Check the request's Authorization values (one per realm may be present, §22.4)."""
        result = AuthResult.MISSING
        for value in authorizations:
            try:
                scheme, p = parse_credentials(value)
            except HeaderSyntaxError:
                continue
            if scheme.lower() != "digest" or p.get("realm") != self.config.realm:
                continue  # another scheme/realm (RFC 4475 regaut01): not ours to judge
            result = self._verify_one(method, request_uri, p, now)
            if result is AuthResult.OK:
                return result
        return result

    def _verify_one(self, method: str, request_uri: str, p: dict[str, str], now: float) -> AuthResult:
        required = ("username", "realm", "nonce", "uri", "response")
        if any(k not in p for k in required):
            return AuthResult.REJECTED
        algorithm = p.get("algorithm", "MD5")
        sess = algorithm.upper().endswith("-SESS")
        base_alg = algorithm[:-5] if sess else algorithm
        base_alg = {"md5": "MD5", "sha-256": "SHA-256"}.get(base_alg.lower(), base_alg)
        if base_alg not in self.config.algorithms:
            return AuthResult.REJECTED
        nonce_state = self._nonce_state(p["nonce"], now)
        if nonce_state is not AuthResult.OK:
            return nonce_state
        if not _same_target(p["uri"], request_uri):
            return AuthResult.REJECTED
        qop = p.get("qop")
        cnonce = p.get("cnonce", "")
        nc = p.get("nc", "")
        if qop is not None and (qop != "auth" or not cnonce or len(nc) != 8):
            return AuthResult.REJECTED
        if sess and not cnonce:
            return AuthResult.REJECTED
        ha1 = _h(base_alg, f"{self.config.username}:{self.config.realm}:{self.config.password}")
        if sess:
            ha1 = _h(base_alg, f"{ha1}:{p['nonce']}:{cnonce}")
        ha2 = _h(base_alg, f"{method}:{p['uri']}")
        if qop:
            expected = _h(base_alg, f"{ha1}:{p['nonce']}:{nc}:{cnonce}:{qop}:{ha2}")
        else:
            expected = _h(base_alg, f"{ha1}:{p['nonce']}:{ha2}")
        user_ok = hmac.compare_digest(_raw(p["username"]), _raw(self.config.username))
        if not (hmac.compare_digest(_raw(p["response"].lower()), expected.encode()) and user_ok):
            return AuthResult.REJECTED
        if qop:
            try:
                count = int(nc, 16)
            except ValueError:
                return AuthResult.REJECTED
            last = self._nc_seen.get(p["nonce"], 0)
            if count <= last:
                return AuthResult.REJECTED  # replayed
            self._nc_seen[p["nonce"]] = count
            self._nc_seen.move_to_end(p["nonce"])
            while len(self._nc_seen) > self._max_tracked:
                self._nc_seen.popitem(last=False)
        return AuthResult.OK


def _raw(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def authorization_header(
    *,
    username: str,
    password: str,
    realm: str,
    nonce: str,
    method: str,
    uri: str,
    algorithm: str = "MD5",
    qop: str | None = "auth",
    nc: int = 1,
    cnonce: str = "0a4f113b",
) -> str:
    """A client's Authorization value (used by tests and the replay tool's UAC)."""
    base = algorithm[:-5] if algorithm.upper().endswith("-SESS") else algorithm
    ha1 = _h(base, f"{username}:{realm}:{password}")
    if algorithm.upper().endswith("-SESS"):
        ha1 = _h(base, f"{ha1}:{nonce}:{cnonce}")
    ha2 = _h(base, f"{method}:{uri}")
    ncs = f"{nc:08x}"
    if qop:
        resp = _h(base, f"{ha1}:{nonce}:{ncs}:{cnonce}:{qop}:{ha2}")
        extra = f", qop={qop}, nc={ncs}, cnonce={quote(cnonce)}"
    else:
        resp = _h(base, f"{ha1}:{nonce}:{ha2}")
        extra = ""
    return (
        f"Digest username={quote(username)}, realm={quote(realm)}, nonce={quote(nonce)}, "
        f"uri={quote(uri)}, response={quote(resp)}, algorithm={algorithm}{extra}"
    )


def _same_target(digest_uri: str, request_uri: str) -> bool:
    """RFC 7616 §3.4.6 / RFC 2617 §3.2.2.5: the digest-uri must name the resource of the Request-URI.

    Equal URIs do; so does a user-less SIP URI of the same host and port, which is what many UACs
    (sipp among them) send: for a trunk gateway the resource is the gateway itself. The digest covers
    the uri the client chose, so this widens nothing an eavesdropper could replay (nonce + nc guard that).
    """
    if digest_uri == request_uri:
        return True
    try:
        d, r = parse_sip_uri(digest_uri), parse_sip_uri(request_uri)
    except HeaderSyntaxError:
        return False
    return d.user is None and d.scheme == r.scheme and d.host.lower() == r.host.lower() and d.port == r.port
