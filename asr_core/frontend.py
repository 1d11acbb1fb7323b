"""A stream's front end: 16 kHz PCM in, encoder chunks (mel + per-frame energies) out.

`StreamFrontEnd` is what runs before the encoder's queue, per stream: exact streaming log-mel, the
chunker (25 then 32 mel frames at lookahead 3), the energy of the audio each encoder frame sees
(the endpointer's "is it quiet" input) and the VAD's speech-end flushes (plain data: they cross a
process boundary like any chunk). The engine runs it on the caller's thread (`AsrStream.push`);
in the multi-process gateway the media workers run it and send the chunks to the engine process.

`FrontEndSpec` is what a process needs to build front ends without loading the model (no MLX, no
weights): the features block, the mel filterbank's file, the subsampling factor and the lookaheads.
The engine's process writes it (`AsrModel.frontend_spec(vad)`), the others read it as JSON.
"""

from __future__ import annotations

import base64
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from asr_core.api import SAMPLE_RATE_HZ

FRAME_MS = 80
SAMPLES_PER_FRAME = SAMPLE_RATE_HZ * FRAME_MS // 1000  # 1280: one encoder frame = 8 hops of 160
# Encoder frame j's receptive field ends at sample 1280*j + 200 (mel frame 8j's window); its energy
# is that of the 80 ms of audio ending there: the newest audio the frame sees.
_ENERGY_END = 200
SILENT_DB = -120.0


class FrontEnd(Protocol):
    """One stream's features + chunker: 16 kHz PCM in, complete encoder mel chunks out."""

    def push(self, pcm: np.ndarray) -> list[np.ndarray]:
        """Mel chunks (n_frames, n_mels) completed by this audio, in order."""

    def finish(self) -> tuple[list[np.ndarray], bool]:
        """Flush at end of stream: the remaining chunks and whether the last of them is the stream's
        final (short) chunk that needs end-of-stream handling in the encoder."""

    def flush(self) -> tuple[np.ndarray, int]:
        """The partial next chunk for a mid-stream flush (kept pending): mel frames padded with
        copies of its last frame to the next chunk and one more (MelChunker.flush_chunk), and the
        number of its encoder frames that hold real audio; (0 frames, 0) before any audio."""


@dataclass(frozen=True, slots=True)
class ChunkPayload:
    """What travels with a mel chunk from the front end through the encoder to the decoder."""

    mel: np.ndarray
    energies_db: np.ndarray  # per encoder frame of the chunk (full chunk length; a short one is cut)
    completed_at: float  # monotonic time of the push that completed the chunk
    # The VAD said the caller stopped: `mel` is the partial next chunk padded to a whole one, encoded
    # without committing; its first `flush_frames` encoder frames (real audio) are decoded and the
    # utterance is closed.
    flush: bool = False
    flush_frames: int = 0
    speech_end_at: float | None = None  # flush: monotonic time the caller's last speech was live
    # A chunk completed after a flush with no speech heard since (the VAD, up to the push that
    # completed it): the tokens it gives are the model's late ones for the utterance that flush ended.
    silent_since_flush: bool = False


