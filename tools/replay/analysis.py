"""The report's numbers as pure functions of what was sent and what came back from Redis.

Definitions (docs/replay.md has the long form):
- An event *covers* an utterance when its media span [start_ms, end_ms] overlaps the utterance's
  speech span widened by `margin_ms` on both sides, and it arrived after the utterance's first speech
  packet was sent (no transcript can contain words that were not sent yet).
- time to first partial (TTFP) = arrival of the first event (partial or final) covering the utterance
  − send time of the packet carrying its first speech sample.
- time to final (TTF) = arrival of the last final covering the utterance − send time of the packet
  carrying its last speech sample ("the last word before a pause → the final transcript"). A final
  that merges two utterances counts for both, so a missed endpoint shows up as a long TTF.
- TTF as published: the same, from the moment redis-server stored that final (its entry ID's
  milliseconds, on the replay's clock) instead of the moment the replay read it: what the gateway
  took, without the replay's own lag in reading (both on one host's clock; None when not known).
- Events without a media span are matched by order: the k-th final closes the k-th utterance.
- finals outside: finals whose media span covers no utterance (a late word past the margin, words
  made up in silence); counted, since TTF cannot see them.
- partial stability: a partial is unstable when its text is not a prefix of the next partial or the
  final of the same segment (whitespace collapsed, case kept): share of unstable partials.
- WER: jiwer on lower-cased text without punctuation, corpus-level over calls (errors / ref words).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import jiwer
import numpy as np

DEFAULT_MARGIN_MS = 200

_WER_TRANSFORM = jiwer.Compose(
    [
        jiwer.ToLowerCase(),
        jiwer.RemovePunctuation(),
        jiwer.RemoveMultipleSpaces(),
        jiwer.Strip(),
        jiwer.ReduceToListOfListOfWords(),
    ]
)


def _opt_int(value: str | None) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class ReceivedEvent:
    """One schema-v1 event read from the stream, with the time the reader got it (monotonic s) and,
    where known, the time redis-server stored it (`published`, on the same clock)."""

    type: str
    seq: int
    arrival: float
    segment_id: int | None = None
    text: str = ""
    start_ms: int | None = None
    end_ms: int | None = None
    ts: float = 0.0
    entry_id: str = ""
    fields: dict[str, str] = field(default_factory=dict)
    published: float | None = None

    @classmethod
    def from_fields(
        cls, fields: dict[str, str], arrival: float, entry_id: str = "", published: float | None = None
    ) -> ReceivedEvent:
        try:
            ts = float(fields.get("ts", "") or 0.0)
        except ValueError:
            ts = 0.0
        return cls(
            type=fields.get("type", ""),
            seq=_opt_int(fields.get("seq")) or 0,
            arrival=arrival,
            segment_id=_opt_int(fields.get("segment_id")),
            text=fields.get("text", ""),
            start_ms=_opt_int(fields.get("start_ms")),
            end_ms=_opt_int(fields.get("end_ms")),
            ts=ts,
            entry_id=entry_id,
            published=published,
            fields=dict(fields),
        )


@dataclass(frozen=True, slots=True)
class Stats:
    n: int
    mean: float | None = None
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    min: float | None = None
    max: float | None = None


def stats(values: Iterable[float]) -> Stats:
    """Mean and percentiles (numpy's linear interpolation between order statistics)."""
    arr = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
    if arr.size == 0:
        return Stats(0)
    p50, p95, p99 = np.percentile(arr, [50, 95, 99])
    return Stats(
        n=int(arr.size),
        mean=float(arr.mean()),
        p50=float(p50),
        p95=float(p95),
        p99=float(p99),
        min=float(arr.min()),
        max=float(arr.max()),
    )


def p95_nearest_rank(values: Iterable[float]) -> float | None:
    """The 95th percentile by nearest rank on the upper side (None for no values), so that a missing
    final counted as +inf is never interpolated into a finite number."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


@dataclass(frozen=True, slots=True)
class UtteranceTiming:
    """What was sent: the speech span on the call's media timeline and when its edges were sent."""

    start_ms: int
    end_ms: int
    start_t: float | None  # None: the call ended before this packet was sent
    end_t: float | None
    sentence: str = ""  # "clip#k" (`CallUtterance.sentence`)


@dataclass(frozen=True, slots=True)
class UtteranceResult:
    start_ms: int
    end_ms: int
    ttfp_s: float | None
    ttf_s: float | None
    finals: int  # finals covering this utterance
    sentence: str = ""  # "clip#k": which sentence was spoken (a model may say nothing for one)
    ttf_published_s: float | None = None  # TTF to the final's XADD (module docstring)


def _covers(ev: ReceivedEvent, u: UtteranceTiming, margin_ms: int) -> bool:
    assert ev.start_ms is not None and ev.end_ms is not None
    return ev.start_ms <= u.end_ms + margin_ms and ev.end_ms >= u.start_ms - margin_ms


def match_utterances(
    utterances: Sequence[UtteranceTiming], events: Sequence[ReceivedEvent], margin_ms: int = DEFAULT_MARGIN_MS
) -> list[UtteranceResult]:
    transcripts = sorted((e for e in events if e.type in ("partial", "final")), key=lambda e: e.seq)
    timed = all(e.start_ms is not None and e.end_ms is not None for e in transcripts)
    finals = [e for e in transcripts if e.type == "final"]
    out: list[UtteranceResult] = []
    for k, u in enumerate(utterances):
        if u.start_t is None or u.end_t is None:
            out.append(UtteranceResult(u.start_ms, u.end_ms, None, None, 0, u.sentence))
            continue
        start_t = u.start_t
        if timed:
            covering = [e for e in transcripts if e.arrival >= start_t and _covers(e, u, margin_ms)]
            covering_finals = [e for e in covering if e.type == "final"]
        else:
            own = finals[k] if k < len(finals) else None
            covering_finals = [own] if own is not None and own.arrival >= start_t else []
            # Partials of the k-th segment: those after the (k-1)-th final and not after the k-th.
            lo = finals[k - 1].seq if 0 < k <= len(finals) else -1
            hi = own.seq if own is not None else math.inf
            covering = [e for e in transcripts if lo < e.seq <= hi and e.arrival >= start_t]
        ttfp = min(e.arrival for e in covering) - start_t if covering else None
        ttf = max(e.arrival for e in covering_finals) - u.end_t if covering_finals else None
        stored = [e.published for e in covering_finals if e.published is not None]
        known = bool(stored) and len(stored) == len(covering_finals)
        ttf_published = max(stored) - u.end_t if known else None
        n = len(covering_finals)
        out.append(UtteranceResult(u.start_ms, u.end_ms, ttfp, ttf, n, u.sentence, ttf_published))
    return out


def finals_outside(
    utterances: Sequence[UtteranceTiming], events: Sequence[ReceivedEvent], margin_ms: int = DEFAULT_MARGIN_MS
) -> int:
    """Finals whose media span covers no utterance: a late word that starts past its utterance's
    window, or words made up in the silence between utterances. TTF does not see them (0 without
    media spans: those finals are matched by order)."""
    return sum(
        1
        for e in events
        if e.type == "final"
        and e.start_ms is not None
        and e.end_ms is not None
        and not any(_covers(e, u, margin_ms) for u in utterances)
    )


def _collapse(text: str) -> str:
    return " ".join(text.split())


def partial_stability(events: Sequence[ReceivedEvent]) -> tuple[int, int]:
    """(unstable partials, partials that had a successor in their segment)."""
    ordered = sorted((e for e in events if e.type in ("partial", "final")), key=lambda e: e.seq)
    segments: list[list[ReceivedEvent]] = []
    by_id: dict[int, list[ReceivedEvent]] = {}
    current: list[ReceivedEvent] | None = None
    for e in ordered:
        if e.segment_id is not None:
            seg = by_id.get(e.segment_id)
            if seg is None:
                seg = by_id[e.segment_id] = []
                segments.append(seg)
            seg.append(e)
        else:  # no segment ids: a segment is the partials up to and including a final
            if current is None:
                current = []
                segments.append(current)
            current.append(e)
            if e.type == "final":
                current = None
    unstable = considered = 0
    for seg in segments:
        for a, b in itertools.pairwise(seg):
            if a.type != "partial":
                continue
            considered += 1
            if not _collapse(b.text).startswith(_collapse(a.text)):
                unstable += 1
    return unstable, considered


def final_text(events: Sequence[ReceivedEvent]) -> str:
    return " ".join(
        e.text.strip() for e in sorted(events, key=lambda e: e.seq) if e.type == "final" and e.text
    )


def normalize(text: str) -> list[str]:
    words: list[list[str]] = _WER_TRANSFORM(text)
    return words[0] if words else []


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """(substitutions + deletions + insertions, reference words) after normalization."""
    ref = normalize(reference)
    hyp = normalize(hypothesis)
    if not ref:
        return len(hyp), 0
    if not hyp:
        return len(ref), len(ref)
    o = jiwer.process_words(" ".join(ref), " ".join(hyp))
    return o.substitutions + o.deletions + o.insertions, len(ref)
