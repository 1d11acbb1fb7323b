"""The records streams and results travel in between processes (asr_core.channel): fixed structs,
numpy bytes, length-prefixed UTF-8. No pickling: a peer sends only data of these shapes.

Into the engine (one channel per front-end process):
    OPEN(key, lookahead, language, stream_id)     a stream starts (its key is the sender's)
    CHUNK(key, flags, completed_at, samples, mel, energies)   LAST: the stream's final short chunk;
        FLUSH: the VAD's speech-end flush (flush_frames of real audio, the speech end's live time)
        SILENT: no speech since the stream's last flush (ChunkPayload.silent_since_flush)
    FINISH(key, samples)                          no more chunks (after its last, if any)
    CLOSE(key)                                    abort
Out of the engine (one channel to the process that publishes):
    EVENT(key, TranscriptEvent)   ENDED(key, StreamEnded)
    STEP / DECODE / DROPPED / LATENCY / TTF       the engine's hooks (metrics live elsewhere)
    STATUS(json)                                  the engine's load, a few times a second

Keys are unsigned 32-bit, chosen by the front-end side: (worker index << 24) | counter keeps them
unique across senders. Little-endian throughout.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from asr_core import hostcopy
from asr_core.api import StreamEnded, TranscriptEvent
from asr_core.frontend import ChunkPayload

OPEN, CHUNK, FINISH, CLOSE = 1, 2, 3, 4
EVENT, ENDED, STEP, DECODE, DROPPED, LATENCY, STATUS, TTF = 10, 11, 12, 13, 14, 15, 16, 17

FLAG_LAST = 1
FLAG_FLUSH = 2
FLAG_SILENT = 4

_OPEN = struct.Struct("<Ih")  # key, lookahead (-1: the default)
# key, flags, n_frames, n_mels, n_energies, flush_frames, completed_at, samples, speech_end_at (NaN: none)
_CHUNK = struct.Struct("<IBxHHHHdQd")
_FINISH = struct.Struct("<IQ")  # key, samples
_KEY = struct.Struct("<I")
_EVENT = struct.Struct("<IBBxxIqqI")  # key, kind, at_end, segment, start_ms, end_ms, n_tokens
_ENDED = struct.Struct("<IBxxxqII")  # key, reason, audio_ms, chunks, dropped
_STEP = struct.Struct("<dI")  # seconds, batch (then one float32 queue wait per row)
_DECODE = struct.Struct("<dI")  # seconds, streams
_LATENCY = struct.Struct("<Bd")  # kind, seconds
_SECONDS = struct.Struct("<d")
_STR = struct.Struct("<H")
_F32 = np.dtype("<f4")
_U32 = np.dtype("<u4")

_KINDS = ("partial", "final")
_REASONS = ("finished", "closed", "error")


class WireError(Exception):
    """A record that does not parse: a peer of another version, or a bug."""


def _str(text: str) -> bytes:
    b = text.encode("utf-8")
    if len(b) > 0xFFFF:
        b = b[:0xFFFF].decode("utf-8", "ignore").encode("utf-8")
    return _STR.pack(len(b)) + b


def _read_str(view: memoryview, at: int) -> tuple[str, int]:
    (n,) = _STR.unpack_from(view, at)
    at += _STR.size
    if at + n > len(view):
        raise WireError("string runs past the record")
    return bytes(view[at : at + n]).decode("utf-8"), at + n


# --- into the engine -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Open:
    key: int
    lookahead: int | None
    language: str
    stream_id: str


@dataclass(frozen=True, slots=True)
class Chunk:
    key: int
    last: bool
    samples: int
    payload: ChunkPayload


@dataclass(frozen=True, slots=True)
class Finish:
    key: int
    samples: int


@dataclass(frozen=True, slots=True)
class Close:
    key: int


def encode_open(key: int, lookahead: int | None, language: str, stream_id: str) -> list[bytes]:
    return [_OPEN.pack(key, -1 if lookahead is None else lookahead), _str(language), _str(stream_id)]


def encode_chunk(key: int, p: ChunkPayload, samples: int, *, last: bool) -> list[bytes | memoryview]:
    mel = np.ascontiguousarray(p.mel, _F32).reshape(p.mel.shape[0], -1)
    energies = np.ascontiguousarray(p.energies_db, _F32)
    flags = (FLAG_LAST if last else 0) | (FLAG_FLUSH if p.flush else 0)
    flags |= FLAG_SILENT if p.silent_since_flush else 0
    speech_end = math.nan if p.speech_end_at is None else p.speech_end_at
    head = _CHUNK.pack(
        key,
        flags,
        mel.shape[0],
        mel.shape[1],
        energies.size,
        p.flush_frames,
        p.completed_at,
        samples,
        speech_end,
    )
    return [head, mel.data.cast("B"), energies.data.cast("B")]


def encode_finish(key: int, samples: int) -> list[bytes]:
    return [_FINISH.pack(key, samples)]


def encode_close(key: int) -> list[bytes]:
    return [_KEY.pack(key)]


def decode_input(kind: int, view: memoryview) -> Open | Chunk | Finish | Close:
    """One record of a front-end channel; arrays are copies (the view goes back to the ring)."""
    try:
        if kind == CHUNK:
            key, flags, n, m, e, flush_frames, completed_at, samples, speech_end = _CHUNK.unpack_from(view, 0)
            at = _CHUNK.size
            if at + 4 * (n * m + e) != len(view):
                raise WireError(f"chunk record of {len(view)} bytes for {n}x{m} + {e} floats")
            mel = hostcopy.floats(view, at, n * m).reshape(n, m)
            energies = hostcopy.floats(view, at + 4 * n * m, e)
            payload = ChunkPayload(
                mel,
                energies,
                completed_at,
                flush=bool(flags & FLAG_FLUSH),
                flush_frames=flush_frames,
                speech_end_at=None if math.isnan(speech_end) else speech_end,
                silent_since_flush=bool(flags & FLAG_SILENT),
            )
            return Chunk(key, bool(flags & FLAG_LAST), samples, payload)
        if kind == OPEN:
            key, lookahead = _OPEN.unpack_from(view, 0)
            language, at = _read_str(view, _OPEN.size)
            stream_id, _ = _read_str(view, at)
            return Open(key, None if lookahead < 0 else lookahead, language, stream_id)
        if kind == FINISH:
            return Finish(*_FINISH.unpack_from(view, 0))
        if kind == CLOSE:
            return Close(*_KEY.unpack_from(view, 0))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise WireError(f"record of kind {kind}: {e}") from None
    raise WireError(f"unknown record kind {kind} on a front-end channel")


# --- out of the engine -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Step:
    seconds: float
    batch: int
    waits_s: np.ndarray


@dataclass(frozen=True, slots=True)
class Decode:
    seconds: float
    streams: int


@dataclass(frozen=True, slots=True)
class Dropped:
    key: int


@dataclass(frozen=True, slots=True)
class Latency:
    kind: str
    seconds: float


@dataclass(frozen=True, slots=True)
class TimeToFinal:
    seconds: float


@dataclass(frozen=True, slots=True)
class Status:
    values: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Event:
    key: int
    event: TranscriptEvent | StreamEnded


def encode_event(key: int, ev: TranscriptEvent | StreamEnded) -> tuple[int, list[bytes | memoryview]]:
    if isinstance(ev, TranscriptEvent):
        tokens = np.asarray(ev.token_ids, _U32)
        head = _EVENT.pack(
            key,
            _KINDS.index(ev.kind),
            int(ev.at_end_of_stream),
            ev.segment_id,
            ev.start_ms,
            ev.end_ms,
            tokens.size,
        )
        parts: list[bytes | memoryview] = [
            head,
            _str(ev.stream_id),
            _str(ev.text),
            _str(ev.detected_language or ""),
            tokens.tobytes(),
        ]
        return EVENT, parts
    head = _ENDED.pack(key, _REASONS.index(ev.reason), ev.audio_ms, ev.chunks, ev.dropped_chunks)
    return ENDED, [head, _str(ev.stream_id), _str(ev.error or ""), _str(json.dumps(ev.stats))]


def encode_step(seconds: float, batch: int, waits_s: Sequence[float]) -> list[bytes | memoryview]:
    waits = np.asarray(waits_s, _F32)
    return [_STEP.pack(seconds, batch), waits.tobytes()]


def encode_decode(seconds: float, streams: int) -> list[bytes]:
    return [_DECODE.pack(seconds, streams)]


def encode_dropped(key: int) -> list[bytes]:
    return [_KEY.pack(key)]


def encode_latency(kind: str, seconds: float) -> list[bytes]:
    return [_LATENCY.pack(_KINDS.index(kind), seconds)]


def encode_ttf(seconds: float) -> list[bytes]:
    return [_SECONDS.pack(seconds)]


def encode_status(values: dict[str, Any]) -> list[bytes]:
    return [json.dumps(values).encode()]


def decode_output(
    kind: int, view: memoryview
) -> Event | Step | Decode | Dropped | Latency | TimeToFinal | Status:
    try:
        if kind == EVENT:
            key, k, at_end, segment, start_ms, end_ms, n_tokens = _EVENT.unpack_from(view, 0)
            stream_id, at = _read_str(view, _EVENT.size)
            text, at = _read_str(view, at)
            lang, at = _read_str(view, at)
            tokens = tuple(int(t) for t in np.frombuffer(view, _U32, n_tokens, at))
            ev = TranscriptEvent(
                stream_id=stream_id,
                kind=_KINDS[k],  # type: ignore[arg-type]
                segment_id=segment,
                text=text,
                start_ms=start_ms,
                end_ms=end_ms,
                token_ids=tokens,
                detected_language=lang or None,
                at_end_of_stream=bool(at_end),
            )
            return Event(key, ev)
        if kind == ENDED:
            key, reason, audio_ms, chunks, dropped = _ENDED.unpack_from(view, 0)
            stream_id, at = _read_str(view, _ENDED.size)
            error, at = _read_str(view, at)
            stats, _ = _read_str(view, at)
            ended = StreamEnded(
                stream_id=stream_id,
                reason=_REASONS[reason],  # type: ignore[arg-type]
                audio_ms=audio_ms,
                chunks=chunks,
                dropped_chunks=dropped,
                error=error or None,
                stats={str(k): float(v) for k, v in json.loads(stats).items()},
            )
            return Event(key, ended)
        if kind == STEP:
            seconds, batch = _STEP.unpack_from(view, 0)
            return Step(seconds, batch, np.frombuffer(view, _F32, offset=_STEP.size).copy())
        if kind == DECODE:
            return Decode(*_DECODE.unpack_from(view, 0))
        if kind == DROPPED:
            return Dropped(*_KEY.unpack_from(view, 0))
        if kind == LATENCY:
            k, seconds = _LATENCY.unpack_from(view, 0)
            return Latency(_KINDS[k], seconds)
        if kind == TTF:
            return TimeToFinal(*_SECONDS.unpack_from(view, 0))
        if kind == STATUS:
            return Status(json.loads(bytes(view).decode()))
    except (struct.error, ValueError, IndexError, UnicodeDecodeError) as e:
        raise WireError(f"record of kind {kind}: {e}") from None
    raise WireError(f"unknown record kind {kind} on the results channel")
