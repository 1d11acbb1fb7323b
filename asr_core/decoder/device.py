"""Greedy RNN-T decoding on the accelerator, for every stream of an encoder step at once (MLX).

`DeviceDecoder` keeps each stream's predictor state (g, h, c) in a slot of device-resident pools, like
the encoder's caches, and decodes the chunks of one encoder step in one label-looping pass:

    per iteration, for all B rows at once (rows with no frame left are masked):
        ids[u] = argmax(joint(frame[u], g)) for every frame u of the row    one (B*T, J) x (J, V) GEMM
        u = the row's first frame >= t whose id is not blank (none: the row is done)
        emit k = ids[u] at frame u; g, h, c = LSTM(k, h, c)
        t = u, or u + 1 once the row emitted max_symbols on frame u

which is exactly the per-stream greedy rule (greedy.py): between two emissions the predictor state does
not change, so the blank frames the rule steps over one by one are all judged by the same g, and one
iteration may pass them together. The tokens are those of `GreedyDecoder` (up to float rounding in the
joint: ties between two logits are the only way they can differ), and a row needs one iteration per
token it emits and one more, not one per frame as well. The host does not look at the results between
iterations: as many are queued at once as the last decodes needed, then one sync fetches the tokens
together with whether a row still emits; only then are more queued (twice as many each time).

Why on the device: the joint (640 x 13 088 at full size) is 99 % of the arithmetic, ~0.4 TFLOP/s
at 2,000 calls: several CPU cores, or a rounding error of an H200's time next to the encoder.
One thread owns it (the engine's MLX thread, right after the encoder step that made the frames).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from asr_core import hostcopy
from asr_core.decoder.greedy import Emission
from asr_core.decoder.mlx_rnnt import MlxRnnt
from asr_core.decoder.numpy_rnnt import RnntWeights


def _time_bucket(t: int) -> int:
    """Frames per row padded to a power of two (a short final chunk must not trace anew)."""
    return 1 << max(0, t - 1).bit_length()


def _bucket(n: int) -> int:
    for size in (1, 2, 4, 8, 16, 32, 64):
        if size >= n:
            return size
    return -(-n // 64) * 64


class DeviceDecoder:
    def __init__(
        self,
        weights: RnntWeights,
        blank_id: int,
        max_symbols: int = 10,
        *,
        dtype: mx.Dtype = mx.float32,
        capacity: int = 64,
        compile: bool = True,
    ) -> None:
        if max_symbols < 1:
            raise ValueError("max_symbols must be >= 1")
        self.blank_id = blank_id
        self.max_symbols = max_symbols
        self.dtype = dtype
        self.net = MlxRnnt(weights, dtype)
        self.layers, self.hidden = self.net.layers, self.net.hidden
        self.width = int(weights.proj_w.shape[0])  # J: the joint's input width
        step = self._iteration
        self._step = mx.compile(step) if compile else step
        # The state every stream starts from: the predictor primed with blank (greedy.py's reset).
        zeros = mx.zeros((self.layers, 1, self.hidden), dtype=dtype)
        g0, h0, c0 = self.net.predict(mx.array([blank_id], dtype=mx.int32), zeros, zeros)
        self._g0, self._h0, self._c0 = g0[0], h0[:, 0], c0[:, 0]
        self._g = mx.zeros((0, self.width), dtype=dtype)
        self._h = mx.zeros((self.layers, 0, self.hidden), dtype=dtype)
        self._c = mx.zeros((self.layers, 0, self.hidden), dtype=dtype)
        self._capacity = 0
        self._free: list[int] = []
        self._frames: dict[int, int] = {}  # slot -> frames consumed (host)
        self._reset_stats()
        self._grow(max(1, capacity))

    # -- slots -----------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._capacity

    def alloc(self) -> int:
        """A slot for a new stream, its predictor primed with blank."""
        return self.alloc_many(1)[0]

    def alloc_many(self, n: int) -> list[int]:
        """Slots for n new streams, primed with one scatter per pool (a step's joins at once: one
        scatter each would chain n updates of the same pools into the next step's graph)."""
        while len(self._free) < n:
            self._grow(2 * self._capacity)
        slots = [heapq.heappop(self._free) for _ in range(n)]
        if not slots:
            return slots
        idx = mx.array(slots, dtype=mx.int32)
        self._g[idx] = mx.broadcast_to(self._g0[None], (n, self.width))
        self._h[:, idx] = mx.broadcast_to(self._h0[:, None], (self.layers, n, self.hidden))
        self._c[:, idx] = mx.broadcast_to(self._c0[:, None], (self.layers, n, self.hidden))
        for slot in slots:
            self._frames[slot] = 0
        return slots

    def release(self, slot: int) -> None:
        if self._frames.pop(slot, None) is None:
            raise ValueError(f"decoder slot {slot} is not allocated")
        heapq.heappush(self._free, slot)

    def _grow(self, capacity: int) -> None:
        add = capacity - self._capacity
        self._g = mx.concatenate([self._g, mx.zeros((add, self.width), dtype=self.dtype)])
        self._h = mx.concatenate(
            [self._h, mx.zeros((self.layers, add, self.hidden), dtype=self.dtype)], axis=1
        )
        self._c = mx.concatenate(
            [self._c, mx.zeros((self.layers, add, self.hidden), dtype=self.dtype)], axis=1
        )
        mx.eval(self._g, self._h, self._c)
        for slot in range(self._capacity, capacity):
            heapq.heappush(self._free, slot)
        self._capacity = capacity

    def warmup(self, max_frames: int = 16, max_rows: int = 1) -> int:
        """Trace the compiled iteration for every (rows, frames) bucket up to `max_rows` rows (a step's
        chunks) and `max_frames` frames (a chunk, a flush's padding, a short last chunk), so that no
        live decode pays for it: on a GPU a shape first met costs a trace and kernel compilation
        (seconds on a fresh machine) with every stream waiting. Decodes silence into scratch slots,
        committing as a live decode does (the commit's scatters are kernels too; a slot given out
        later is primed afresh); returns the number of shapes traced."""
        frame_sizes = sorted({_time_bucket(t) for t in range(1, max_frames + 1)})
        row_sizes = sorted({_bucket(n) for n in range(1, max(1, max_rows) + 1)})
        slots = self.alloc_many(row_sizes[-1])
        try:
            for rows in row_sizes:
                for size in frame_sizes:
                    silence = [np.zeros((size, self.width), np.float32)] * rows
                    self.decode(slots[:rows], silence)
        finally:
            for slot in slots:
                self.release(slot)
        self._reset_stats()
        return len(row_sizes) * len(frame_sizes)

    def _reset_stats(self) -> None:
        """As new: warm-up decodes are not the live decodes the engine's report counts."""
        # Iterations queued before the first sync: what the last decodes needed (decays by one a call).
        self._expect = 2
        # Running totals for the engine's step report: decode calls, iterations queued, host syncs.
        self.decodes = self.iterations = self.syncs = 0

    # -- decoding --------------------------------------------------------------------------------

    def decode(
        self,
        slots: Sequence[int],
        frames: Sequence[np.ndarray],
        first_frames: Sequence[int] | None = None,
        *,
        commit_frames: Sequence[int] | None = None,
    ) -> list[list[Emission]]:
        """Decode each slot's chunk of joiner frames (T_i, J). An emission's frame is the chunk's
        `first_frames[i]` plus its offset in the chunk (the stream's media timeline, which skips
        dropped chunks); without `first_frames`, the slot's own count of frames decoded (as
        `GreedyDecoder`). `commit_frames[i]` (default: all T_i) keeps the state row i had after its
        first that many frames, and decoding goes on from it through the rest, emissions included, as
        a second call from the kept state with `commit_frames` 0 would (a flush: its real frames, then
        its padding, in one pass); 0 keeps the state as it was (a trial decode)."""
        n = len(slots)
        if n != len(frames):
            raise ValueError("one frames array per slot")
        if len(set(slots)) != n:
            raise ValueError("a slot appears twice in one decode")
        for s in slots:
            if s not in self._frames:
                raise ValueError(f"decoder slot {s} is not allocated")
        out: list[list[Emission]] = [[] for _ in range(n)]
        lengths = np.array([f.shape[0] for f in frames], np.int32)
        keep = lengths if commit_frames is None else np.minimum(np.asarray(commit_frames, np.int32), lengths)
        t_max = int(lengths.max()) if n else 0
        if t_max == 0:
            return out
        # Rows padded to a few sizes so the compiled iteration is traced for few shapes; a padding
        # row has no frames (never active) and reads slot 0's state, which it never writes.
        bp = _bucket(n)
        padded = np.zeros((bp, _time_bucket(t_max), self.width), np.float32)
        for i, f in enumerate(frames):
            hostcopy.put(padded[i, : f.shape[0]], f)  # keeps the interpreter lock (hostcopy)
        slot_rows = np.zeros(bp, np.int32)
        slot_rows[:n] = slots
        len_rows = np.zeros(bp, np.int32)
        len_rows[:n] = lengths
        keep_rows = np.zeros(bp, np.int32)
        keep_rows[:n] = keep
        idx = mx.array(slot_rows)
        feats = mx.array(padded, dtype=self.dtype)
        lens, kept_len = mx.array(len_rows), mx.array(keep_rows)
        g, h, c = self._g[idx], self._h[:, idx], self._c[:, idx]
        # Each row's state after its first `keep` frames: its start state until it gets there.
        kept: list[mx.array] = [g, h, c]
        t = mx.zeros((bp,), dtype=mx.int32)
        sym = mx.zeros((bp,), dtype=mx.int32)
        queue: list[list[mx.array]] = [[], [], [], []]  # per iteration: token, prob, emitted, frame
        host: list[np.ndarray] = []
        budget = t_max * self.max_symbols + 1  # every row is done after this many iterations
        want, extra, queued = min(budget, self._expect), 2, 0
        real = idx[:n]
        # The frames' and rows' positions, made once for all the iterations (not a kernel in each).
        frame, row = mx.arange(feats.shape[1], dtype=mx.int32)[None], mx.arange(bp, dtype=mx.int32)
        while True:
            for _ in range(want - queued):
                k, p, emit, u, t, sym, g, h, c, *kept = self._step(
                    feats, frame, row, lens, kept_len, t, sym, g, h, c, *kept
                )
                for q, x in zip(queue, (k, p, emit, u), strict=True):
                    q.append(x)
            queued = want
            # The states kept so far; a later round writes the same rows again.
            self._g[real] = kept[0][:n]
            self._h[:, real] = kept[1][:, :n]
            self._c[:, real] = kept[2][:, :n]
            # One sync fetches this round's tokens, whether a row still has frames to judge, and the
            # committed states (mx.eval lets go of the interpreter lock while the device works).
            stacked = [mx.stack(x[len(host[0]) if host else 0 :]) for x in queue]
            busy = mx.any(t < lens)
            mx.eval(busy, *stacked, self._g, self._h, self._c)
            self.syncs += 1
            part = [hostcopy.copy(np.asarray(x)) for x in stacked]  # keeps the interpreter lock
            host = part if not host else [np.concatenate([a, b]) for a, b in zip(host, part, strict=True)]
            if queued >= budget or not busy.item():
                break
            want = min(budget, queued + extra)
            extra *= 2
        self.iterations += queued
        self.decodes += 1
        k_host, p_host, e_host, u_host = host
        # Iterations the rows needed: up to the last that emitted, and one that found nothing more.
        busy_its = np.nonzero(e_host[:, :n].any(axis=1))[0]
        needed = int(busy_its[-1]) + 2 if busy_its.size else 1
        self._expect = max(needed, self._expect - 1)
        base = list(first_frames) if first_frames is not None else [self._frames[s] for s in slots]
        for it, r in zip(*np.nonzero(e_host[:, :n]), strict=True):
            out[r].append(Emission(int(k_host[it, r]), base[r] + int(u_host[it, r]), float(p_host[it, r])))
        for s, length in zip(slots, keep.tolist(), strict=True):
            self._frames[s] += length
        return out

    def _iteration(
        self,
        feats: mx.array,
        frame: mx.array,
        row: mx.array,
        lens: mx.array,
        kept_len: mx.array,
        t: mx.array,
        sym: mx.array,
        g: mx.array,
        h: mx.array,
        c: mx.array,
        g_kept: mx.array,
        h_kept: mx.array,
        c_kept: mx.array,
    ) -> tuple[mx.array, ...]:
        """One emission (or none) per row: the first frame from t on whose token is not blank.
        `frame` (1, T) and `row` (B,): the frames' and the rows' indices."""
        tb = feats.shape[1]
        logits = self.net.joint(feats, g[:, None])  # (B, T, V): every frame judged by the row's g
        judged = (frame >= t[:, None]) & (frame < lens[:, None])
        nonblank = judged & (mx.argmax(logits, axis=2) != self.blank_id)
        u = mx.min(mx.where(nonblank, frame, tb), axis=1).astype(mx.int32)  # tb: no token left
        emit = u < lens
        at = mx.minimum(u, tb - 1)
        chosen = logits[row, at].astype(mx.float32)  # (B, V): the logits at frame u
        k = mx.argmax(chosen, axis=1).astype(mx.int32)
        p = mx.exp(mx.max(chosen, axis=1) - mx.logsumexp(chosen, axis=1))  # the winner's probability
        # A row that passes its commit point over blank frames keeps the state it had before emitting.
        r = ((t < kept_len) & (u >= kept_len))[:, None]
        g_kept = mx.where(r, g, g_kept)
        h_kept = mx.where(r[None], h, h_kept)
        c_kept = mx.where(r[None], c, c_kept)
        g_new, h_new, c_new = self.net.predict(mx.where(emit, k, self.blank_id), h, c)
        e = emit[:, None]
        g = mx.where(e, g_new, g)
        h = mx.where(e[None], h_new, h)
        c = mx.where(e[None], c_new, c)
        sym = mx.where(emit, mx.where(u == t, sym, 0) + 1, 0)  # tokens emitted on frame u so far
        advance = emit & (sym >= self.max_symbols)
        t_next = mx.where(emit, u + advance.astype(mx.int32), mx.maximum(t, lens))
        sym = mx.where(advance, 0, sym)
        # ... or, having emitted max_symbols on its last frame before the point, the state after that.
        r = (emit & (u < kept_len) & (t_next >= kept_len))[:, None]
        g_kept = mx.where(r, g, g_kept)
        h_kept = mx.where(r[None], h, h_kept)
        c_kept = mx.where(r[None], c, c_kept)
        return k, p, emit, u, t_next, sym, g, h, c, g_kept, h_kept, c_kept
