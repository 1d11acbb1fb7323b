"""`multipart/mixed` message bodies (RFC 2046 §5.1) as SIP carries them (RFC 5621).

A SIPREC INVITE (RFC 7866 §8) carries its SDP offer and its recording metadata as two parts of one
`multipart/mixed` body; some SRCs add parts of their own (Cisco CUBE: `application/gtd` with
`Content-Disposition: signal;handling=optional`). The framing is the standard library's MIME parser
(`email`), which follows RFC 2046's delimiter rules (the CRLF before a boundary belongs to the
boundary, transport padding after it is ignored); this module maps its defects to SIP answers and
reads each part's Content-Type and Content-Disposition (RFC 3261 §20.11, RFC 5621 §9).
"""

from __future__ import annotations

import email.parser
import email.policy
from dataclasses import dataclass
from email import errors as email_errors
from email.message import Message

# A SIPREC body has two or three parts; anything far beyond that is not a recording offer.
MAX_PARTS = 16
# RFC 2046 §5.1.1: "boundary := 0*69<bchars> bcharsnospace" (1 to 70 characters).
MAX_BOUNDARY = 70


class BodyError(ValueError):
    """A message body the gateway cannot use; `status` is the SIP answer (RFC 3261 §21.4)."""

    def __init__(self, reason: str, status: int = 400) -> None:
        super().__init__(reason)
        self.status = status


@dataclass(frozen=True, slots=True)
class BodyPart:
    """One body part: its media type (lower case, no parameters), disposition and content."""

    content_type: str
    disposition: str | None  # disposition type, lower case; None when the part has no Content-Disposition
    handling: str | None  # the disposition's handling parameter ("required"/"optional") when given
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def required(self) -> bool:
        """RFC 5621 §9.1: a part marked `handling=required` that the UAS cannot process fails the request.

        RFC 3261 §20.11 says to assume `required` when the parameter is missing; SRCs add vendor parts
        without it, so only an explicit `handling=required` makes an unknown part fatal here.
        """
        return self.handling == "required"


def media_type(content_type: str | None) -> str:
    """The `type/subtype` of a Content-Type value, lower case ('' for None)."""
    return "" if content_type is None else content_type.split(";", 1)[0].strip().lower()


def parse_multipart(content_type: str, body: bytes) -> list[BodyPart]:
    """The parts of a `multipart/*` body; BodyError(400) when it cannot be framed.

    RFC 2046 §5.1.1: the boundary parameter is mandatory; a body with no delimiter line, or only a
    preamble, has no parts. A missing close delimiter is tolerated (the last part ends with the body)
    because it loses nothing and some SRCs omit it.
    """
    parser = email.parser.BytesParser(policy=email.policy.compat32)
    header = " ".join(content_type.split()).encode("utf-8", "replace")  # one line, whatever was in it
    message = parser.parsebytes(b"Content-Type: " + header + b"\r\n\r\n" + body)
    if message.get_content_maintype() != "multipart":
        raise BodyError(f"not a multipart type: {media_type(content_type)!r}", 415)
    boundary = message.get_boundary()
    if not boundary:
        raise BodyError("multipart body without a boundary parameter (RFC 2046 §5.1.1)")
    if len(boundary) > MAX_BOUNDARY:
        raise BodyError(f"multipart boundary longer than {MAX_BOUNDARY} characters (RFC 2046 §5.1.1)")
    for defect in message.defects:
        if isinstance(
            defect, email_errors.StartBoundaryNotFoundDefect | email_errors.NoBoundaryInMultipartDefect
        ):
            raise BodyError(f"multipart body has no line '--{boundary}' (RFC 2046 §5.1.1)")
    payload = message.get_payload()
    if not isinstance(payload, list) or not payload:
        raise BodyError("multipart body has no parts")
    if len(payload) > MAX_PARTS:
        raise BodyError(f"multipart body has {len(payload)} parts (limit {MAX_PARTS})")
    parts: list[BodyPart] = []
    for part in payload:
        if not isinstance(part, Message):
            raise BodyError("multipart body part could not be read")
        raw = part.get_payload(decode=True)
        data = raw if isinstance(raw, bytes) else b""
        disposition = part.get("Content-Disposition")
        handling = part.get_param("handling", header="Content-Disposition") if disposition else None
        parts.append(
            BodyPart(
                content_type=part.get_content_type(),  # RFC 2046 §5.1: text/plain when absent
                disposition=None if disposition is None else media_type(disposition) or None,
                handling=handling.strip().lower() if isinstance(handling, str) else None,
                body=data,
                headers=tuple((str(k), str(v)) for k, v in part.items()),
            )
        )
    return parts
