"""Streaming 8 → 16 kHz with soxr's filter at a constant delay.

Why not `soxr.ResampleStream.resample_chunk` block by block: soxr buffers internally and releases output
in lumps, so its delay swings between ~14 and ~135 ms at HQ (measured here, 80 ms blocks). ASR latency
should not wobble by 120 ms, so we run the same soxr filter over each block plus fixed context on both
sides (overlap-save) and keep the middle: the delay is then exactly `lookahead` input samples (12 ms at
HQ), and the output equals one-shot `soxr.resample` of the whole signal to float rounding (the context
covers the filter's impulse response down to 1e-7 of its peak). It costs ~20 µs per 80 ms block.

Length bookkeeping is exact: after `finish()`, the output has exactly 2 × the input samples.
"""

from __future__ import annotations

import functools
import math
from typing import Protocol

import numpy as np
import soxr
from numpy.typing import NDArray

IN_RATE = 8000
OUT_RATE = 16000
RATIO = OUT_RATE // IN_RATE
_EMPTY = np.zeros(0, dtype=np.float32)


@functools.cache
def filter_reach(quality: str) -> int:
    """Input samples either side of a sample that its 16 kHz outputs depend on (|h| > 1e-7 of peak)."""
    n = 2048
    impulse = np.zeros(n + 1, dtype=np.float32)
    impulse[n // 2] = 1.0
    h = np.abs(soxr.resample(impulse, IN_RATE, OUT_RATE, quality=quality))
    nz = np.nonzero(h > 1e-7 * h.max())[0]
    reach_out = int(max(n - nz.min(), nz.max() - n))  # centre is output sample n (= 2 · n/2)
    return math.ceil(reach_out / RATIO) + 2


class Upsampler:
    """8 kHz float32 in, 16 kHz float32 out, with a constant delay of `lookahead` input samples.

    `push(x)` returns every output sample whose inputs (plus the filter's reach) are known; `finish()`
    treats the signal as ending with silence and returns the rest. One instance per stream.
    """

    def __init__(self, quality: str = "HQ") -> None:
        self.quality = quality
        self.lookahead = filter_reach(quality)
        self._context = self.lookahead
        self._stream = soxr.ResampleStream(IN_RATE, OUT_RATE, 1, dtype="float32", quality=quality)
        # Left context (already emitted) followed by pending input (waiting for lookahead).
        self._buf: NDArray[np.float32] = np.zeros(self._context, dtype=np.float32)
        self._n_new = 0  # staged input samples a pass would turn into output
        self.samples_in = 0
        self.samples_out = 0
        self._finished = False

    def push(self, x: NDArray[np.float32]) -> NDArray[np.float32]:
        self.stage(x)
        return self.run_due()

    def finish(self) -> NDArray[np.float32]:
        """The remaining output, as if the input were followed by silence; then exactly 2× the input."""
        if self._finished:
            return _EMPTY
        self._finished = True
        pending = len(self._buf) - self._context
        self._buf = np.concatenate([self._buf, np.zeros(self.lookahead, dtype=np.float32)])
        self._n_new = max(0, pending)
        return self.run_due()

    # The pass in three steps, for `UpsampleBatch` to run many streams' passes together: `stage` the
    # input; while `due`, `segment()` is what the pass resamples and `resampled(y)` takes its output.

    def stage(self, x: NDArray[np.float32]) -> None:
        if self._finished:
            raise RuntimeError("input after finish()")
        if len(x) == 0:
            return
        self.samples_in += len(x)
        self._buf = np.concatenate([self._buf, np.asarray(x, dtype=np.float32)])
        self._n_new = max(0, len(self._buf) - self._context - self.lookahead)

    @property
    def due(self) -> bool:
        """Input staged that a pass would turn into output."""
        return self._n_new > 0

    def segment(self) -> NDArray[np.float32]:
        """The pass's input: the left context, the new samples and the lookahead after them."""
        return self._buf[: self._context + self._n_new + self.lookahead]

    def resampled(self, y: NDArray[np.float32]) -> NDArray[np.float32]:
        """The new output, from `y`, soxr's output for `segment()` (a fresh pass, `last=True`)."""
        k, n_new = self._context, self._n_new
        if len(y) != RATIO * (k + n_new + self.lookahead):  # pragma: no cover - soxr gives 2x for last=True
            raise RuntimeError(f"soxr returned {len(y)} samples for {k + n_new + self.lookahead}")
        out = np.ascontiguousarray(y[RATIO * k : RATIO * (k + n_new)])
        self._buf = self._buf[n_new:]
        self._n_new = 0
        self.samples_out += len(out)
        return out

    def run_due(self) -> NDArray[np.float32]:
        """The due pass, alone: its new output (none when nothing is due)."""
        if not self.due:
            return _EMPTY
        self._stream.clear()  # a fresh pass over the segment: soxr output for it equals the one-shot's
        return self.resampled(self._stream.resample_chunk(self.segment(), last=True))


class UpsampleBatch:
    """The due passes of many `Upsampler`s (one process's calls) run together: one soxr stream of C
    channels per segment length, whose every channel equals a one-channel pass over it sample for
    sample. What this saves is soxr's filter design, which `clear()` redoes for every pass (most of a
    pass's cost at 80 ms blocks: docs/benchmarks.md).

    `add(job)` a job whose upsampler is due; `run()` runs them and calls each job's
    `resampled(y)` with its pass's output. A job no longer due at `run()` (its owner ran its pass
    alone meanwhile) is skipped."""

    MAX_CHANNELS = 64

    def __init__(self, quality: str = "HQ") -> None:
        self.quality = quality
        self._jobs: list[UpsampleJob] = []
        self._streams: dict[int, soxr.ResampleStream] = {}  # by channel count
        self.runs = 0  # runs that had a pass to run, and the passes they ran
        self.passes = 0

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, job: UpsampleJob) -> None:
        if job.upsampler.quality != self.quality:
            raise ValueError(f"a {job.upsampler.quality} stream in a {self.quality} batch")
        self._jobs.append(job)

    def run(self) -> None:
        jobs, self._jobs = self._jobs, []
        by_length: dict[int, list[UpsampleJob]] = {}
        seen: set[int] = set()  # a job added again after its owner ran a pass alone runs once
        for job in jobs:
            if job.upsampler.due and id(job) not in seen:
                seen.add(id(job))
                by_length.setdefault(len(job.upsampler.segment()), []).append(job)
        for group in by_length.values():
            for i in range(0, len(group), self.MAX_CHANNELS):
                part = group[i : i + self.MAX_CHANNELS]
                y = self._stream(len(part)).resample_chunk(
                    np.stack([job.upsampler.segment() for job in part], axis=1), last=True
                )
                for c, job in enumerate(part):
                    job.resampled(job.upsampler.resampled(y[:, c]))
        if seen:
            self.runs += 1
            self.passes += len(seen)

    def _stream(self, channels: int) -> soxr.ResampleStream:
        """A fresh soxr stream of `channels` channels (one kept per count: a new one designs its filter
        as `clear()` does)."""
        stream = self._streams.get(channels)
        if stream is None:
            stream = soxr.ResampleStream(IN_RATE, OUT_RATE, channels, dtype="float32", quality=self.quality)
            self._streams[channels] = stream
        else:
            stream.clear()
        return stream


class UpsampleJob(Protocol):
    """What `UpsampleBatch` runs: an upsampler's due pass, and where its new output goes."""

    @property
    def upsampler(self) -> Upsampler: ...

    def resampled(self, out: NDArray[np.float32], /) -> None: ...
