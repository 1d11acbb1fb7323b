"""RFC 4733 telephone-events: payload format and a decoder that reports each event exactly once.

Payload (§2.3):  event (8) | E (1) R (1) volume (6) | duration (16), all in one 4-octet word.
All packets of one event carry the event's start timestamp; the duration grows; the last packet has
E set and "SHOULD be sent a total of three times" (§2.5.1.4). So an event is identified by its RTP
timestamp, and reported when its first end packet arrives. If every end packet is lost, the event is
reported when a new event starts, when `end_timeout` passes without an update, or at `finish()`.
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

# §3.2: events 0-9, *, #, A-D. 16 (flash) and above are not digits and are not reported.
DIGITS = "0123456789*#ABCD"
END_TIMEOUT_S = 0.3  # no update for this long ⇒ the end packets were lost (updates come every ~50 ms)
_PAYLOAD = struct.Struct("!BBH")


class TelephoneEvent(NamedTuple):
    event: int
    end: bool
    volume: int  # 0..63, in -dBm0
    duration: int  # in timestamp units

    def serialize(self) -> bytes:
        return _PAYLOAD.pack(self.event, (0x80 if self.end else 0) | (self.volume & 0x3F), self.duration)

    @classmethod
    def parse(cls, payload: bytes) -> TelephoneEvent:
        if len(payload) < 4:
            raise ValueError(f"telephone-event payload is {len(payload)} bytes (expected 4)")
        event, flags, duration = _PAYLOAD.unpack_from(payload)
        return cls(event, bool(flags & 0x80), flags & 0x3F, duration)


@dataclass(frozen=True, slots=True)
class DtmfEvent:
    """One reported key press; positions are samples on the media timeline (8 kHz)."""

    digit: str
    start: int
    duration: int
    end_seen: bool  # False when the end packets were lost and the event was closed by timeout


class DtmfDecoder:
    """Per-source state; `position` is the event's timestamp mapped onto the media timeline."""

    __slots__ = ("_code", "_duration", "_key", "_last_update", "_position", "_recent")

    def __init__(self) -> None:
        self._key: int | None = None  # RTP timestamp (extended) of the open event
        self._position = 0
        self._code = 0
        self._duration = 0
        self._last_update = 0.0
        self._recent: deque[int] = deque(maxlen=8)  # keys already reported (end repeats, stragglers)

    def packet(self, key: int, position: int, ev: TelephoneEvent, now: float) -> list[DtmfEvent]:
        if key in self._recent:
            return []  # a repeated end packet, or an update that arrived after the event was closed
        out: list[DtmfEvent] = []
        if self._key is not None and key != self._key:
            out += self._close(end_seen=False)  # a new event began: the previous one lost its end
        if self._key is None:
            self._key, self._position, self._code, self._duration = key, position, ev.event, 0
        self._duration = max(self._duration, ev.duration)
        self._last_update = now
        if ev.end:
            out += self._close(end_seen=True)
        return out

    def handle_timer(self, now: float) -> list[DtmfEvent]:
        if self._key is not None and now >= self._last_update + END_TIMEOUT_S:
            return self._close(end_seen=False)
        return []

    def next_deadline(self) -> float | None:
        return None if self._key is None else self._last_update + END_TIMEOUT_S

    def finish(self) -> list[DtmfEvent]:
        return self._close(end_seen=False) if self._key is not None else []

    @property
    def open_event_end(self) -> int | None:
        """Timeline position where the open event ends so far (None when no event is open)."""
        return None if self._key is None else self._position + self._duration

    def _close(self, end_seen: bool) -> list[DtmfEvent]:
        key = self._key
        assert key is not None
        self._key = None
        self._recent.append(key)
        if self._code >= len(DIGITS):
            return []
        return [DtmfEvent(DIGITS[self._code], self._position, self._duration, end_seen)]
