"""A SIPREC recording session as the call sees it (RFC 7866): the offer's parts, and one name per leg.

Pure functions of a request's headers and body and of the SDP negotiation:

    body = read_offer_body(content_type, payload)        # BodyError / MetadataError: 4xx
    kind = session_kind(require_tags, contact_values, body)  # recording or plain
    names = name_legs(negotiation.accepted, metadata, recording=…, taken=…)   # m= index -> leg

A leg is named once, when its stream is first accepted, and keeps its name for the rest of the call
(events of one call+leg carry a gapless seq; a renamed leg would start another sequence). The name:

- the sending participant's role, `caller` or `callee`, where the metadata says who placed the call
  (gateway.siprec.metadata.roles);
- else that participant's stable id (RFC 7865 participant_id), so consumers can still tell the
  speakers apart and look them up in call_start's `participants`;
- `mixed` for a stream several participants send (`<mode>mixed</mode>`, or a single-stream SIPREC
  session such as Metaswitch's);
- without metadata for the stream: `caller` for the one stream of a plain call (as before SIPREC),
  else `stream-<label>` or `stream-<m-line number>`.

The leg is never inferred from the label's value: Ribbon/Sonus send the calling party on label 2,
Avaya labels are large numbers, BroadWorks uses 10/20 (research notes, telephony §1.2).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from gateway.sdp import MediaPlan
from gateway.siprec.metadata import MetadataError, RecordingMetadata, parse_metadata, roles
from gateway.siprec.multipart import BodyError, BodyPart, media_type, parse_multipart

SIPREC_OPTION_TAG = "siprec"  # RFC 7866 option tag (Require / Supported)
SRC_FEATURE_TAG = "+sip.src"  # RFC 7866 media feature tag (RFC 3840) in the SRC's Contact
SRS_FEATURE_TAG = "+sip.srs"  # ... and in the SRS's Contact
METADATA_TYPES = frozenset({"application/rs-metadata+xml", "application/rs-metadata"})
METADATA_DISPOSITION = "recording-session"  # RFC 7866 Content-Disposition of the metadata
# What an INVITE body may be: the Accept header of a 415.
ACCEPTED_TYPES = ("application/sdp", "multipart/mixed", "application/rs-metadata+xml")

MIXED = "mixed"
CALLER = "caller"
MAX_LEG_NAME = 64
# Leg names end up in Redis keys and in event ids `<call_id>:<leg>:<seq>`: no ':' and no spaces.
_UNSAFE = re.compile(r"[^A-Za-z0-9._~+/=@-]")

SessionKind = Literal["plain", "recording"]


@dataclass(frozen=True, slots=True)
class OfferBody:
    """What an INVITE/re-INVITE body holds: the SDP (None: no offer) and the recording metadata."""

    sdp: bytes | None = None
    metadata: RecordingMetadata | None = None
    multipart: bool = False


def read_offer_body(content_type: str | None, payload: bytes) -> OfferBody:
    """Split a request body into its SDP and its recording metadata.

    `application/sdp` is the offer alone; `multipart/mixed` (RFC 7866) holds one SDP part and at most
    one metadata part (`application/rs-metadata+xml`, the draft-era `application/rs-metadata`, or any
    part with `Content-Disposition: recording-session`); a bare metadata body is a metadata-only update.
    Unknown parts are ignored unless marked `handling=required` (RFC 5621 §9.1: 415).
    Raises BodyError (400/415) or MetadataError (400).
    """
    if not payload:
        return OfferBody()
    kind = media_type(content_type)
    if kind == "application/sdp":
        return OfferBody(sdp=payload)
    if kind in METADATA_TYPES:
        return OfferBody(metadata=parse_metadata(payload))
    if kind != "multipart/mixed":
        raise BodyError(f"unsupported body type {kind[:60] or '(none)'!r}", 415)
    assert content_type is not None
    sdp: bytes | None = None
    metadata: RecordingMetadata | None = None
    for part in parse_multipart(content_type, payload):
        if part.content_type == "application/sdp":
            if sdp is not None:
                raise BodyError("multipart body with two SDP parts")
            sdp = part.body
        elif _is_metadata(part):
            if metadata is not None:
                raise BodyError("multipart body with two recording metadata parts")
            metadata = parse_metadata(part.body)
        elif part.required:
            raise BodyError(f"required body part of unsupported type {part.content_type[:60]!r}", 415)
    return OfferBody(sdp=sdp, metadata=metadata, multipart=True)


def _is_metadata(part: BodyPart) -> bool:
    return part.content_type in METADATA_TYPES or part.disposition == METADATA_DISPOSITION


def is_src_contact(contact_values: Iterable[str]) -> bool:
    """RFC 7866: an SRC puts the `+sip.src` feature tag (RFC 3840) in its Contact."""
    for value in contact_values:
        uri_end = value.rfind(">")
        params = value[uri_end + 1 :] if uri_end >= 0 else value
        if any(p.strip().split("=", 1)[0].lower() == SRC_FEATURE_TAG for p in params.split(";")[1:]):
            return True
    return False


def session_kind(require: Collection[str], contact_values: Iterable[str], body: OfferBody) -> SessionKind:
    """A recording session when the SRC says so (RFC 7866: `Require: siprec` and a `+sip.src`
    Contact) or sends recording metadata: some SRCs send one without the other."""
    tags = {t.lower() for t in require}
    if body.metadata is not None:
        return "recording"
    if SIPREC_OPTION_TAG in tags and is_src_contact(contact_values):
        return "recording"
    return "plain"


def stream_limit(kind: SessionKind, *, max_streams: int, multi_leg_calls: bool) -> int:
    """How many m=audio lines of an offer become legs: every one up to `max_streams` for a recording
    session (one per recorded stream) or for a plain call when multi-leg calls are allowed; else only
    the first, as a trunk call always had."""
    if kind == "recording" or multi_leg_calls:
        return max_streams
    return 1


def safe_leg_name(text: str) -> str:
    """A leg name usable in keys and event ids: unsafe characters become '_', at most 64 characters."""
    return _UNSAFE.sub("_", text.strip())[:MAX_LEG_NAME]


def name_legs(
    plans: Sequence[MediaPlan],
    metadata: RecordingMetadata | None,
    *,
    recording: bool,
    named: Mapping[int, str] | None = None,
) -> dict[int, str]:
    """Leg names for the accepted streams, by m= line index (see the module docstring).

    `named` holds the names legs of this call already have (index -> name): they are kept, and a new
    leg never takes one of them (a clash gets `-<m-line number>` appended).
    """
    named = dict(named or {})
    found = roles(metadata) if metadata is not None else {}
    single = len(plans) == 1
    out: dict[int, str] = {}
    for plan in plans:
        if plan.index in named:
            out[plan.index] = named[plan.index]
            continue
        name = _name_from_metadata(plan, metadata, found) if metadata is not None else ""
        if not name:
            if single and not named:
                name = MIXED if recording else CALLER
            elif plan.label:
                name = safe_leg_name(f"stream-{plan.label}")
            else:
                name = f"stream-{plan.index + 1}"
        taken = set(named.values()) | set(out.values())
        if name in taken:
            name = f"{name[: MAX_LEG_NAME - 4]}-{plan.index + 1}"
        out[plan.index] = name
    return out


def _name_from_metadata(plan: MediaPlan, metadata: RecordingMetadata, found: Mapping[str, str]) -> str:
    if plan.label is None:
        return ""
    stream = metadata.stream_by_label(plan.label)
    if stream is None:
        return ""
    senders = metadata.senders(stream.id)
    if stream.mode == MIXED or len(senders) > 1:
        return MIXED
    if len(senders) == 1:
        sender = senders[0]
        return found.get(sender.id) or safe_leg_name(sender.id)
    return ""


def participants_field(
    metadata: RecordingMetadata, legs: Mapping[int, str], plans: Sequence[MediaPlan]
) -> str:
    """call_start's `participants`: a JSON list, one object per participant of the recorded session:
    `id` (RFC 7865 participant_id), `name`, `aor`, `name_addr`, `role` (caller/callee/''), and `legs`
    (the names of the legs that carry what this participant says)."""
    found = roles(metadata)
    leg_of_label = {p.label: legs[p.index] for p in plans if p.label is not None and p.index in legs}
    out = []
    for p in metadata.participants:
        sent = [leg_of_label[s.label] for s in metadata.streams if s.id in p.send and s.label in leg_of_label]
        out.append(
            {
                "id": p.id,
                "name": p.name,
                "aor": p.aor,
                "name_addr": p.name_addr,
                "role": found.get(p.id, ""),
                "legs": sent,
            }
        )
    return json.dumps(out, ensure_ascii=False, separators=(",", ":"))


__all__ = [
    "ACCEPTED_TYPES",
    "CALLER",
    "MIXED",
    "SIPREC_OPTION_TAG",
    "SRC_FEATURE_TAG",
    "SRS_FEATURE_TAG",
    "BodyError",
    "MetadataError",
    "OfferBody",
    "is_src_contact",
    "name_legs",
    "participants_field",
    "read_offer_body",
    "safe_leg_name",
    "session_kind",
    "stream_limit",
]
