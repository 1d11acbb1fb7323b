"""Call events, schema v1: what the gateway publishes for consumers (Redis Streams).

A call's session creates `CallEvent`s and hands them to an `EventPublisher` (the sink), which never
blocks. The sink assigns `seq` when it commits an event for publishing: gapless per call+leg,
starting at 1, in commit order; an event dropped before its commit (a stale partial while Redis is
down) never gets one. `to_fields` turns an event into the flat string hash of one XADD.
Field names and meanings: DESIGN.md "Redis events"; the consumer's view: docs/events.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, cast, get_args

from asr_core.api import Word

SCHEMA_VERSION = "1"

EventType = Literal["call_start", "partial", "final", "dtmf", "call_end"]
EVENT_TYPES: tuple[str, ...] = get_args(EventType)
# Events that must never be lost or duplicated: they wait in the spool (on disk) while Redis is down.
# DTMF is durable too: a handful per call, and a consumer acting on digits cannot re-derive them.
DURABLE_TYPES: frozenset[str] = frozenset({"call_start", "final", "dtmf", "call_end"})

# Fields every event carries, in this order (the flat XADD hash; empty string = not applicable).
BASE_FIELDS: tuple[str, ...] = (
    "v",
    "type",
    "event_id",
    "call_id",
    "sip_call_id",
    "leg",
    "seq",
    "segment_id",
    "text",
    "start_ms",
    "end_ms",
    "ts",
    "lang",
)


@dataclass(frozen=True, slots=True)
class CallEvent:
    type: EventType
    call_id: str  # the gateway's id for the call (stable, unique)
    sip_call_id: str  # the SIP Call-ID header of the dialog
    leg: str = "caller"  # trunk mode has one leg; SIPREC would add "callee"
    segment_id: int | None = None  # partial/final: utterance number within the call+leg
    text: str = ""  # partial/final: transcript; dtmf: the digit
    start_ms: int | None = None  # media timeline of the leg (ms since its first RTP sample)
    end_ms: int | None = None
    lang: str = ""
    ts: float = 0.0  # wall-clock time the event happened (UNIX seconds); 0 = stamped by the sink
    # call_start: from, to, headers (JSON), model, codec ...; call_end: reason, rtp_* counters ...
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def durable(self) -> bool:
        return self.type in DURABLE_TYPES


class EventPublisher(Protocol):
    def publish(self, ev: CallEvent) -> None:
        """Hand an event over for publishing; returns at once (never blocks, never raises on Redis)."""


def words_json(words: Sequence[Word]) -> str:
    """The `words` field of partial/final events: a JSON array of {word, start_ms, end_ms,
    confidence} in text order, times on the leg's media timeline (docs/events.md)."""
    return json.dumps(
        [
            {"word": w.word, "start_ms": w.start_ms, "end_ms": w.end_ms, "confidence": w.confidence}
            for w in words
        ],
        ensure_ascii=False,
        separators=(",", ":"),
    )


def event_id(call_id: str, leg: str, seq: int) -> str:
    return f"{call_id}:{leg}:{seq}"


def _utf8(text: str) -> str:
    # Header values decoded with surrogateescape may hold lone surrogates, which UTF-8 cannot encode:
    # replace them rather than fail the whole Redis batch. Valid text of any language passes unchanged.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def to_fields(ev: CallEvent, seq: int) -> dict[str, str]:
    """The flat string hash stored by XADD (schema v1)."""
    fields: dict[str, str] = {
        "v": SCHEMA_VERSION,
        "type": ev.type,
        "event_id": event_id(ev.call_id, ev.leg, seq),
        "call_id": ev.call_id,
        "sip_call_id": _utf8(ev.sip_call_id),
        "leg": ev.leg,
        "seq": str(seq),
        "segment_id": "" if ev.segment_id is None else str(ev.segment_id),
        "text": _utf8(ev.text),
        "start_ms": "" if ev.start_ms is None else str(ev.start_ms),
        "end_ms": "" if ev.end_ms is None else str(ev.end_ms),
        "ts": f"{ev.ts:.6f}",
        "lang": ev.lang,
    }
    for key, value in ev.extra.items():
        if key in fields:
            raise ValueError(f"extra field {key!r} would overwrite a schema field")
        fields[key] = _utf8(value)
    return fields


def from_fields(fields: Mapping[str, str]) -> tuple[CallEvent, int]:
    """Inverse of `to_fields`: the event and its seq (for consumers, `ttg tail` and audits)."""
    if fields.get("v") != SCHEMA_VERSION:
        raise ValueError(f"unsupported schema version {fields.get('v')!r}")
    kind = fields["type"]
    if kind not in EVENT_TYPES:
        raise ValueError(f"unknown event type {kind!r}")

    def opt_int(name: str) -> int | None:
        value = fields.get(name, "")
        return int(value) if value else None

    ev = CallEvent(
        type=cast(EventType, kind),  # checked against EVENT_TYPES above
        call_id=fields["call_id"],
        sip_call_id=fields.get("sip_call_id", ""),
        leg=fields.get("leg", "caller"),
        segment_id=opt_int("segment_id"),
        text=fields.get("text", ""),
        start_ms=opt_int("start_ms"),
        end_ms=opt_int("end_ms"),
        lang=fields.get("lang", ""),
        ts=float(fields.get("ts") or 0.0),
        extra={k: v for k, v in fields.items() if k not in BASE_FIELDS},
    )
    return ev, int(fields["seq"])
