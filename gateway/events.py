"""Call events, schema v1: what the gateway publishes for consumers (Redis Streams).

A `CallEvent` is created by a call's session; the sink assigns `seq` (gapless per call+leg, in the
order events are committed for publishing) and turns it into one flat hash per XADD.
Field names and meanings: DESIGN.md "Redis events" and docs/events.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

SCHEMA_VERSION = "1"

EventType = Literal["call_start", "partial", "final", "dtmf", "call_end"]
# Events that must never be lost or duplicated (spooled to disk while Redis is down).
DURABLE_TYPES: frozenset[str] = frozenset({"call_start", "final", "call_end"})


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
    ts: float = 0.0  # wall-clock time the event was created (UNIX seconds)
    # call_start: from, to, headers (JSON), model, codec ...; call_end: reason, rtp_* counters ...
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def durable(self) -> bool:
        return self.type in DURABLE_TYPES


def event_id(call_id: str, leg: str, seq: int) -> str:
    return f"{call_id}:{leg}:{seq}"


def to_fields(ev: CallEvent, seq: int) -> dict[str, str]:
    """The flat string hash stored by XADD (schema v1)."""
    fields: dict[str, str] = {
        "v": SCHEMA_VERSION,
        "type": ev.type,
        "event_id": event_id(ev.call_id, ev.leg, seq),
        "call_id": ev.call_id,
        "sip_call_id": ev.sip_call_id,
        "leg": ev.leg,
        "seq": str(seq),
        "segment_id": "" if ev.segment_id is None else str(ev.segment_id),
        "text": ev.text,
        "start_ms": "" if ev.start_ms is None else str(ev.start_ms),
        "end_ms": "" if ev.end_ms is None else str(ev.end_ms),
        "ts": f"{ev.ts:.6f}",
        "lang": ev.lang,
    }
    for key, value in ev.extra.items():
        if key in fields:
            raise ValueError(f"extra field {key!r} would overwrite a schema field")
        fields[key] = value
    return fields
