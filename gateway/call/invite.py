"""What a call takes from its INVITE: the dialed number, the language, and the call_start metadata.

Pure functions of the request (and of the flow it came on); the call core calls them once per call.
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Mapping, Sequence

from gateway.sip.agent import Flow
from gateway.sip.headers import HeaderSyntaxError, parse_sip_uri, unescape, uri_scheme
from gateway.sip.message import SipRequest

# A language value we pass on: a BCP 47-ish locale ("en-US", "uk-UA", "yue") or "auto".
_LOCALE_RE = re.compile(r"^(auto|[A-Za-z]{2,3}(-[A-Za-z0-9]{2,8}){0,3})$")
MAX_METADATA_HEADERS = 32
MAX_METADATA_VALUE = 512


def dialed_number(request: SipRequest) -> str:
    """The DNIS: the user part of the Request-URI (else of To), or its tel: number, unescaped; '' if none."""
    return next((user for user in (_user_of(request.uri), _user_of(request.to.uri)) if user), "")


def _user_of(uri: str) -> str:
    """The user part of a sip:/sips: URI or the number of a tel: URI, unescaped, without parameters."""
    try:
        if uri_scheme(uri) == "tel":
            return unescape(uri[4:].split(";", 1)[0])
        return (parse_sip_uri(uri).user_unescaped or "").split(";", 1)[0]
    except HeaderSyntaxError:
        return ""


def choose_language(
    request: SipRequest, *, header: str, dnis_languages: Mapping[str, str], default: str
) -> tuple[str, str]:
    """(language, where it came from): the header if it holds a locale, else the dialed-number map
    (exact match first, then the longest `prefix*` entry), else the default."""
    value = (request.headers.get(header) or "").strip() if header else ""
    if value and _LOCALE_RE.match(value):
        return value, "header"
    dnis = dialed_number(request)
    if dnis:
        if dnis in dnis_languages:
            return dnis_languages[dnis], "dnis"
        best = ""
        for key in dnis_languages:
            if key.endswith("*") and dnis.startswith(key[:-1]) and len(key) > len(best):
                best = key
        if best:
            return dnis_languages[best], "dnis"
    return default, "default"


def call_metadata(request: SipRequest, flow: Flow, allow: Sequence[str]) -> dict[str, str]:
    """call_start fields: From/To (as sent), caller and dialed numbers, P-Asserted-Identity, the
    allow-listed headers (JSON object, names as sent, values capped) and where the call came from."""
    headers: dict[str, str] = {}
    patterns = [p.lower() for p in allow]
    for name, value in request.headers:
        if len(headers) >= MAX_METADATA_HEADERS:
            break
        if any(fnmatch.fnmatchcase(name.lower(), p) for p in patterns) and name not in headers:
            headers[name] = value[:MAX_METADATA_VALUE]
    return {
        "from": request.headers.get("From") or "",
        "to": request.headers.get("To") or "",
        "ani": _user_of(request.from_.uri),
        "dnis": dialed_number(request),
        "pai": request.headers.get("P-Asserted-Identity") or "",
        "headers": json.dumps(headers, ensure_ascii=False, sort_keys=True),
        "source": f"{flow.remote[0]}:{flow.remote[1]}",
        "transport": flow.transport,
    }
