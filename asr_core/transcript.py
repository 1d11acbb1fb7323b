"""Transcript assembly and endpointing: decoded tokens of one stream -> partial and final events. Pure.

The assembler sees the stream frame by frame on the encoder's media timeline (80 ms per frame): the
tokens greedy decoding emitted at each frame, and each frame's audio energy. It keeps one open
segment (utterance) and

- closes it with a **final** at a pause: no token for `blank_ms` while the audio of that run stayed
  below `energy_db` dBFS (or no token for `max_blank_ms` whatever the energy: a noisy line), before a
  word-initial token once the segment is `max_segment_ms` long, and at the end of the stream;
- reports a **partial** when the segment's text grew, at most once per `partial_interval_ms` of media
  time (media time, not wall time: the same audio gives the same events however fast it is fed).

Greedy RNN-T never revises an emitted token, so the text of a segment only grows: each partial is a
prefix of the next partial and of the final (checked here; a tokenizer that broke it would make the
assembler hold the partial back, never emit a non-prefix). A segment whose text is empty (only a
language tag, say) gives no final: its tokens are carried into the next segment, so finals hold every
token the decoder emitted except a text-less tail at the end of the stream.

- closes it at once when the caller stopped speaking (`speech_ended()`, driven by the stream's VAD
  through a flush of its pending audio; the token-silence rules above stay as the fallback for lines
  where the VAD never closes).

A word never spans two finals: a segment ends only after a token or before a word-initial one, and
pieces that would continue the last word of a closed segment (a word-final piece the model emits
after the final went out) are dropped and counted in `orphan_pieces` rather than opening the next
segment mid-word.

Times: a token emitted at frame t is at 80*t ms. A segment starts at its first token's frame, moved
back over the loud frames just before it (speech onset; tokens lag the audio they transcribe), at most
`_ONSET_LOOKBACK_FRAMES` and never into the previous segment; it ends after its last token's frame,
clipped to the stream's audio at the end. Words (`TranscriptEvent.words`) are the segment's tokens
grouped at word-initial pieces: a word starts at its first token's frame and ends after its last
token's frame or at the next word's start, whichever is earlier, inside the segment's span; its
confidence is the lowest probability the joint gave one of its tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from asr_core.api import TranscriptEvent, Word
from asr_core.config import EndpointConfig

FRAME_MS = 80
_ONSET_LOOKBACK_FRAMES = 6  # 480 ms: about one word of lag between audio and its token


class TextDecoder(Protocol):
    """What the assembler needs from the tokenizer."""

    def decode(self, ids: Sequence[int]) -> tuple[str, str | None]:
        """Text of a token sequence (language tags stripped) and the last language tag in it."""

    def starts_word(self, token_id: int) -> bool:
        """Whether the token begins a new word (so a segment may end just before it)."""


@dataclass(frozen=True, slots=True)
class Token:
    id: int
    frame: int  # encoder frame index on the stream's media timeline
    prob: float = 1.0  # the joint's softmax probability of this token when it was emitted


class TranscriptAssembler:
    """Endpointing + partial/final events for one stream.

    Driven by: `update(tokens, first_frame, n_frames, energies_db)` once per decoded chunk, in chunk
    order, and `finish(audio_ms)` at the end. Returns events; no timer, no clock.
    """

    def __init__(
        self,
        stream_id: str,
        config: EndpointConfig,
        text: TextDecoder,
        *,
        frame_ms: int = FRAME_MS,
    ) -> None:
        self.stream_id = stream_id
        self.config = config
        self._text = text
        self._frame_ms = frame_ms
        self._blank_frames = max(1, -(-config.blank_ms // frame_ms))
        self._max_blank_frames = max(self._blank_frames, -(-config.max_blank_ms // frame_ms))
        self._max_segment_frames = max(1, config.max_segment_ms // frame_ms)
        self._partial_frames = config.partial_interval_ms / frame_ms
        self._segment_id = 0
        self._ids: list[int] = []
        self._toks: list[Token] = []  # the open segment's tokens (frames and probabilities)
        self._first_frame = 0  # of the open segment's first token
        self._last_token_frame = -1
        self._start_frame = 0
        self._floor_frame = 0  # the next segment may not start before this frame
        self._next_frame = 0  # first frame not yet seen
        self._quiet_run = 0  # frames in a row below energy_db, up to the last frame seen
        self._energies: deque[tuple[int, float]] = deque(maxlen=_ONSET_LOOKBACK_FRAMES + 1)
        self._partial_text = ""
        self._partial_frame: int | None = None
        self._partial_checked = 0  # segment tokens already looked at for a partial
        self._closed = False
        # Tokens of a segment that paused with no text (e.g. only a language tag): kept for the next
        # segment, so no token is ever lost, but that segment's times start at its own first token.
        self._held = False
        self.prefix_violations = 0  # partials held back because the text did not extend the last one
        self.orphan_pieces = 0  # word-final pieces dropped after their word's segment was final

    @property
    def segment_id(self) -> int:
        return self._segment_id

    def update(
        self,
        tokens: Sequence[Token],
        first_frame: int,
        n_frames: int,
        energies_db: Sequence[float] | np.ndarray | None = None,
    ) -> list[TranscriptEvent]:
        """Feed one decoded chunk: frames [first_frame, first_frame + n_frames) and their tokens."""
        if self._closed:
            raise ValueError(f"stream {self.stream_id}: update after finish")
        if first_frame < self._next_frame:
            raise ValueError(
                f"stream {self.stream_id}: chunk at frame {first_frame} is before frame {self._next_frame}"
            )
        if energies_db is not None and len(energies_db) != n_frames:
            raise ValueError(f"stream {self.stream_id}: {len(energies_db)} energies for {n_frames} frames")
        if first_frame > self._next_frame:
            self._quiet_run = 0  # a gap (dropped chunks): its energy is unknown, so it is not quiet
        by_frame: dict[int, list[Token]] = {}
        for tok in tokens:
            if not first_frame <= tok.frame < first_frame + n_frames:
                raise ValueError(
                    f"stream {self.stream_id}: token at frame {tok.frame} outside the chunk "
                    f"[{first_frame}, {first_frame + n_frames})"
                )
            by_frame.setdefault(tok.frame, []).append(tok)

        events: list[TranscriptEvent] = []
        for i in range(n_frames):
            frame = first_frame + i
            energy = None if energies_db is None else float(energies_db[i])
            self._see_energy(frame, energy)
            toks = self._without_orphans(by_frame.get(frame, []))
            if toks:
                if (
                    self._ids
                    and frame - self._first_frame >= self._max_segment_frames
                    and self._text.starts_word(toks[0].id)
                ):
                    events.extend(self._close(at_end=False))
                self._add(frame, toks)
            elif self._ids and not self._held and self._is_pause(frame):
                events.extend(self._close(at_end=False))
        self._next_frame = first_frame + n_frames
        partial = self._maybe_partial(self._next_frame - 1)
        if partial is not None:
            events.append(partial)
        return events

    def speech_ended(self, late: Sequence[Token] = ()) -> list[TranscriptEvent]:
        """The caller stopped speaking (the VAD's decision, after the frames it covers were fed):
        close the open segment now, with a final if it has text. `late`: tokens decoded from the
        flush's padding after those frames (the last word's late pieces), added to the segment."""
        if self._closed:
            return []
        self.add_late(late)
        if self._held or not self._ids:
            return []
        return self._close(at_end=False)

    def add_late(self, late: Sequence[Token]) -> None:
        """Tokens decoded past the frames fed (a flush's padding) join the open segment."""
        by_frame: dict[int, list[Token]] = {}
        for tok in late:
            by_frame.setdefault(tok.frame, []).append(tok)
        for frame, toks in sorted(by_frame.items()):
            kept = self._without_orphans(toks)
            if kept:
                self._add(frame, kept)

    def finish(self, audio_ms: int | None = None) -> list[TranscriptEvent]:
        """End of stream: the open segment's final (if it has text)."""
        if self._closed:
            return []
        self._closed = True
        return self._close(at_end=True, audio_ms=audio_ms)

    # -- helpers -------------------------------------------------------------------------------

    def _see_energy(self, frame: int, energy: float | None) -> None:
        threshold = self.config.energy_db
        if energy is None or threshold is None:
            self._quiet_run = 0 if threshold is not None else self._quiet_run + 1
            return
        self._energies.append((frame, energy))
        self._quiet_run = self._quiet_run + 1 if energy < threshold else 0

    def _is_pause(self, frame: int) -> bool:
        silent = frame - self._last_token_frame
        if silent >= self._max_blank_frames:
            return True
        if silent < self._blank_frames:
            return False
        return self.config.energy_db is None or self._quiet_run >= self._blank_frames

    def _continues_word(self, token_id: int) -> bool:
        return not self._text.starts_word(token_id) and bool(self._text.decode([token_id])[0])

    def _without_orphans(self, toks: list[Token]) -> list[Token]:
        """Drop pieces that would continue the last word of an already final segment."""
        if self._segment_id == 0 or (self._ids and not self._held):
            return toks
        i = 0
        while i < len(toks) and self._continues_word(toks[i].id):
            i += 1
        self.orphan_pieces += i
        return toks[i:] if i else toks

    def _add(self, frame: int, toks: list[Token]) -> None:
        if not self._ids or self._held:
            self._first_frame = frame
            self._start_frame = self._onset(frame)
            self._held = False
        self._ids.extend(t.id for t in toks)
        self._toks.extend(toks)
        self._last_token_frame = frame

    def _onset(self, frame: int) -> int:
        """Move a segment's start back over the loud frames right before its first token."""
        threshold = self.config.energy_db
        start = frame
        if threshold is None:
            return start
        loud = {f for f, e in self._energies if e >= threshold}
        while start - 1 >= max(self._floor_frame, frame - _ONSET_LOOKBACK_FRAMES) and (start - 1) in loud:
            start -= 1
        return start

    def _maybe_partial(self, frame: int) -> TranscriptEvent | None:
        if not self.config.partials or not self._ids:
            return None
        if self._partial_frame is not None and frame - self._partial_frame < self._partial_frames:
            return None
        if len(self._ids) == self._partial_checked:
            return None  # no new token since the last look: the text cannot have grown
        self._partial_checked = len(self._ids)
        text, lang = self._text.decode(self._ids)
        text = text.rstrip()
        if not text or text == self._partial_text:
            return None
        if not text.startswith(self._partial_text):
            self.prefix_violations += 1
            return None
        self._partial_text = text
        self._partial_frame = frame
        return self._event("partial", text, lang, end_frame=self._last_token_frame + 1)

    def _close(self, *, at_end: bool, audio_ms: int | None = None) -> list[TranscriptEvent]:
        if not self._ids:
            return []
        text, lang = self._text.decode(self._ids)
        text = text.strip()
        if not text:
            # Nothing to show: hold the tokens for the next segment (dropped only at the end).
            self._held = True
            return []
        event = self._event(
            "final", text, lang, end_frame=self._last_token_frame + 1, at_end=at_end, audio_ms=audio_ms
        )
        self._segment_id += 1
        self._floor_frame = self._last_token_frame + 1
        self._ids = []
        self._toks = []
        self._held = False
        self._partial_text = ""
        self._partial_frame = None
        self._partial_checked = 0
        return [event]

    def _event(
        self,
        kind: str,
        text: str,
        lang: str | None,
        *,
        end_frame: int,
        at_end: bool = False,
        audio_ms: int | None = None,
    ) -> TranscriptEvent:
        start_ms = self._start_frame * self._frame_ms
        end_ms = end_frame * self._frame_ms
        if audio_ms is not None:
            end_ms = min(end_ms, audio_ms)
            start_ms = min(start_ms, end_ms)
        words = self._words(start_ms, end_ms) if self.config.words in (kind, "all") else ()
        return TranscriptEvent(
            stream_id=self.stream_id,
            kind="final" if kind == "final" else "partial",
            segment_id=self._segment_id,
            text=text,
            start_ms=start_ms,
            end_ms=end_ms,
            token_ids=tuple(self._ids),
            detected_language=lang,
            at_end_of_stream=at_end,
            words=words,
        )

    def _words(self, start_ms: int, end_ms: int) -> tuple[Word, ...]:
        """The segment's tokens grouped into words (see the module docstring for the times)."""
        groups: list[list[Token]] = []
        for tok in self._toks:
            if self._text.starts_word(tok.id) or (not groups and self._continues_word(tok.id)):
                groups.append([tok])
            elif groups and self._continues_word(tok.id):
                groups[-1].append(tok)
        fm = self._frame_ms
        out: list[Word] = []
        for k, g in enumerate(groups):
            text = self._text.decode([t.id for t in g])[0].strip()
            if not text:
                continue
            w_start = min(max(g[0].frame * fm, start_ms), end_ms)
            w_end = (g[-1].frame + 1) * fm
            if k + 1 < len(groups):
                w_end = min(w_end, groups[k + 1][0].frame * fm)
            w_end = min(max(w_end, w_start), end_ms)
            conf = min(t.prob for t in g)
            out.append(Word(text, w_start, w_end, round(min(1.0, max(0.0, conf)), 4)))
        return tuple(out)
