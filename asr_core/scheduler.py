"""Encoder scheduler: which streams' chunks go into the next batched encoder step. Pure policy.

Theory of operation
-------------------
Streams join (`add_stream`) and leave (`end_stream` after their last chunk, or `close_stream` at once)
at any time. Callers hand over complete mel chunks (`push_chunk`); the engine's MLX thread asks
`schedule(now)` for a `StepPlan`, executes it (frees the slots of `plan.left`, allocates slots for
`plan.joined`, runs one batched encoder step over `plan.rows`) and reports the per-row encoder frames
with `update_from_output(plan, frames)`, which returns one `EncodedChunk` per row for decoding. When
the decoder is done with a chunk, `chunk_decoded(key)` frees its place in the stream's pipeline.
The scheduler owns no thread, lock or clock: every call takes `now` (monotonic seconds) where time
matters, and `next_deadline()` says when `schedule` should be called again. The engine serializes
calls with one lock.

Invariants
1. Order within a stream is sacred: a stream has at most one chunk in flight (planned, not yet
   reported) and its chunks are planned in push order. So a step holds at most one chunk per stream.
2. A step is planned when `max_batch` chunks are ready, when every stream that could contribute has a
   ready chunk (waiting cannot make the batch bigger), when a ready stream has a flush queued (its
   caller stopped speaking and waits for the final: a batching wait would add straight to the time
   to final), or when the oldest ready chunk has waited `max_wait_ms`. Rows are taken oldest first
   (by the arrival of each stream's next chunk; ties in join order), at most `max_batch` rows per
   step as the encoder runs them (a flush counts `flush_rows`: the encoder may run one as several
   rows, and a step past the batch sizes it was compiled for would run uncompiled); the rest keep
   their place and go first next time.
3. A stream has at most `max_undecoded_chunks` chunks handed to the encoder and not yet decoded. A
   slow decoder thus backs up into the encoder queue, which is the one place where overload shows.
4. Backpressure: a stream holds at most `max_queued_chunks` chunks. A push beyond that drops the
   oldest queued chunk that is neither the stream's first nor its last, and returns a `ChunkDropped`
   (counted per stream). Dropping happens *before* the encoder, so the encoder state is never touched
   by a drop: the stream's next chunk simply follows the last encoded one (the audio is spliced, like
   concealment of a lost packet run). The first chunk is never dropped because it has its own shape
   (1 + 8r mel frames) and the encoder's first-chunk padding; the last one because it carries the
   end-of-stream padding. Media time is kept: chunk `seq` covers encoder frames
   [seq*(r+1), (seq+1)*(r+1)) whatever was dropped before it.
6. A flush (`push_chunk(..., flush=True)`: the stream's pending partial chunk, encoded without
   touching its caches when the caller stopped speaking) takes the seq of the chunk that will later
   cover the same audio and does not advance the count: it is ordered like any chunk (after the
   chunks pushed before it) and its frames start at that chunk's first frame.
5. A stream holds an encoder slot from the plan that carries its first chunk (`joined`) until the
   plan after its last chunk was reported, or after it was closed (`left`); a stream closed before
   its first chunk was planned leaves with `had_slot=False`. Every stream leaves exactly once.

How long to wait (rule 2's `max_wait_ms`) depends on what a step costs. With `wait_policy="adaptive"`
the runner reports every step (`observe_step(rows, seconds)`); `StepCost` fits seconds = a + b*rows
to them, and the wait is `WAIT_PER_FIXED_COST * a`, capped by `max_wait_ms`. On an accelerator a step
of 1 row costs about what a step of 128 costs (a >> b), so it pays to gather rows: with the wait at 3a,
at most a quarter of the time goes to the fixed cost, and a chunk waits at most 3a (+ one step) longer
than it must. On a CPU the step cost grows with every row (a small), so the wait stays small and the
policy is the plain one. Under load the wait does not matter: rows pile up while a step runs and the
next step takes `max_batch` of them.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

import numpy as np

from asr_core.config import SchedulerConfig

P = TypeVar("P")  # what the caller attaches to a chunk (the engine: mel + energies + arrival time)

LeaveReason = Literal["finished", "closed"]


class StreamPhase(enum.IntEnum):
    OPEN = enum.auto()  # takes chunks
    ENDING = enum.auto()  # end_stream was called: drains its queue, then leaves
    CLOSED = enum.auto()  # close_stream was called: queue discarded, leaves when nothing is in flight
    # Anything from LEFT on is gone from the scheduler's point of view.
    LEFT = enum.auto()


@dataclass(frozen=True, slots=True)
class StepRow(Generic[P]):
    key: int
    seq: int  # chunk number within the stream, counting dropped chunks (0 = the first chunk)
    payload: P
    is_last: bool
    first_frame: int  # encoder frame index of the chunk's first frame on the stream's media timeline
    queue_wait_s: float  # from push to this plan
    flush: bool = False  # a non-committing step of the partial chunk `seq` (invariant 6)


@dataclass(frozen=True, slots=True)
class StreamJoined:
    key: int
    prompt_id: int
    lookahead: int


@dataclass(frozen=True, slots=True)
class StreamLeft:
    key: int
    reason: LeaveReason
    had_slot: bool  # False: closed before its first chunk was planned, nothing to free


@dataclass(frozen=True, slots=True)
class StepPlan(Generic[P]):
    step_id: int
    # Free these slots first (they may be reused in this very step) ...
    left: tuple[StreamLeft, ...]
    # ... then allocate slots for streams whose first chunk is in `rows` ...
    joined: tuple[StreamJoined, ...]
    # ... then run one encoder step over these rows, in this order. May be empty (only leaves).
    rows: tuple[StepRow[P], ...]
    planned_at: float


@dataclass(frozen=True, slots=True)
class EncodedChunk(Generic[P]):
    key: int
    seq: int
    first_frame: int
    frames: np.ndarray  # (T, J) joiner input frames
    is_last: bool
    payload: P
    queue_wait_s: float
    flush: bool = False


@dataclass(frozen=True, slots=True)
class ChunkDropped:
    key: int
    seq: int
    dropped_total: int  # this stream's drops so far, this one included


# The adaptive wait, in multiples of the fitted fixed cost of a step (see the module docstring).
WAIT_PER_FIXED_COST = 3.0


class StepCost:
    """Online fit of a step's wall time as a + b * rows, forgetting old steps (half-life in steps).

    Weighted least squares over exponentially decayed sums. When the recent steps all had about the
    same number of rows the slope cannot be told from the intercept: then the whole step counts as
    fixed cost (`fixed_s` = the mean step time), which errs toward a longer wait.
    """

    def __init__(self, half_life_steps: float = 64.0) -> None:
        self._decay = 0.5 ** (1.0 / half_life_steps)
        self._s0 = self._s1 = self._s2 = self._t0 = self._t1 = 0.0
        self.steps = 0

    def add(self, rows: int, seconds: float) -> None:
        d = self._decay
        self._s0 = d * self._s0 + 1.0
        self._s1 = d * self._s1 + rows
        self._s2 = d * self._s2 + rows * rows
        self._t0 = d * self._t0 + seconds
        self._t1 = d * self._t1 + rows * seconds
        self.steps += 1

    def fit(self) -> tuple[float, float]:
        """(a, b): seconds per step and per row; (0, 0) before the first step."""
        if self._s0 == 0.0:
            return 0.0, 0.0
        mean_rows = self._s1 / self._s0
        mean_t = self._t0 / self._s0
        var = self._s2 / self._s0 - mean_rows * mean_rows
        if var < 1.0:  # rows hardly varied: no slope to be seen
            return mean_t, 0.0
        b = (self._t1 / self._s0 - mean_rows * mean_t) / var
        a = mean_t - b * mean_rows
        if b < 0.0:
            return mean_t, 0.0
        if a < 0.0:
            return 0.0, self._t1 / self._s2
        return a, b

    def fixed_s(self) -> float:
        return self.fit()[0]


class RecentRate:
    """Events (or amounts: seconds busy) a second over the last one to two `window_s` (two buckets: the
    last full one and the current one, each with its true span). Pure: `now` given."""

    def __init__(self, window_s: float = 1.0) -> None:
        self.window_s = window_s
        self._start: float | None = None
        self._current = 0.0
        self._previous = 0.0
        self._previous_span = 0.0

    def add(self, now: float, n: float = 1.0) -> None:
        self._roll(now)
        self._current += n

    def per_s(self, now: float) -> float:
        self._roll(now)
        if self._start is None:
            return 0.0
        span = self._previous_span + (now - self._start)
        return (self._previous + self._current) / span if span > 0.0 else 0.0

    def _roll(self, now: float) -> None:
        if self._start is None:
            self._start = now
        elif now - self._start >= self.window_s:
            span = now - self._start
            fresh = span < 2 * self.window_s  # else the bucket is stale: nothing came for a while
            self._previous, self._previous_span = (self._current, span) if fresh else (0.0, 0.0)
            self._current = 0.0
            self._start = now


@dataclass(slots=True)
class _Queued(Generic[P]):
    seq: int
    payload: P
    is_last: bool
    arrived_at: float
    flush: bool = False


@dataclass(slots=True)
class _Stream(Generic[P]):
    key: int
    prompt_id: int
    lookahead: int
    order: int  # join order: tie-break for equal arrival times
    phase: StreamPhase = StreamPhase.OPEN
    next_seq: int = 0
    in_flight: _Queued[P] | None = None
    undecoded: int = 0  # handed to the encoder, not yet decoded (in flight included)
    has_slot: bool = False
    got_last: bool = False
    dropped: int = 0
    encoded: int = 0
    left_at: float | None = None  # when it became ready to leave (drives next_deadline)
    leave_reason: LeaveReason = "finished"
    queue: deque[_Queued[P]] = field(default_factory=deque)


class EncoderScheduler(Generic[P]):
    """Batching policy of the encoder (see the module docstring for the invariants).

    Driven by: `add_stream`, `push_chunk`, `end_stream`, `close_stream` (callers), `schedule` and
    `update_from_output` (the MLX thread), `chunk_decoded` (decoder workers). Timer: `next_deadline()`.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._streams: dict[int, _Stream[P]] = {}
        self._joins = 0
        self._step_id = 0
        self._wait_cap_s = config.max_wait_ms / 1000.0
        # Until the first step is measured, the adaptive policy waits nothing (it cannot know better).
        self._max_wait_s = self._wait_cap_s if config.wait_policy == "fixed" else 0.0
        self.cost = StepCost()
        self._arrivals = RecentRate()  # rows pushed (chunks and flushes): the demand on the encoder
        self.flush_rows = 1  # rows the encoder runs a flush as (set by its owner; invariant 2)
        # Kept up to date by _refresh(), so that a push costs O(1) whatever the number of streams.
        self._ready: dict[int, _Stream[P]] = {}  # could go into the next step now
        self._urgent: set[int] = set()  # ready, with a flush queued (rule 2: step without waiting)
        self._could: set[int] = set()  # could add a chunk to the next step (open, or ending with work)
        self._leaving: set[int] = set()
        self._armed: float | None = None  # the last deadline next_deadline() gave
        # Set when a call may have moved the deadline earlier than `_armed`: the engine wakes its MLX
        # thread only then, not on every push.
        self.needs_wake = False

    # -- callers -------------------------------------------------------------------------------

    def add_stream(self, key: int, prompt_id: int, lookahead: int) -> None:
        if key in self._streams:
            raise ValueError(f"stream {key} is already in the scheduler")
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {lookahead}")
        s: _Stream[P] = _Stream(key=key, prompt_id=prompt_id, lookahead=lookahead, order=self._joins)
        self._streams[key] = s
        self._joins += 1
        self._refresh(s)

    def push_chunk(
        self, key: int, payload: P, now: float, *, is_last: bool = False, flush: bool = False
    ) -> list[ChunkDropped]:
        """Queue the stream's next chunk (or a flush of its partial next chunk, invariant 6); returns
        the chunk dropped to make room, if any."""
        s = self._get(key)
        if s.phase is not StreamPhase.OPEN:
            raise ValueError(f"stream {key} takes no more chunks ({s.phase.name})")
        if flush and is_last:
            raise ValueError("a flush is never the last chunk")
        s.queue.append(_Queued(seq=s.next_seq, payload=payload, is_last=is_last, arrived_at=now, flush=flush))
        self._arrivals.add(now)
        if not flush:
            s.next_seq += 1
        if is_last:
            s.got_last = True
            s.phase = StreamPhase.ENDING
        dropped: list[ChunkDropped] = []
        while len(s.queue) > self.config.max_queued_chunks:
            victim = next(q for q in s.queue if q.seq != 0 and not q.is_last)
            s.queue.remove(victim)
            s.dropped += 1
            dropped.append(ChunkDropped(key=key, seq=victim.seq, dropped_total=s.dropped))
        self._maybe_leave(s, now)
        self._refresh(s)
        return dropped

    def end_stream(self, key: int, now: float) -> None:
        """No more chunks: the stream leaves once its queue is encoded (use `is_last` on the final push
        when there is a final chunk; this is for streams whose audio ended on a chunk boundary)."""
        s = self._get(key)
        if s.phase is StreamPhase.OPEN:
            s.phase = StreamPhase.ENDING
            self._maybe_leave(s, now)
            self._refresh(s)

    def close_stream(self, key: int, now: float) -> None:
        """Abort: queued chunks are discarded; an in-flight chunk's output will be discarded too."""
        s = self._streams.get(key)
        if s is None or s.phase >= StreamPhase.CLOSED:
            return
        s.phase = StreamPhase.CLOSED
        s.queue.clear()
        self._maybe_leave(s, now)
        self._refresh(s)

    def chunk_decoded(self, key: int) -> None:
        s = self._streams.get(key)
        if s is not None and s.undecoded > 0:
            s.undecoded -= 1
            self._refresh(s)

    # -- the MLX thread ------------------------------------------------------------------------

    def schedule(self, now: float) -> StepPlan[P] | None:
        """The next step to run, or None when nothing is due yet (ask again at `next_deadline()`)."""
        self.needs_wake = False
        left = self._take_leavers()
        rows: list[StepRow[P]] = []
        joined: list[StreamJoined] = []
        if self._ready and self._due(now):
            room = self.config.max_batch
            for s in self._ready_sorted():
                cost = self.flush_rows if s.queue[0].flush else 1
                if rows and cost > room:
                    break  # oldest first: what is behind it waits its turn too
                room -= cost
                q = s.queue.popleft()
                s.in_flight = q
                s.undecoded += 1
                self._refresh(s)
                if not s.has_slot:
                    s.has_slot = True
                    joined.append(StreamJoined(key=s.key, prompt_id=s.prompt_id, lookahead=s.lookahead))
                rows.append(
                    StepRow(
                        key=s.key,
                        seq=q.seq,
                        payload=q.payload,
                        is_last=q.is_last,
                        first_frame=q.seq * (s.lookahead + 1),
                        queue_wait_s=max(0.0, now - q.arrived_at),
                        flush=q.flush,
                    )
                )
                if room <= 0:
                    break
        self.needs_wake = False
        if not rows and not left:
            return None
        self._step_id += 1
        return StepPlan(
            step_id=self._step_id, left=tuple(left), joined=tuple(joined), rows=tuple(rows), planned_at=now
        )

    def update_from_output(
        self, plan: StepPlan[P], frames: Sequence[np.ndarray], now: float
    ) -> list[EncodedChunk[P]]:
        """Advance state after the runner executed `plan`; `frames[i]` belongs to `plan.rows[i]`.

        Returns the chunks to decode (closed streams' outputs are discarded).
        """
        if len(frames) != len(plan.rows):
            raise ValueError(f"step {plan.step_id}: {len(frames)} outputs for {len(plan.rows)} rows")
        out: list[EncodedChunk[P]] = []
        for row, f in zip(plan.rows, frames, strict=True):
            s = self._streams.get(row.key)
            q = None if s is None else s.in_flight
            if s is None or q is None or (q.seq, q.flush) != (row.seq, row.flush):
                raise ValueError(f"step {plan.step_id}: stream {row.key} chunk {row.seq} was not in flight")
            s.in_flight = None
            s.encoded += 1
            if s.phase is StreamPhase.CLOSED:
                s.undecoded = max(0, s.undecoded - 1)
            else:
                out.append(
                    EncodedChunk(
                        key=row.key,
                        seq=row.seq,
                        first_frame=row.first_frame,
                        frames=f,
                        is_last=row.is_last,
                        payload=row.payload,
                        queue_wait_s=row.queue_wait_s,
                        flush=row.flush,
                    )
                )
            self._maybe_leave(s, now)
            self._refresh(s)
        return out

    def observe_step(self, rows: int, seconds: float) -> None:
        """The runner's measurement of the step it just ran: the time it held the runner, decoding
        included where the runner decodes the step's chunks before the next (the adaptive wait, `load`)."""
        self.cost.add(rows, seconds)
        if self.config.wait_policy == "adaptive":
            self._max_wait_s = min(self._wait_cap_s, WAIT_PER_FIXED_COST * self.cost.fixed_s())

    def load(self, now: float) -> float:
        """The encoder's utilisation by the rows pushed now: rows a second x the fitted seconds each
        row adds to a step (`StepCost`'s b). Under 1 the encoder keeps up by stepping bigger batches
        (the fixed cost a is shared); as it nears 1 a step's time, and every chunk's delay, grows
        without bound (back to back, a step of B rows takes a / (1 - load)). It rises with the
        streams admitted before the queues and the lag do, which trail them; 0 before the slope is
        known (the first steps, or steps of a near-constant size)."""
        rows_per_s, _, per_row_s = self.load_factors(now)
        return rows_per_s * per_row_s

    def load_factors(self, now: float) -> tuple[float, float, float]:
        """What `load` is made of: (rows pushed a second, the fitted seconds a step, the fitted
        seconds a row adds to it)."""
        a, b = self.cost.fit()
        return self._arrivals.per_s(now), a, b

    @property
    def max_wait_s(self) -> float:
        """How long the oldest ready chunk may wait for a fuller batch now."""
        return self._max_wait_s

    def next_deadline(self) -> float | None:
        """When `schedule` will next return a plan (a time in the past: now); None: only a push,
        end, close or decoded chunk can change that."""
        deadlines = [self._streams[k].left_at or 0.0 for k in self._leaving]
        if self._ready:
            oldest = min(s.queue[0].arrived_at for s in self._ready.values())
            deadlines.append(oldest if self._full() or self._urgent else oldest + self._max_wait_s)
        self._armed = min(deadlines) if deadlines else None
        return self._armed

    # -- introspection -------------------------------------------------------------------------

    def __contains__(self, key: int) -> bool:
        return key in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    def total_queued(self) -> int:
        """Chunks of all streams waiting for the encoder."""
        return sum(len(s.queue) for s in self._streams.values())

    def queued(self, key: int) -> int:
        return len(self._get(key).queue)

    def backlog(self, key: int) -> int:
        """Chunks of the stream not yet decoded: queued, in flight, or encoded and awaiting decoding."""
        s = self._streams.get(key)
        return 0 if s is None else len(s.queue) + s.undecoded

    def dropped(self, key: int) -> int:
        return self._get(key).dropped

    def phase(self, key: int) -> StreamPhase:
        s = self._streams.get(key)
        return StreamPhase.LEFT if s is None else s.phase

    # -- helpers -------------------------------------------------------------------------------

    def _get(self, key: int) -> _Stream[P]:
        try:
            return self._streams[key]
        except KeyError:
            raise KeyError(f"stream {key} is not in the scheduler") from None

    def _refresh(self, s: _Stream[P]) -> None:
        """Re-derive the stream's membership of the ready/could/leaving sets after a change."""
        key = s.key
        ready = (
            bool(s.queue)
            and s.in_flight is None
            and s.undecoded < self.config.max_undecoded_chunks
            and s.phase < StreamPhase.CLOSED
        )
        could = s.phase is StreamPhase.OPEN or (
            s.phase is StreamPhase.ENDING and (bool(s.queue) or s.in_flight is not None)
        )
        if could:
            self._could.add(key)
        else:
            self._could.discard(key)
        urgent = ready and any(q.flush for q in s.queue)
        if urgent and key not in self._urgent:
            self._urgent.add(key)
            self.needs_wake = True
        elif not urgent:
            self._urgent.discard(key)
        if ready and key not in self._ready:
            self._ready[key] = s
            due_at = s.queue[0].arrived_at + (0.0 if self._full() else self._max_wait_s)
            if self._armed is None or due_at < self._armed:
                self.needs_wake = True
        elif not ready:
            self._ready.pop(key, None)
        if self._full():
            self.needs_wake = True
        if s.left_at is not None and key not in self._leaving:
            self._leaving.add(key)
            self.needs_wake = True

    def _ready_sorted(self) -> list[_Stream[P]]:
        return sorted(self._ready.values(), key=lambda s: (s.queue[0].arrived_at, s.order))

    def _full(self) -> bool:
        """Waiting cannot make the next step bigger: max_batch chunks are ready, or every stream that
        could contribute one (open ones, ending ones with work left) has one ready."""
        n = len(self._ready)
        return n > 0 and (n >= self.config.max_batch or n >= len(self._could))

    def _due(self, now: float) -> bool:
        if self._full() or self._urgent:
            return True
        return now - min(s.queue[0].arrived_at for s in self._ready.values()) >= self._max_wait_s

    def _maybe_leave(self, s: _Stream[P], now: float) -> None:
        if s.left_at is not None or s.in_flight is not None:
            return
        if s.phase is StreamPhase.CLOSED:
            s.left_at, s.leave_reason = now, "closed"
        elif s.phase is StreamPhase.ENDING and not s.queue:
            s.left_at, s.leave_reason = now, "finished"

    def _take_leavers(self) -> list[StreamLeft]:
        leavers = [self._streams[k] for k in sorted(self._leaving)]
        self._leaving.clear()
        for s in leavers:
            del self._streams[s.key]
            self._ready.pop(s.key, None)
            self._urgent.discard(s.key)
            self._could.discard(s.key)
            s.phase = StreamPhase.LEFT
        return [StreamLeft(key=s.key, reason=s.leave_reason, had_slot=s.has_slot) for s in leavers]
