"""From G.711 codes on the 8 kHz media timeline to fixed-size 16 kHz float32 blocks (pure).

The caller appends, in timeline order, packet payloads (`append_codes`) and concealment
(`append_silence`); the pipeline decodes per block, not per packet (one table lookup over ~640 codes),
upsamples with `Upsampler`, and emits `AudioBlock`s of exactly `block_ms` (the last one at `finish()`
may be shorter). Block k starts at k·block_ms on the media timeline, so `start_ms` is exact, and the
total output is exactly 2 × the samples appended. A block is emitted as soon as the input covers its
end plus the resampler's lookahead (12 ms at HQ): the added latency is constant.

With an `UpsampleBatch` (a process's calls resampled together), a block's resampling waits for the
batch's `run()`: the pipeline puts a `PendingBlocks` in `out` where the blocks belong and fills it then;
its owner holds back the events after it until it is filled, so the order is the same as without.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from gateway.audio.g711 import DECODE_FLOAT32, SILENCE_CODE
from gateway.audio.resample import RATIO, UpsampleBatch, Upsampler

IN_RATE = 8000
SAMPLES_PER_MS = IN_RATE // 1000


@dataclass(frozen=True, slots=True, eq=False)
class AudioBlock:
    """16 kHz mono float32 in [-1, 1], starting `start_ms` into the media timeline."""

    pcm: NDArray[np.float32]
    start_ms: int


class PendingBlocks:
    """The place in an event list of blocks whose resampling waits for an `UpsampleBatch`: `done` once
    the batch (or the pipeline alone) has run, then `blocks` are the blocks in order (maybe none)."""

    __slots__ = ("blocks", "done")

    def __init__(self) -> None:
        self.blocks: list[AudioBlock] = []
        self.done = False


class _Blocks(Protocol):
    def append(self, block: AudioBlock, /) -> None: ...


class BlockOut(Protocol):
    """Where blocks go: any list whose item type includes AudioBlock (and PendingBlocks, batched)."""

    def append(self, block: AudioBlock | PendingBlocks, /) -> None: ...

    def __getitem__(self, index: int, /) -> object: ...


class AudioPipeline:
    __slots__ = (
        "_batch",
        "_block_in",
        "_block_ms",
        "_block_out",
        "_blocks",
        "_codec",
        "_codes",
        "_finished",
        "_lut",
        "_out",
        "_out_len",
        "_pending",
        "_samples_out",
        "_silence",
        "_trigger",
        "_up",
        "_zero_runs",
        "position",
    )

    def __init__(
        self, codec: str, block_ms: int = 80, quality: str = "HQ", batch: UpsampleBatch | None = None
    ) -> None:
        if block_ms <= 0:
            raise ValueError("block_ms must be positive")
        self._codec = codec
        self._lut = DECODE_FLOAT32[codec]
        self._silence = bytes([SILENCE_CODE[codec]])
        self._codes = bytearray()
        # Silence is written as codes (cheap) and zeroed after decoding: A-law has no code for 0.
        self._zero_runs: list[list[int]] = []
        self._up = Upsampler(quality)
        self._batch = batch
        self._pending: PendingBlocks | None = None  # blocks waiting for the batch
        self._block_ms = block_ms
        self._block_in = block_ms * SAMPLES_PER_MS
        self._block_out = self._block_in * RATIO
        self._out: list[NDArray[np.float32]] = []
        self._out_len = 0
        self._blocks = 0
        self._trigger = self._block_in + self._up.lookahead
        self._finished = False
        self._samples_out = 0
        self.position = 0  # 8 kHz samples on the timeline so far

    @property
    def codec(self) -> str:
        return self._codec

    @property
    def lookahead(self) -> int:
        return self._up.lookahead

    @property
    def upsampler(self) -> Upsampler:
        return self._up

    @property
    def pending(self) -> bool:
        """Blocks wait for the batch's run (their `PendingBlocks` is in an event list, not yet done)."""
        return self._pending is not None

    @property
    def samples_out(self) -> int:
        """16 kHz samples handed out in blocks so far."""
        return self._samples_out

    def append_codes(self, payload: bytes, out: BlockOut) -> None:
        self._codes += payload
        self.position += len(payload)
        if self.position >= self._trigger:
            self._process(out)

    def append_silence(self, n: int, out: BlockOut) -> None:
        if n <= 0:
            return
        start = len(self._codes)
        runs = self._zero_runs
        if runs and runs[-1][1] == start:
            runs[-1][1] = start + n
        else:
            runs.append([start, start + n])
        self._codes += self._silence * n
        self.position += n
        if self.position >= self._trigger:
            self._process(out)

    def set_codec(self, codec: str, out: BlockOut) -> None:
        """Switch the law (re-INVITE): what was appended so far is decoded with the old one first."""
        if codec == self._codec:
            return
        self._process(out)
        self._codec = codec
        self._lut = DECODE_FLOAT32[codec]
        self._silence = bytes([SILENCE_CODE[codec]])

    def finish(self, out: BlockOut) -> None:
        """Flush the resampler tail; the last block may be shorter than block_ms."""
        if self._finished:
            return
        self._process(out)
        self.resample_alone()
        tail = self._up.finish()
        self._finished = True
        if len(tail):
            self._out.append(tail)
            self._out_len += len(tail)
        self._emit(out, final=True)

    def resample_alone(self) -> None:
        """Run the pass the batch has not run yet, now, for this stream alone."""
        if self._pending is not None:
            self.resampled(self._up.run_due())

    def resampled(self, y: NDArray[np.float32]) -> None:
        """The batch's output for this stream's pass: its blocks fill the `PendingBlocks`."""
        pending = self._pending
        assert pending is not None
        self._pending = None
        self._add_output(y)
        self._emit(pending.blocks, final=False)
        pending.done = True

    def _process(self, out: BlockOut) -> None:
        if self._codes:
            x = self._lut[np.frombuffer(self._codes, dtype=np.uint8)]
            for start, end in self._zero_runs:
                x[start:end] = 0.0
            self._codes = bytearray()
            self._zero_runs.clear()
            if self._batch is None:
                self._add_output(self._up.push(x))
            else:
                # More audio before the batch has run (a loop turn long enough for a socket to hold more
                # than a block's packets) joins the pass that waits: one pass, its blocks in its place.
                # Only if an event came after that place does the waiting pass run first, alone, so that
                # the new blocks come after the event as they would without a batch.
                if self._pending is not None and out[-1] is not self._pending:
                    self.resample_alone()
                self._up.stage(x)
                if self._pending is None and self._up.due:
                    self._pending = PendingBlocks()
                    out.append(self._pending)
                    self._batch.add(self)
        self._emit(out, final=False)
        # The next block is due once the input covers its end and the lookahead after it.
        lookahead, size = self._up.lookahead, self._block_in
        self._trigger = (max(0, self.position - lookahead) // size + 1) * size + lookahead

    def _add_output(self, y: NDArray[np.float32]) -> None:
        if len(y):
            self._out.append(y)
            self._out_len += len(y)

    def _emit(self, out: _Blocks, final: bool) -> None:
        size = self._block_out
        if self._out_len < size and not (final and self._out_len):
            return
        buf = self._out[0] if len(self._out) == 1 else np.concatenate(self._out)
        i = 0
        while len(buf) - i >= size or (final and i < len(buf)):
            block = buf[i : i + size].copy()
            np.clip(block, -1.0, 1.0, out=block)  # soxr's filter can overshoot full scale slightly
            out.append(AudioBlock(block, self._blocks * self._block_ms))
            self._blocks += 1
            self._samples_out += len(block)
            i += len(block)
        rest = buf[i:]
        self._out = [rest] if len(rest) else []
        self._out_len = len(rest)
