"""Boundary types of asr_core: what a caller passes in and what comes back.

The gateway (or `ttg transcribe`, or a test) opens a stream with `StreamOptions`, pushes 16 kHz mono
float32 PCM in [-1, 1], and receives `AsrEvent`s through a callback. Times are on the stream's own
media timeline: milliseconds since the stream's first sample.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

SAMPLE_RATE_HZ = 16_000


@dataclass(frozen=True, slots=True)
class StreamOptions:
    # A locale of the bundle's prompt table ("en-US", "uk-UA", ...) or "auto" (language ID).
    language: str = "auto"
    # Encoder lookahead in 80 ms frames (0, 3, 6, 13 for the published model); None = bundle default.
    lookahead: int | None = None


@dataclass(frozen=True, slots=True)
class Word:
    """One word of a transcript: its text, its time on the stream's media timeline (from the frames
    the model emitted its pieces at), and the joint's confidence in it (lowest piece probability)."""

    word: str
    start_ms: int
    end_ms: int
    confidence: float


@dataclass(frozen=True, slots=True)
class TranscriptEvent:
    """A partial (text may still grow) or a final (text of a closed segment) transcript.

    Invariants: within a segment, each partial's text is a prefix of the next partial's and of the
    final's; `segment_id` counts from 0 per stream; exactly one final per segment.
    """

    stream_id: str
    kind: Literal["partial", "final"]
    segment_id: int
    text: str
    start_ms: int
    end_ms: int
    token_ids: tuple[int, ...] = ()
    # Language tag the model emitted last in this segment (e.g. "uk-UA"), tags stripped from text.
    detected_language: str | None = None
    # True on the final emitted because the stream ended (not because of a pause).
    at_end_of_stream: bool = False
    # The text's words with times and confidence (finals; partials too when configured), in order:
    # start_ms <= end_ms <= next word's start_ms, all inside [start_ms, end_ms] of the event.
    words: tuple[Word, ...] = ()


@dataclass(frozen=True, slots=True)
class StreamEnded:
    """Last event of every stream: after it, nothing more arrives for `stream_id`."""

    stream_id: str
    reason: Literal["finished", "closed", "error"]
    audio_ms: int = 0
    chunks: int = 0
    dropped_chunks: int = 0
    error: str | None = None
    stats: dict[str, float] = field(default_factory=dict)


AsrEvent = TranscriptEvent | StreamEnded
# Called from engine threads: the receiver must hand the event over (e.g. call_soon_threadsafe).
EventCallback = Callable[[AsrEvent], None]
