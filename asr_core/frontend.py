"""A stream's front end: 16 kHz PCM in, encoder chunks (mel + per-frame energies) out.

`StreamFrontEnd` is what runs before the encoder's queue, per stream: exact streaming log-mel, the
chunker (25 then 32 mel frames at lookahead 3), and the energy of the audio each encoder frame sees
(the endpointer's "is it quiet" input). The engine runs it on the caller's thread (`AsrStream.push`);
in the multi-process gateway the media workers run it and send the chunks to the engine process.

`FrontEndSpec` is what a process needs to build front ends without loading the model (no MLX, no
weights): the features block, the mel filterbank's file, the subsampling factor and the lookaheads.
The engine's process writes it (`AsrModel.frontend_spec()`), the others read it as JSON.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
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


@dataclass(frozen=True, slots=True)
class ChunkPayload:
    """What travels with a mel chunk from the front end through the encoder to the decoder."""

    mel: np.ndarray
    energies_db: np.ndarray  # per encoder frame of the chunk (full chunk length; a short one is cut)
    completed_at: float  # monotonic time of the push that completed the chunk


class StreamFrontEnd:
    """Features, chunking and frame energies of one stream. Not thread-safe (one caller)."""

    def __init__(
        self, frontend: FrontEnd, lookahead: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._frontend = frontend
        self._clock = clock
        self._frame_span = lookahead + 1
        self.chunks = 0  # chunks produced (their sequence numbers)
        self.samples = 0  # audio pushed
        self._hist = np.zeros(0, np.float32)  # audio from sample _hist_start on (for frame energies)
        self._hist_start = 0

    @property
    def audio_ms(self) -> int:
        return self.samples * 1000 // SAMPLE_RATE_HZ

    def push(self, pcm: np.ndarray) -> list[ChunkPayload]:
        """Float32 mono audio in [-1, 1] (checked by the caller); the chunks it completes."""
        if pcm.size == 0:
            return []
        mels = self._frontend.push(pcm)
        self._hist = np.concatenate([self._hist, pcm]) if self._hist.size else pcm.copy()
        self.samples += pcm.size
        return self._payloads(mels) if mels else []

    def finish(self) -> tuple[list[ChunkPayload], bool]:
        """End of audio: the remaining chunks, and whether the last is the stream's final short one."""
        mels, last_is_final = self._frontend.finish()
        return self._payloads(mels), last_is_final

    def _payloads(self, mels: list[np.ndarray]) -> list[ChunkPayload]:
        now = self._clock()
        out = []
        for mel in mels:
            first = self.chunks * self._frame_span
            out.append(ChunkPayload(mel=mel, energies_db=self._energies(first), completed_at=now))
            self.chunks += 1
        # Keep only the audio the next chunk's frame energies need.
        keep_from = max(
            0, self.chunks * self._frame_span * SAMPLES_PER_FRAME + _ENERGY_END - SAMPLES_PER_FRAME
        )
        if keep_from > self._hist_start:
            self._hist = self._hist[keep_from - self._hist_start :]
            self._hist_start = keep_from
        return out

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


class FeaturesAndChunker:
    """`FrontEnd` from the streaming log-mel and the chunker."""

    def __init__(self, features: Any, chunker: Any) -> None:
        self._features = features
        self._chunker = chunker

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


@dataclass(frozen=True, slots=True)
class FrontEndSpec:
    """What builds a model's front ends elsewhere: JSON-able, no weights."""

    features: Mapping[str, Any]
    mel_filters_path: str
    n_mels: int
    n_bins: int
    mel_filters_transposed: bool
    subsampling_factor: int
    lookaheads: tuple[int, ...]
    default_lookahead: int
    prompts: Mapping[str, int] = field(default_factory=dict)  # locale -> prompt id (language check)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["lookaheads"] = list(self.lookaheads)
        d["features"] = dict(self.features)
        d["prompts"] = dict(self.prompts)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> FrontEndSpec:
        return cls(
            features=dict(d["features"]),
            mel_filters_path=str(d["mel_filters_path"]),
            n_mels=int(d["n_mels"]),
            n_bins=int(d["n_bins"]),
            mel_filters_transposed=bool(d["mel_filters_transposed"]),
            subsampling_factor=int(d["subsampling_factor"]),
            lookaheads=tuple(int(x) for x in d["lookaheads"]),
            default_lookahead=int(d["default_lookahead"]),
            prompts={str(k): int(v) for k, v in dict(d.get("prompts", {})).items()},
        )

    def mel_filters(self) -> np.ndarray:
        raw = np.fromfile(Path(self.mel_filters_path), dtype="<f4")
        if self.mel_filters_transposed:
            return np.ascontiguousarray(raw.reshape(self.n_bins, self.n_mels).T)
        return raw.reshape(self.n_mels, self.n_bins)


class FrontEndFactory:
    """Front ends of one model from its spec (the filterbank read once)."""

    def __init__(self, spec: FrontEndSpec) -> None:
        from asr_core.features import FeatureConfig

        self.spec = spec
        self._filters = spec.mel_filters()
        self._features = FeatureConfig.from_dict(spec.features)

    def new(self, lookahead: int) -> FrontEnd:
        from asr_core.chunker import MelChunker
        from asr_core.features import StreamingLogMel

        if lookahead not in self.spec.lookaheads:
            raise ValueError(
                f"lookahead {lookahead} not supported; the model has {list(self.spec.lookaheads)}"
            )
        return FeaturesAndChunker(
            StreamingLogMel(self._filters, self._features),
            MelChunker(lookahead, self.spec.subsampling_factor),
        )
