"""Mel frames -> encoder chunks of the cache-aware schedule (model_spec.md §5.1).

With lookahead r (80 ms encoder frames) and subsampling factor 8: the first chunk has 1 + 8r mel
frames, every later chunk 8(r+1); each yields r+1 encoder frames (r=3: 25 then 32 mel frames, 320 ms).
At end of stream the frames left over (fewer than a chunk) form a short final chunk; the encoder
pads it like the offline causal conv does, so no frame is invented here. Geometry comes from the
encoder package (asr_core.encoder.geometry), the one place that defines it.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from asr_core.encoder.geometry import chunk_frames, encoder_frames, first_chunk_frames

F32 = NDArray[np.float32]


class MelChunker:
    """Driven by `push(frames)` (n, n_mels) in stream order and `finish()`; returns complete chunks.

    Chunks are copies (contiguous float32), in order; `chunks_emitted` counts them. After `finish()`
    nothing more is accepted.
    """

    def __init__(self, lookahead: int, subsampling_factor: int = 8) -> None:
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {lookahead}")
        self.lookahead = lookahead
        self.first_size = first_chunk_frames(lookahead, subsampling_factor)
        self.size = chunk_frames(lookahead, subsampling_factor)
        self._stages = subsampling_factor.bit_length() - 1  # stride-2 stages: 8 -> 3
        self._pending: list[F32] = []
        self._n_pending = 0
        self._last: F32 | None = None  # the newest frame pushed
        self.chunks_emitted = 0
        self._finished = False

    def _next_size(self) -> int:
        return self.first_size if self.chunks_emitted == 0 else self.size

    def push(self, frames: F32) -> list[F32]:
        if self._finished:
            raise RuntimeError("push after finish")
        if frames.ndim != 2:
            raise ValueError(f"mel frames must be (n, n_mels), got shape {frames.shape}")
        if frames.shape[0]:
            self._pending.append(frames)
            self._n_pending += frames.shape[0]
            self._last = frames[-1:].copy()
        out: list[F32] = []
        if self._n_pending < self._next_size():
            return out
        buf = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        start = 0
        while buf.shape[0] - start >= self._next_size():
            size = self._next_size()
            out.append(np.ascontiguousarray(buf[start : start + size], dtype=np.float32))
            start += size
            self.chunks_emitted += 1
        rest = buf[start:]
        self._pending = [rest] if rest.shape[0] else []
        self._n_pending = rest.shape[0]
        return out

    def flush_chunk(self, extra_chunks: int = 1) -> tuple[F32, int]:
        """What a flush encodes when the caller stopped speaking: the partial next chunk's frames,
        padded with copies of its last frame (the line's silence, which the VAD just heard) to the
        next chunk and `extra_chunks` more, so that even its last real frame has a chunk of right
        context and the last word's late pieces (emitted a frame or two after its audio) come out;
        and how many
        encoder frames hold real audio (the rest is padding). Nothing pending: padding alone after
        the newest frame, 0 real; no frame yet: an empty chunk. The frames stay pending."""
        if self._last is None:
            return np.zeros((0, 0), np.float32), 0
        size = self._next_size() + extra_chunks * self.size
        if not self._n_pending:
            return np.ascontiguousarray(np.repeat(self._last, size, axis=0), dtype=np.float32), 0
        real = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        pad = np.repeat(real[-1:], size - real.shape[0], axis=0)
        chunk = np.ascontiguousarray(np.concatenate([real, pad]), dtype=np.float32)
        first = self.chunks_emitted == 0
        return chunk, encoder_frames(real.shape[0], first, True, self._stages)

    def finish(self) -> F32 | None:
        """The short final chunk (fewer frames than a full one), or None if the frames ended on a
        chunk boundary (or there were none)."""
        self._finished = True
        if not self._n_pending:
            return None
        last = np.ascontiguousarray(np.concatenate(self._pending), dtype=np.float32)
        self._pending, self._n_pending = [], 0
        self.chunks_emitted += 1
        return last