class StreamFrontEnd:
    """Features, chunking, frame energies and the speech-end flushes of one stream (one caller).

    With a VAD (asr_core.vad), a push whose audio holds a decided speech end yields, at that sample, a
    flush payload: the partial next chunk, padded (`FrontEnd.flush`), with the monotonic time the
    caller's last speech was live (the start of a time to final)."""

    def __init__(
        self,
        frontend: FrontEnd,
        lookahead: int,
        vad: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from asr_core.vad import SpeechEndDetector

        self._frontend = frontend
        self._clock = clock
        self._frame_span = lookahead + 1
        self._vad = SpeechEndDetector(vad) if vad is not None and vad.enabled else None
        self.chunks = 0  # chunks produced (their sequence numbers; a flush uses none)
        self.samples = 0  # audio pushed
        self._hist = np.zeros(0, np.float32)  # audio from sample _hist_start on (for frame energies)
        self._hist_start = 0
        # (sample after the push, time of the push) of the last second of pushes: when was a sample
        # live? (the time to final of a flush is measured from its speech end)
        self._pushes: deque[tuple[int, float]] = deque(maxlen=64)
        self._flushed_at: int | None = None  # sample of the last flush's decision

    @property
    def audio_ms(self) -> int:
        return self.samples * 1000 // SAMPLE_RATE_HZ

    def push(self, pcm: np.ndarray) -> list[ChunkPayload]:
        """Float32 mono audio in [-1, 1] (checked by the caller); the chunks and flushes it completes."""
        if pcm.size == 0:
            return []
        # A flush holds exactly the audio up to the VAD's decision, whatever the push sizes: the front
        # end is fed up to that sample, flushed, then fed the rest.
        start = self.samples
        self._pushes.append((start + pcm.size, self._clock()))
        ends = self._vad.push(pcm) if self._vad is not None else []
        pos = 0
        payloads: list[ChunkPayload] = []
        for end in ends:
            payloads += self._feed(pcm[pos : end.decided_at - start])
            pos = end.decided_at - start
            payloads.append(self._flush_payload(end.speech_end))
            self._flushed_at = end.decided_at
        payloads += self._feed(pcm[pos:])
        return payloads

    def finish(self) -> tuple[list[ChunkPayload], bool]:
        """End of audio: the remaining chunks, and whether the last is the stream's final short one."""
        mels, last_is_final = self._frontend.finish()
        return self._payloads(mels), last_is_final

    def _feed(self, x: np.ndarray) -> list[ChunkPayload]:
        if not x.size:
            return []
        mels = self._frontend.push(x)
        self._hist = np.concatenate([self._hist, x]) if self._hist.size else x.copy()
        self.samples += x.size
        return self._payloads(mels)

    def _payloads(self, mels: list[np.ndarray]) -> list[ChunkPayload]:
        now = self._clock()
        # The VAD has seen the whole push by now, so speech later in it also counts against this.
        vad, flushed_at = self._vad, self._flushed_at
        silent = vad is not None and flushed_at is not None and vad.silent_since(flushed_at)
        out = []
        for mel in mels:
            first = self.chunks * self._frame_span
            out.append(
                ChunkPayload(
                    mel=mel, energies_db=self._energies(first), completed_at=now, silent_since_flush=silent
                )
            )
            self.chunks += 1
        # Keep only the audio the next chunk's frame energies need.
        keep_from = max(
            0, self.chunks * self._frame_span * SAMPLES_PER_FRAME + _ENERGY_END - SAMPLES_PER_FRAME
        )
        if keep_from > self._hist_start:
            self._hist = self._hist[keep_from - self._hist_start :]
            self._hist_start = keep_from
        return out

    def _flush_payload(self, speech_end: int) -> ChunkPayload:
        """The partial next chunk as a flush (its chunk number is not used up: invariant 6 of the
        scheduler)."""
        first = self.chunks * self._frame_span
        mel, real_frames = self._frontend.flush()
        return ChunkPayload(
            mel=mel,
            energies_db=self._energies(first),
            completed_at=self._clock(),
            flush=True,
            flush_frames=real_frames,
            speech_end_at=self._live_at(speech_end),
        )

    def _live_at(self, sample: int) -> float | None:
        """When `sample` was live: the first push that carried it, less the audio after it in that
        push (the caller's audio arrives in real time; a faster feed gives an early estimate)."""
        for end, t in self._pushes:
            if end >= sample:
                return t - (end - sample) / SAMPLE_RATE_HZ
        return None

    def _energies(self, first_frame: int) -> np.ndarray:
        out = np.full(self._frame_span, SILENT_DB, np.float32)
        for i in range(self._frame_span):
            end = (first_frame + i) * SAMPLES_PER_FRAME + _ENERGY_END
            lo = max(0, end - SAMPLES_PER_FRAME) - self._hist_start
            hi = min(end, self.samples) - self._hist_start
            if hi > lo and lo >= 0:
                seg = self._hist[lo:hi]
                out[i] = max(SILENT_DB, 10.0 * math.log10(float(np.dot(seg, seg)) / seg.size + 1e-12))
        return out


def flush_extra_chunks(lookahead: int, lookaheads: tuple[int, ...]) -> int:
    """A flush adds a chunk of padding when the encoder's position tables reach that far."""
    return 1 if 2 * (lookahead + 1) <= max(lookaheads) + 1 else 0


class FeaturesAndChunker:
    """`FrontEnd` from the streaming log-mel and the chunker."""

    def __init__(self, features: Any, chunker: Any, flush_extra_chunks: int = 1) -> None:
        self._features = features
        self._chunker = chunker
        self._extra = flush_extra_chunks

    def push(self, pcm: np.ndarray) -> list[np.ndarray]:
        mel = self._features.push(pcm)
        return list(self._chunker.push(mel)) if len(mel) else []

    def finish(self) -> tuple[list[np.ndarray], bool]:
        mel = self._features.finish()
        chunks = list(self._chunker.push(mel)) if len(mel) else []
        last = self._chunker.finish()
        if last is not None:
            return [*chunks, last], True
        return chunks, False

    def flush(self) -> tuple[np.ndarray, int]:
        mel, real = self._chunker.flush_chunk(self._extra)
        return (mel, real) if mel.shape[0] else (np.zeros((0, self._features.cfg.n_mels), np.float32), 0)


@dataclass(frozen=True, slots=True)
class FrontEndSpec:
    """What builds a model's front ends elsewhere: JSON-able, no weights (the filterbank is inline)."""

    features: Mapping[str, Any]
    mel_filters: np.ndarray  # (n_mels, n_bins) float32
    subsampling_factor: int
    lookaheads: tuple[int, ...]
    default_lookahead: int
    prompts: Mapping[str, int] = field(default_factory=dict)  # locale -> prompt id (language check)
    vad: Mapping[str, Any] = field(default_factory=dict)  # asr_core.vad.VadConfig fields; {}: no VAD

    def to_json(self) -> dict[str, Any]:
        filters = np.ascontiguousarray(self.mel_filters, "<f4")
        return {
            "features": dict(self.features),
            "mel_filters": base64.b64encode(filters.tobytes()).decode(),
            "mel_filters_shape": list(filters.shape),
            "subsampling_factor": self.subsampling_factor,
            "lookaheads": list(self.lookaheads),
            "default_lookahead": self.default_lookahead,
            "prompts": dict(self.prompts),
            "vad": dict(self.vad),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> FrontEndSpec:
        shape = tuple(int(x) for x in d["mel_filters_shape"])
        filters = np.frombuffer(base64.b64decode(d["mel_filters"]), "<f4").reshape(shape).astype(np.float32)
        return cls(
            features=dict(d["features"]),
            mel_filters=filters,
            subsampling_factor=int(d["subsampling_factor"]),
            lookaheads=tuple(int(x) for x in d["lookaheads"]),
            default_lookahead=int(d["default_lookahead"]),
            prompts={str(k): int(v) for k, v in dict(d.get("prompts", {})).items()},
            vad=dict(d.get("vad", {})),
        )


class FrontEndFactory:
    """Front ends of one model from its spec (the filterbank read once; its log-mel math shared)."""

    def __init__(self, spec: FrontEndSpec) -> None:
        from asr_core.features import FeatureConfig, MelFrames

        self.spec = spec
        self._mel_frames = MelFrames(spec.mel_filters, FeatureConfig.from_dict(spec.features))

    def new(self, lookahead: int) -> FrontEnd:
        from asr_core.chunker import MelChunker
        from asr_core.features import StreamingLogMel

        if lookahead not in self.spec.lookaheads:
            raise ValueError(
                f"lookahead {lookahead} not supported; the model has {list(self.spec.lookaheads)}"
            )
        return FeaturesAndChunker(
            StreamingLogMel(self._mel_frames),
            MelChunker(lookahead, self.spec.subsampling_factor),
            flush_extra_chunks(lookahead, self.spec.lookaheads),
        )

    def stream(self, lookahead: int) -> StreamFrontEnd:
        """A stream's whole front end, with the spec's VAD."""
        from asr_core.vad import VadConfig

        vad = VadConfig(**self.spec.vad) if self.spec.vad else None
        return StreamFrontEnd(self.new(lookahead), lookahead, vad)
