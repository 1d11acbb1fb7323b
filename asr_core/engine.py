"""AsrEngine: the threads and hand-offs around the pure cores (scheduler, decoders, assembler).

    caller thread (event loop)      MLX thread (one)                 decoder worker k (N)
    --------------------------      ----------------                 --------------------
    AsrStream.push(pcm)
      features -> chunker -> mel      schedule(now) -> StepPlan
      energies per encoder frame      release / alloc slots
      scheduler.push_chunk  ------->  encoder.step(rows)  (1 mx.eval)
                                      update_from_output ---------->  greedy decode (per stream, or
                                                                      batched over due streams)
                                                                      TranscriptAssembler -> events
                                      <--- chunk_decoded -----------  on_event(TranscriptEvent ...)

Ownership: the MLX thread owns the encoder slot pool (alloc, release and step happen only there);
in decoder mode "device" a second MLX thread, the device decoder's, owns the predictor states on the
device: it takes each step's output in order (`_StepOutput`: leavers, joiners, encoded chunks) and
decodes it while the MLX thread runs the next step, so a step's wall time is not encoding plus
decoding; one output queued behind the one it decodes, then the MLX thread waits. Each decoder
worker owns its ORT sessions and the decoder states, assemblers and callbacks of the streams pinned
to it (least-loaded worker at open), so per-stream state is single-threaded. The
scheduler is shared under one lock, held only for its (cheap) pure calls, never across a step.
Everything for a stream reaches its worker through one FIFO queue (opened, chunks, done), so its
events come in order and `StreamEnded` is always last.

Endpointing: each stream's front end also runs a VAD (asr_core.vad). When it decides the caller
stopped, the stream queues a *flush*: a `ChunkPayload` with `flush=True` holding the partial next
chunk, padded with copies of its last (silent) mel frame, since the VAD just heard silence there, to
that chunk and one more (so the last word's late pieces come out: MelChunker.flush_chunk). The
encoder runs it as a non-committing step (no cache written, the stream not advanced); the worker
decodes it and closes the utterance with a final at once (or a chunk later: a held final, below),
instead of waiting for the chunk to fill, its lookahead, and the token-silence rule. The flush is
plain data on the front-end side, so it can cross a process boundary like any chunk.

Decoder reconciliation: each stream's worker keeps `next_frame`, the first encoder frame it has not
decoded with its committed state. A chunk or flush starting before it is decoded only from
`next_frame` on, and `next_frame` moves to the end of its real-audio frames. So every frame of real
audio is decoded once: the frames a flush covered, from the flush; the real chunk that later covers
the same audio contributes only its frames after them. A flush's padding frames are decoded too, from
a copy of the state, so that the last word's late pieces make it into the final (pieces that finish
that word only: a new word there came from imagined silence); those tokens are remembered as
published (`spec`), and when the real frames behind the padding are decoded, the tokens they give
that match them, in order, are not emitted again (the first that differs ends the matching). When
the padding gave a whole word, the model may be late with the utterance's last word: the final is
held (`_HeldFinal`) until the real frames up to that word are decoded, if the caller stays silent
(the front end marks such chunks, `silent_since_flush`); a chunk with speech releases it as it was.
The encoder frames of every later chunk are exactly those of a stream without the flush
(the step wrote no cache).

Front end on the caller's thread: features and chunking of a 20-320 ms push cost tens of
microseconds of numpy (measured: docs/benchmarks.md), less than a thread hand-off would, and they
keep each stream's audio in order without another queue. `push` never blocks on the encoder: a
stream that falls behind has its oldest queued chunks dropped (counted; see scheduler.py).

Failures: an error while decoding a stream ends that stream with `StreamEnded(reason="error")` and
frees its slot; the other streams go on. An error on the MLX thread is fatal: it is logged, every
open stream ends with reason "error", `on_fatal` is called, and every later call raises
`EngineStoppedError` (the daemon exits and its supervisor restarts it).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from asr_core._blas import limit_numpy_blas_threads, set_openblas_threads
from asr_core.api import SAMPLE_RATE_HZ, AsrEvent, EventCallback, StreamEnded, StreamOptions, TranscriptEvent
from asr_core.config import EngineConfig
from asr_core.errors import EngineFullError, EngineStoppedError, StreamClosedError
from asr_core.frontend import ChunkPayload, StreamFrontEnd
from asr_core.hooks import EngineHooks, NullHooks
from asr_core.model import (
    BatchDecoder,
    DeviceDecoderBackend,
    EncoderBackend,
    EngineModel,
    StreamDecoder,
)
from asr_core.scheduler import EncodedChunk, EncoderScheduler, RecentRate, StepPlan, StreamLeft, StreamPhase
from asr_core.transcript import Token, TranscriptAssembler

logger = logging.getLogger(__name__)

_LAG_SAMPLES = 512  # chunk lags kept per stream for its end-of-stream stats (most recent)
_STEP_REPORT_S = 30.0  # how often the MLX thread logs where its steps' time went


# -- messages to decoder workers ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Opened:
    key: int
    stream: _StreamShared


@dataclass(frozen=True, slots=True)
class _Done:
    key: int
    reason: str  # "finished" | "closed"


@dataclass(frozen=True, slots=True)
class _Decoded:
    """A chunk already decoded on the device (decoder mode "device"): its tokens from
    frame `skip` on, and for a flush the tokens of its padding (decoded from a copy of the state)."""

    chunk: EncodedChunk[ChunkPayload]
    tokens: list[Token]
    skip: int
    padding_tokens: list[Token]
    seconds: float  # this chunk's share of the batched decode


@dataclass(frozen=True, slots=True)
class _EngineFailed:
    error: str


@dataclass(frozen=True, slots=True)
class _StepOutput:
    """What an encoder step hands on, in step order: the streams that left (with the worker that gets
    their `_Done`), the streams that joined, and the encoded chunks with their workers."""

    left: list[tuple[int | None, StreamLeft]]
    joined: list[int]
    chunks: list[EncodedChunk[ChunkPayload]] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)


_STOP = object()
EndReason = Literal["finished", "closed", "error"]
# Step outputs waiting for the device decoder: one being decoded while the next step runs, one more
# queued; beyond that the MLX thread waits (a decoder slower than the encoder backs up into the
# scheduler's bounded queues, where overload is counted).
_DEVICE_BACKLOG = 2


@dataclass(slots=True)
class _StreamShared:
    """State of one stream that more than one thread reads (written by the caller thread only)."""

    key: int
    stream_id: str
    on_event: EventCallback
    lookahead: int
    prompt_id: int
    worker: int
    samples: int = 0
    dropped: int = 0
    finished_at: float | None = None


class AsrEngine:
    """Streams in, transcripts out: one batched MLX encoder, N decoder workers.

    Usage: `engine = AsrEngine(model, config, hooks).start()`, then `open_stream(...)` per call and
    `shutdown()` at the end (or use it as a context manager).
    """

    def __init__(
        self,
        model: EngineModel,
        config: EngineConfig | None = None,
        hooks: EngineHooks | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.model = model
        self.config = config or EngineConfig()
        self.hooks: EngineHooks = _SafeHooks(hooks or NullHooks())
        self._clock = clock
        self._on_fatal = on_fatal
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._sched: EncoderScheduler[ChunkPayload] = EncoderScheduler(self.config.scheduler)
        self._streams: dict[int, _StreamHandle] = {}  # open or draining streams, until StreamEnded
        self._idle = threading.Condition(self._lock)
        self._keys = itertools.count(1)
        self._load = [0] * self.config.decoder.workers
        self._slots: dict[int, int] = {}  # MLX thread only
        self._encoder: EncoderBackend | None = None  # built and owned by the MLX thread
        # Decoder mode "device": the device decoder and its per-stream state belong to its own thread,
        # which decodes a step's chunks while the MLX thread runs the next step.
        self._device: DeviceDecoderBackend | None = None
        self._device_slots: dict[int, int] = {}  # device-decoder thread only
        self._device_next: dict[int, int] = {}  # device-decoder thread only: first frame not decoded
        self._device_jobs: queue.Queue[_StepOutput | None] | None = None
        self._device_thread: threading.Thread | None = None
        self._device_failure: BaseException | None = None  # its start failed
        self._decode_s = 0.0  # the device decoder's running total (written by its thread only)
        self._report = _StepReport(time.perf_counter() + _STEP_REPORT_S)  # MLX thread only
        self._busy = RecentRate()  # the MLX thread's seconds in steps a second (under _lock)
        # Where a chunk's delay sits (under _lock): from its audio to the queue, then in the queue.
        self._receive_lag = RecentMax()
        self._queue_wait = RecentMax()
        self._max_streams: int | None = None  # set by the MLX thread before the engine is ready
        self._ready = threading.Event()
        self._route: dict[int, int] = {}  # stream key -> its worker, until its _Done is sent
        self._workers: list[_DecoderWorker] = []
        self._mlx_thread: threading.Thread | None = None
        self._stopping = False
        self._accepting = False
        self._failure: BaseException | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> AsrEngine:
        if self._mlx_thread is not None:
            raise RuntimeError("engine already started")
        limit_numpy_blas_threads()  # the streams' front ends: small matmuls, one thread each (see _blas)
        if self.config.cpu_threads is not None:
            set_openblas_threads(self.config.cpu_threads)  # the encoder's matmuls on a CPU
        mode = self.config.decoder.mode
        for i in range(self.config.decoder.workers):
            dec: StreamDecoder | BatchDecoder | None = None
            if mode == "batched":
                dec = self.model.new_batch_decoder()
            elif mode == "workers":
                dec = self.model.new_decoder()
            self._workers.append(_DecoderWorker(self, i, dec, mode == "batched"))
        for w in self._workers:
            w.thread.start()
        self._mlx_thread = threading.Thread(target=self._encoder_loop, name="asr-encoder", daemon=True)
        self._mlx_thread.start()
        self._ready.wait()
        if self._failure is not None:
            for w in self._workers:
                w.queue.put(_STOP)
            raise EngineStoppedError(f"ASR encoder failed to start: {self._failure!r}") from self._failure
        self._accepting = True
        return self

    def __enter__(self) -> AsrEngine:
        return self if self._mlx_thread is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def failure(self) -> BaseException | None:
        """The error that stopped the MLX thread, if it failed."""
        return self._failure

    @property
    def max_streams(self) -> int | None:
        """The most streams open at once (the encoder's device pools; None: no limit). Beyond it
        `open_stream` raises `EngineFullError`: the caller's admission should stay below it."""
        return self._max_streams

    @property
    def active_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    def status(self) -> dict[str, float]:
        """How far behind the engine is: `lag_s` is the longest time, over the last second or two,
        from a chunk's audio arriving to its chunk being decoded (the delay every transcript carries);
        `receive_lag_s` and `queue_wait_s` are its first two parts over the same span: the longest time
        from a chunk's audio to its push here (its front end, and the channel from a media worker), and
        the longest a chunk waited in the queue for its step (what is left of `lag_s` is the step, the
        decoding and the transcript's assembly);
        `queued_chunks` waits for the encoder; `load` is the encoder's utilisation by the rows coming in
        (`EncoderScheduler.load`); `busy` is the share of the last second or two the MLX thread spent
        stepping (each step's fixed cost and, where it decodes, the decoding included: near 1 it has no
        time left, whatever `load` says); `max_wait_ms` is the scheduler's current batching wait."""
        now = self._clock()
        with self._lock:
            queued = self._sched.total_queued()
            streams = len(self._streams)
            wait = self._sched.max_wait_s
            load = self._sched.load(now)
            busy = min(1.0, self._busy.per_s(now))
            receive_lag, queue_wait = self._receive_lag.value(now), self._queue_wait.value(now)
        return {
            "active_streams": streams,
            "queued_chunks": queued,
            "lag_s": max((w.lag.value(now) for w in self._workers), default=0.0),
            "receive_lag_s": receive_lag,
            "queue_wait_s": queue_wait,
            "load": round(load, 3),
            "busy": round(busy, 3),
            "max_wait_ms": 1000 * wait,
            "failed": self._failure is not None,
        }

    def shutdown(self, *, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop taking streams; finish (drain=True: flush, finals for all) or close every open stream,
        wait for their `StreamEnded` (closing what is left after `timeout`), then join the threads."""
        with self._lock:
            self._accepting = False
            streams = list(self._streams.values())
        for s in streams:
            with contextlib.suppress(StreamClosedError, EngineStoppedError):
                s.drain() if drain else s.close()
        deadline = self._clock() + timeout
        with self._idle:
            while self._streams and self._failure is None:
                left = deadline - self._clock()
                if left <= 0:
                    break
                self._idle.wait(left)
            late = list(self._streams.values())
        for s in late:
            logger.warning(
                "stream %s did not finish within %.1f s of shutdown; closing it", s.stream_id, timeout
            )
            s.close()
        with self._idle:
            end = self._clock() + 5.0
            while self._streams and self._failure is None and self._clock() < end:
                self._idle.wait(0.1)
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._mlx_thread is not None:
            self._mlx_thread.join(timeout=10.0)
        for w in self._workers:
            w.queue.put(_STOP)
        for w in self._workers:
            w.thread.join(timeout=10.0)

    # -- streams -------------------------------------------------------------------------------

    def open_stream(self, stream_id: str, options: StreamOptions, on_event: EventCallback) -> AsrStream:
        """Start a stream fed with audio; its events go to `on_event` (called on engine threads, in order)."""
        shared = self._prepare(stream_id, options, on_event)
        vad = self.config.vad
        frontend = StreamFrontEnd(
            self.model.new_frontend(shared.lookahead),
            shared.lookahead,
            vad if vad.enabled else None,
            self._clock,
        )
        stream = AsrStream(self, shared, frontend)
        self._register(stream)
        return stream

    def open_chunk_stream(
        self, stream_id: str, options: StreamOptions, on_event: EventCallback
    ) -> ChunkStream:
        """Start a stream fed with chunks (and flushes) that a front end elsewhere made (another
        process ran `asr_core.frontend.StreamFrontEnd` for it); otherwise like `open_stream`."""
        stream = ChunkStream(self, self._prepare(stream_id, options, on_event))
        self._register(stream)
        return stream

    def _prepare(self, stream_id: str, options: StreamOptions, on_event: EventCallback) -> _StreamShared:
        language = options.language or self.config.default_language
        lookahead = options.lookahead
        if lookahead is None:
            lookahead = self.config.default_lookahead
        if lookahead is None:
            lookahead = self.model.default_lookahead
        if lookahead not in self.model.lookaheads:
            raise ValueError(
                f"lookahead {lookahead} not supported; the model has {list(self.model.lookaheads)}"
            )
        prompt_id = self.model.prompt_id(language)
        return _StreamShared(0, stream_id, on_event, lookahead, prompt_id, -1)

    def _register(self, stream: _StreamHandle) -> None:
        shared = stream.shared
        with self._lock:
            self._check_running()
            if self._max_streams is not None and len(self._streams) >= self._max_streams:
                raise EngineFullError(f"the engine holds its most streams ({self._max_streams})")
            shared.key = key = next(self._keys)
            shared.worker = worker = min(range(len(self._load)), key=self._load.__getitem__)
            self._load[worker] += 1
            self._streams[key] = stream
            self._route[key] = worker
            # The worker learns of the stream before any of its chunks can reach it (FIFO).
            self._workers[worker].queue.put(_Opened(key, shared))
            self._sched.add_stream(key, shared.prompt_id, shared.lookahead)
        logger.debug("stream %s opened (lookahead %d, worker %d)", shared.stream_id, shared.lookahead, worker)

    def _check_running(self) -> None:
        if self._failure is not None:
            raise EngineStoppedError(f"ASR engine failed: {self._failure!r}")
        if not self._accepting:
            raise EngineStoppedError("ASR engine is not running")

    def _submit(self, key: int, payloads: Sequence[ChunkPayload], *, last: bool, end: bool) -> None:
        """Caller thread: queue a stream's chunks (the last one flagged when `last`); `end`: no more."""
        dropped = []
        with self._wake:
            if self._failure is not None:
                raise EngineStoppedError(f"ASR engine failed: {self._failure!r}")
            if self._sched.phase(key) is not StreamPhase.OPEN:
                raise StreamClosedError("stream has ended")
            now = self._clock()
            for i, p in enumerate(payloads):
                is_last = last and i == len(payloads) - 1
                dropped += self._sched.push_chunk(key, p, now, is_last=is_last, flush=p.flush)
            if payloads:
                self._receive_lag.record(now - min(p.completed_at for p in payloads), now)
            if dropped and key in self._streams:
                self._streams[key].shared.dropped = dropped[-1].dropped_total
            if end and not last:
                self._sched.end_stream(key, now)
            if self._sched.needs_wake:
                self._wake.notify()
        if dropped:
            stream = self._streams.get(key)
            stream_id = stream.stream_id if stream is not None else str(key)
            for d in dropped:
                self.hooks.chunk_dropped(stream_id)
                if d.dropped_total == 1 or d.dropped_total % 100 == 0:
                    logger.warning("stream %s falls behind: %d chunks dropped", stream_id, d.dropped_total)

    def _close(self, key: int) -> None:
        with self._wake:
            self._sched.close_stream(key, self._clock())
            if self._sched.needs_wake:
                self._wake.notify()

    def _stream_gone(self, key: int, worker: int) -> None:
        """A worker emitted the stream's StreamEnded."""
        with self._idle:
            self._streams.pop(key, None)
            self._load[worker] -= 1
            self._idle.notify_all()

    def _chunks_decoded(self, keys: Sequence[int]) -> None:
        with self._wake:
            for k in keys:
                self._sched.chunk_decoded(k)
            if self._sched.needs_wake:
                self._wake.notify()

    # -- the MLX thread ------------------------------------------------------------------------

    def _encoder_loop(self) -> None:
        try:
            self._encoder = self.model.create_encoder()
            with self._lock:  # the rows a flush runs as, so that a step stays within max_batch rows
                self._sched.flush_rows = int(getattr(self._encoder, "rows_per_flush", 1))
            # On a GPU the step is mx.compile'd per batch bucket: trace them all now (seconds) so
            # that no live step pays for it; on an x86-64 CPU, build the fused sigmoid and softmax.
            warmup = getattr(self._encoder, "warmup", None)
            if warmup is not None:
                lookahead = self.config.default_lookahead
                warmup(
                    self.model.default_lookahead if lookahead is None else lookahead,
                    self.config.scheduler.max_batch,
                    self.config.streams,
                )
            # After the warm-up: it may split the pools for the streams expected, which holds more.
            self._max_streams = getattr(self._encoder, "max_streams", None)
            if self.config.decoder.mode == "device":
                if self.config.decoder.device_thread:
                    # Built and warmed up on its own thread, after the encoder (one compiler at a time).
                    self._start_device_thread().wait()
                    if self._device_failure is not None:
                        raise self._device_failure
                else:  # on this thread, decoding after each step (`_hand_on`)
                    self._build_device_decoder()
        except BaseException as e:
            logger.critical("ASR encoder could not be built", exc_info=e)
            self._failure = e
            self._stop_device_thread()
            self._release_parts()
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                with self._wake:
                    plan = None
                    while plan is None:
                        now = self._clock()
                        plan = self._sched.schedule(now)
                        if plan is not None:
                            break
                        if self._stopping:
                            return
                        deadline = self._sched.next_deadline()
                        self._wake.wait(None if deadline is None else max(0.0, deadline - now))
                t0 = time.perf_counter()
                self._run(plan)
                t1 = time.perf_counter()
                # The report's period may have begun inside this run (a report is logged mid-step): only
                # the part after its start is its, so that its share never passes 1.
                self._report.busy_s += t1 - max(t0, self._report.since)
                with self._lock:
                    self._busy.add(self._clock(), t1 - t0)
        except BaseException as e:  # any failure here is fatal, reported loudly
            self._fail(e)
        finally:
            if self._encoder is not None:
                self._report.log(time.perf_counter(), self._encoder, self._device, self._decode_s)
            self._stop_device_thread()  # after the step outputs it still holds: their chunks and _Done
            self._release_parts()

    def _release_parts(self) -> None:
        """The MLX thread's last call: release the encoder. A device decoder that ran on this thread is
        dropped first, and the encoder's release ends the thread's MLX streams for both (a second
        release on one thread would find its streams gone)."""
        if self._device_thread is None:
            self._device = None
        encoder, self._encoder = self._encoder, None
        _release_on_this_thread(encoder, "encoder")

    def _run(self, plan: StepPlan[ChunkPayload]) -> None:
        encoder = self._encoder
        assert encoder is not None
        for left in plan.left:
            if left.had_slot:
                encoder.release(self._slots.pop(left.key))
        with self._lock:
            routes = [(self._route.pop(left.key, None), left) for left in plan.left]
        for j in plan.joined:
            self._slots[j.key] = encoder.alloc(j.prompt_id, j.lookahead)
        if plan.left or plan.joined:
            self._hand_on(_StepOutput(routes, [j.key for j in plan.joined]))
        if not plan.rows:
            return
        rows = [(self._slots[r.key], r.payload.mel, r.is_last, r.flush) for r in plan.rows]
        t0 = time.perf_counter()
        frames = encoder.step(rows)
        seconds = time.perf_counter() - t0
        report_due = t0 >= self._report.due
        with self._lock:
            now = self._clock()
            chunks = self._sched.update_from_output(plan, frames, now)
            self._queue_wait.record(max(r.queue_wait_s for r in plan.rows), now)
            owners = [self._route[c.key] for c in chunks]
            load = self._sched.load_factors(now) if report_due else None
        self.hooks.encoder_step(seconds, len(rows), [r.queue_wait_s for r in plan.rows])
        self._report.rows += len(rows)
        if report_due:
            self._report.log(t0, encoder, self._device, self._decode_s, load)
        if chunks:
            self._hand_on(_StepOutput([], [], chunks, owners))
        # The scheduler fits what the step cost this thread until it can step again: with device
        # decoding on this thread (`device_thread` off) the step's chunks are decoded first, and that
        # time grows with the rows too. Fitted on the encoding alone, the load (admission's measure)
        # and the batching wait would leave the decoding out.
        busy = time.perf_counter() - t0
        with self._lock:
            self._sched.observe_step(len(rows), busy)

    def _hand_on(self, out: _StepOutput) -> None:
        """A step's output to the decoding side: the device decoder's thread (in order, waiting while
        it is `_DEVICE_BACKLOG` outputs behind), or straight to the workers."""
        jobs = self._device_jobs
        if jobs is None:
            self._deliver(out)
            return
        while True:
            try:
                jobs.put(out, timeout=0.5)
                return
            except queue.Full:
                if self._failure is not None:
                    raise EngineStoppedError(f"the device decoder stopped: {self._failure!r}") from None

    def _deliver(self, out: _StepOutput) -> None:
        """Device decoder slots freed and made (decoder mode "device"), each leaving stream's `_Done`
        to its worker, then the chunks (decoded on the device first in that mode) to theirs. A
        stream's `_Done` comes after every chunk of it handed on before."""
        device = self._device
        for worker, left in out.left:
            if device is not None and left.had_slot:
                device.release(self._device_slots.pop(left.key))
                self._device_next.pop(left.key, None)
            if worker is not None:
                self._workers[worker].queue.put(_Done(left.key, left.reason))
        if device is not None and out.joined:
            for key, slot in zip(out.joined, device.alloc_many(len(out.joined)), strict=True):
                self._device_slots[key] = slot
                self._device_next[key] = 0
        if not out.chunks:
            return
        items: list[Any] = list(out.chunks)
        if device is not None:
            items = self._decode_on_device(device, out.chunks)
        by_worker: dict[int, list[Any]] = {}
        for w, item in zip(out.owners, items, strict=True):
            by_worker.setdefault(w, []).append(item)
        for w, batch in by_worker.items():
            self._workers[w].queue.put(batch)

    # -- the device decoder's thread (decoder mode "device") -----------------------------------------

    def _start_device_thread(self) -> threading.Event:
        ready = threading.Event()
        self._device_jobs = queue.Queue(maxsize=_DEVICE_BACKLOG)
        self._device_thread = threading.Thread(
            target=self._device_loop, args=(ready,), name="asr-device-decoder", daemon=True
        )
        self._device_thread.start()
        return ready

    def _build_device_decoder(self) -> None:
        """The device decoder, built on the calling thread (which then owns it) and warmed up; held
        before its warm-up, so that one that fails there is still released on that thread."""
        self._device = self.model.new_device_decoder()
        self._device.warmup(self.config.scheduler.max_batch)

    def _device_loop(self, ready: threading.Event) -> None:
        """Builds the device decoder, then decodes the step outputs in order until `None`; an error is
        fatal to the engine, as on the MLX thread."""
        jobs = self._device_jobs
        assert jobs is not None
        try:
            try:
                self._build_device_decoder()
            except BaseException as e:
                self._device_failure = e
                return
            finally:
                ready.set()
            while (out := jobs.get()) is not None:
                self._deliver(out)
        except BaseException as e:
            self._fail(e)
        finally:
            device, self._device = self._device, None
            _release_on_this_thread(device, "device decoder")

    def _stop_device_thread(self) -> None:
        """Let the device decoder finish what it was handed (a failed one takes nothing more), then
        join its thread."""
        thread, jobs = self._device_thread, self._device_jobs
        if thread is None or jobs is None:
            return
        while thread.is_alive():
            try:
                jobs.put(None, timeout=0.5)
                break
            except queue.Full:
                continue
        thread.join()

    def _decode_on_device(
        self, device: DeviceDecoderBackend, chunks: list[EncodedChunk[ChunkPayload]]
    ) -> list[_Decoded]:
        """Decode a step's chunks on the device (the reconciliation rule of the module docstring
        applied here, where the stream's committed decoder state lives): each from its first frame
        not decoded yet, its state committed after its last frame due, and a flush on through its
        padding from that state in the same pass."""
        t0 = time.perf_counter()
        skips = [min(_frames_due(c), max(0, self._device_next[c.key] - c.first_frame)) for c in chunks]
        # One pass: each chunk's due frames, committed, then a flush's padding from that state, kept
        # nowhere (the device decoder's commit point).
        emitted = device.decode(
            [self._device_slots[c.key] for c in chunks],
            [c.frames[k:] for c, k in zip(chunks, skips, strict=True)],  # a chunk's frames are all due
            [c.first_frame + k for c, k in zip(chunks, skips, strict=True)],
            commit_frames=[_frames_due(c) - k for c, k in zip(chunks, skips, strict=True)],
        )
        tokens: list[list[Token]] = []
        padding: dict[int, list[Token]] = {}
        for i, (c, ems) in enumerate(zip(chunks, emitted, strict=True)):
            end = c.first_frame + _frames_due(c)
            self._device_next[c.key] = max(self._device_next[c.key], end)
            tokens.append([e for e in ems if e.frame < end])
            if c.flush:
                padding[i] = [e for e in ems if e.frame >= end]
        dt = time.perf_counter() - t0
        self._decode_s += dt
        self.hooks.decoder_step(dt, len(chunks))
        share = dt / len(chunks)
        return [
            _Decoded(c, t, k, padding.get(i, []), share)
            for i, (c, t, k) in enumerate(zip(chunks, tokens, skips, strict=True))
        ]

    def _fail(self, error: BaseException) -> None:
        with self._wake:
            if self._failure is not None:  # the other MLX thread failed first: reported already
                logger.error("after the engine's failure: %r", error)
                return
            logger.critical("ASR %s thread failed; the engine stops", _thread_role(), exc_info=error)
            self._failure = error
            self._accepting = False
            self._idle.notify_all()
        for w in self._workers:
            w.queue.put(_EngineFailed(f"encoder failed: {error!r}"))
        if self._on_fatal is not None:
            try:
                self._on_fatal(error)
            except Exception:
                logger.exception("on_fatal callback failed")


@dataclass(slots=True)
class _StepReport:
    """The MLX thread's periodic log line: steps, rows and compiled calls per step, and where a step's
    wall time went (the encoder's own running totals, differenced over the period)."""

    due: float
    rows: int = 0
    busy_s: float = 0.0  # the MLX thread's time in steps (`_run`, every part of one) since `since`
    last: dict[str, float] = field(default_factory=dict)
    since: float = field(default_factory=time.perf_counter)

    def log(
        self,
        now: float,
        encoder: EncoderBackend,
        device: DeviceDecoderBackend | None,
        decode_s: float,
        load: tuple[float, float, float] | None = None,
    ) -> None:
        """`decode_s`: the device decoder's running total (on its own thread, beside the steps); `load`:
        the scheduler's load factors now (`EncoderScheduler.load_factors`), None: not reported."""
        self.due = now + _STEP_REPORT_S
        stats = getattr(encoder, "stats", None)
        totals: dict[str, float] = stats() if stats is not None else {}
        totals["decode_s"] = decode_s
        if device is not None:
            totals.update({f"decoder_{k}": v for k, v in device.stats().items()})
        d = {k: v - self.last.get(k, 0.0) for k, v in totals.items()}
        steps = d.get("step", 0.0)
        memory = getattr(encoder, "memory", None)
        if steps:
            logger.info(
                "encoder: %d steps in %.0f s (busy %.2f), %.1f rows/step; calls/step: %.2f subsampling, "
                "%.2f stack, %.2f untraced; ms/step: plan %.1f, graph %.1f, eval %.1f, copy %.1f, "
                "decode %.1f%s%s%s",
                steps, now - self.since, self.busy_s / max(now - self.since, 1e-9), self.rows / steps,
                d.get("sub", 0.0) / steps,
                d.get("stack", 0.0) / steps, d.get("untraced", 0.0) / steps,
                *(1e3 * d.get(f"{k}_s", 0.0) / steps for k in ("plan", "graph", "eval", "copy")),
                1e3 * d["decode_s"] / steps, _decoder_rates(d),
                _memory_text(memory()) if memory is not None else "", _load_text(load),
            )  # fmt: skip
        self.last, self.rows, self.busy_s, self.since = totals, 0, 0.0, now


def _load_text(factors: tuple[float, float, float] | None) -> str:
    """The step report's load part: what admission reads (`EncoderScheduler.load`) and its factors."""
    if factors is None:
        return ""
    rows_per_s, fixed_s, per_row_s = factors
    return (
        f"; load {rows_per_s * per_row_s:.2f} = {rows_per_s:.0f} rows/s x {1e3 * per_row_s:.3f} ms/row "
        f"(fitted: {1e3 * fixed_s:.1f} ms/step + that x rows)"
    )


def _memory_text(m: dict[str, int]) -> str:
    """The step report's memory part: whether the period's peak came near the limit, where MLX frees
    its cached buffers before allocating (slow on a GPU)."""
    mib = {k: round(v / 2**20) for k, v in m.items()}
    return (
        f"; memory MiB: active {mib['active']}, cached {mib['cached']}, peak {mib['peak']} of limit "
        f"{mib['limit']}"
    )


def _thread_role() -> str:
    return "device decoder" if threading.current_thread().name == "asr-device-decoder" else "encoder"


def _release_on_this_thread(part: object, what: str) -> None:
    """A part's last call, on the thread that built it: free its device state and the thread's MLX
    streams, so that nothing of the accelerator's runtime is left for thread or process teardown
    (MLX's CUDA backend aborts the process when a thread's streams outlive the runtime)."""
    close = getattr(part, "close", None)
    if close is not None:
        try:
            close()
        except Exception:
            logger.exception("releasing the %s failed", what)


def _decoder_rates(d: dict[str, float]) -> str:
    """The device decoder's share of the step report: iterations and syncs per decode call."""
    calls = d.get("decoder_decodes", 0.0)
    if not calls:
        return ""
    its, syncs = d.get("decoder_iterations", 0.0) / calls, d.get("decoder_syncs", 0.0) / calls
    return f" ({its:.1f} iterations, {syncs:.2f} syncs per decode)"


class _StreamHandle:
    """What both kinds of stream share: identity, backlog, closing (abort)."""

    def __init__(self, engine: AsrEngine, shared: _StreamShared) -> None:
        self._engine = engine
        self.shared = shared
        self._lock = threading.Lock()
        self._state = "open"

    @property
    def stream_id(self) -> str:
        return self.shared.stream_id

    @property
    def audio_ms(self) -> int:
        return self.shared.samples * 1000 // SAMPLE_RATE_HZ

    @property
    def backlog(self) -> int:
        """Chunks pushed but not yet decoded. A file reader feeding faster than real time waits while
        this is high instead of letting the queue bound drop chunks (see tools/transcribe.py)."""
        with self._engine._lock:
            return self._engine._sched.backlog(self.shared.key)

    def close(self) -> None:
        """Abort: queued audio is discarded; the text decoded so far still comes as a final, then
        `StreamEnded(reason="closed")`. Closing twice is harmless."""
        with self._lock:
            if self._state == "closed":
                return
            self._state = "closed"
            if self.shared.finished_at is None:
                self.shared.finished_at = self._engine._clock()
        self._engine._close(self.shared.key)

    def drain(self) -> None:
        """Shutdown: no more input; what was queued is decoded and the finals come."""
        raise NotImplementedError

    def _submit(self, payloads: list[ChunkPayload], *, last: bool, end: bool) -> None:
        try:
            self._engine._submit(self.shared.key, payloads, last=last, end=end)
        except StreamClosedError:
            self._state = "ended"
            raise

    def _check_open(self) -> None:
        if self._state != "open":
            raise StreamClosedError(f"stream {self.stream_id} is {self._state}")


class AsrStream(_StreamHandle):
    """Handle of one stream: `push` audio, then `finish` (flush + finals) or `close` (abort).

    `push`, `finish` and `close` may be called from any one thread at a time per stream (typically
    the event loop). After `StreamEnded` (or after finish/close) `push` raises `StreamClosedError`.
    """

    def __init__(self, engine: AsrEngine, shared: _StreamShared, frontend: StreamFrontEnd) -> None:
        super().__init__(engine, shared)
        self._frontend = frontend

    def push(self, pcm: np.ndarray) -> None:
        """Add 16 kHz mono float32 audio in [-1, 1] (any length)."""
        x = _as_pcm(pcm)
        with self._lock:
            self._check_open()
            payloads = self._frontend.push(x)
            self.shared.samples = self._frontend.samples
            if payloads:
                self._submit(payloads, last=False, end=False)

    def finish(self) -> None:
        """End of audio: flush the front end (final short chunk), then the final transcript and
        `StreamEnded(reason="finished")` arrive through the callback."""
        with self._lock:
            self._check_open()
            self._state = "finished"
            self.shared.finished_at = self._engine._clock()
            payloads, last_is_final = self._frontend.finish()
            self._engine._submit(self.shared.key, payloads, last=last_is_final, end=True)

    def drain(self) -> None:
        self.finish()


class ChunkStream(_StreamHandle):
    """A stream whose front end runs elsewhere: `push_chunks` its chunks (and flushes) in order, then
    `finish` (or `close`). `samples` is the audio the front end consumed so far (for audio_ms)."""

    def push_chunks(self, payloads: list[ChunkPayload], samples: int) -> None:
        with self._lock:
            self._check_open()
            self.shared.samples = samples
            if payloads:
                self._submit(payloads, last=False, end=False)

    def finish(self, payloads: list[ChunkPayload], last_is_final: bool, samples: int) -> None:
        with self._lock:
            self._check_open()
            self._state = "finished"
            self.shared.samples = samples
            self.shared.finished_at = self._engine._clock()
            self._engine._submit(self.shared.key, payloads, last=last_is_final, end=True)

    def drain(self) -> None:
        self.finish([], False, self.shared.samples)


class RecentMax:
    """The largest value recorded in the last one to two `window_s` (two buckets). One writer; readers
    on other threads see a value at most one record old."""

    def __init__(self, window_s: float = 1.0) -> None:
        self.window_s = window_s
        self._bucket_start = 0.0
        self._current = 0.0
        self._previous = 0.0

    def record(self, value: float, now: float) -> None:
        self._roll(now)
        if value > self._current:
            self._current = value

    def value(self, now: float) -> float:
        if now - self._bucket_start >= 2 * self.window_s:
            return 0.0
        if now - self._bucket_start >= self.window_s:
            return self._current
        return max(self._current, self._previous)

    def _roll(self, now: float) -> None:
        if now - self._bucket_start >= self.window_s:
            fresh = now - self._bucket_start < 2 * self.window_s
            self._previous = self._current if fresh else 0.0
            self._current = 0.0
            self._bucket_start = now


class _SafeHooks:
    """Hooks run on engine threads: an exception in one (a metrics bug) is logged, never fatal."""

    def __init__(self, hooks: EngineHooks) -> None:
        self._hooks = hooks
        self._errors = 0

    def _failed(self, name: str) -> None:
        self._errors += 1
        if self._errors <= 3:
            logger.exception("engine hook %s failed (%d so far)", name, self._errors)

    def encoder_step(self, seconds: float, batch_size: int, queue_waits_s: Sequence[float]) -> None:
        try:
            self._hooks.encoder_step(seconds, batch_size, queue_waits_s)
        except Exception:
            self._failed("encoder_step")

    def decoder_step(self, seconds: float, n_streams: int) -> None:
        try:
            self._hooks.decoder_step(seconds, n_streams)
        except Exception:
            self._failed("decoder_step")

    def chunk_dropped(self, stream_id: str) -> None:
        try:
            self._hooks.chunk_dropped(stream_id)
        except Exception:
            self._failed("chunk_dropped")

    def transcript(self, kind: str, latency_s: float) -> None:
        try:
            self._hooks.transcript(kind, latency_s)
        except Exception:
            self._failed("transcript")

    def time_to_final(self, seconds: float) -> None:
        try:
            self._hooks.time_to_final(seconds)
        except Exception:
            self._failed("time_to_final")


def _as_pcm(pcm: np.ndarray) -> np.ndarray:
    x = np.asarray(pcm)
    if x.ndim != 1:
        raise ValueError(f"PCM must be 1-D mono, got shape {x.shape}")
    if x.dtype.kind != "f":
        raise ValueError(f"PCM must be float in [-1, 1], got {x.dtype} (divide int16 by 32768)")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        raise ValueError("PCM contains NaN or infinity")
    return x


# -- decoder workers ------------------------------------------------------------------------------


@dataclass(slots=True)
class _WorkerStream:
    shared: _StreamShared
    state: Any
    assembler: TranscriptAssembler
    chunks: int = 0
    ended: bool = False
    decode_s: float = 0.0  # wall time of its decoding (its share of batched calls)
    decode_cpu_s: float = 0.0  # CPU time of the same (thread time: what a core pays)
    last_completed_at: float = 0.0
    lags: list[float] = field(default_factory=list)
    queue_wait_max_s: float = 0.0
    next_frame: int = 0  # first encoder frame not decoded yet (the reconciliation rule, module doc)
    flushes: int = 0
    spec: list[int] = field(default_factory=list)  # published from a flush's padding, not yet confirmed
    spec_end: int = 0  # the frame after that flush's chunk
    held: _HeldFinal | None = None


@dataclass(frozen=True, slots=True)
class _HeldFinal:
    """A flush's final kept open because its padding gave a whole word: the model may be late with
    the utterance's last word (it says it a frame or more after the audio). The real frames up to
    `until_frame` decide: while the caller stays silent they join the final, which closes after
    them; a chunk with speech (or the next flush) closes it first, as it was."""

    speech_end_at: float | None
    until_frame: int


def _unpublished(ws: _WorkerStream, tokens: list[Token]) -> list[Token]:
    """`tokens` less the leading ones a flush already published from its padding (`ws.spec`, in
    order); the first token that differs ends the matching."""
    k = 0
    while k < len(tokens) and ws.spec and tokens[k].id == ws.spec[0]:
        ws.spec.pop(0)
        k += 1
    if k < len(tokens):
        ws.spec = []
    return tokens[k:]


def _frames_due(c: EncodedChunk[ChunkPayload]) -> int:
    """Frames of `c` to decode: all of a chunk, the real-audio ones of a flush."""
    n = int(c.frames.shape[0])
    return min(n, c.payload.flush_frames) if c.flush else n


def _already_decoded(ws: _WorkerStream, c: EncodedChunk[ChunkPayload]) -> int:
    """Frames at the start of `c` that an earlier flush already decoded (the reconciliation rule)."""
    return min(_frames_due(c), max(0, ws.next_frame - c.first_frame))


class _DecoderWorker:
    """One decoder thread: owns its decoder (ORT sessions) and the state of its pinned streams."""

    def __init__(
        self, engine: AsrEngine, index: int, decoder: StreamDecoder | BatchDecoder | None, batched: bool
    ) -> None:
        self.engine = engine
        self.index = index
        self.decoder = decoder
        self.batched = batched
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.streams: dict[int, _WorkerStream] = {}
        self.lag = RecentMax()
        self.thread = threading.Thread(target=self._loop, name=f"asr-decoder-{index}", daemon=True)

    def _loop(self) -> None:
        while True:
            items = [self.queue.get()]
            if self.batched:
                # Everything already waiting is due now: decode it together.
                while True:
                    try:
                        items.append(self.queue.get_nowait())
                    except queue.Empty:
                        break
            try:
                if self._handle(items):
                    return
            except Exception as e:  # a bug here must not leave this worker's streams hanging
                logger.critical("decoder worker %d failed; ending its streams", self.index, exc_info=e)
                for key in list(self.streams):
                    self._fail(key, e)

    def _handle(self, items: list[Any]) -> bool:
        """Process messages in order; consecutive chunk lists are decoded in rounds. True: stop."""
        pending: list[Any] = []  # EncodedChunk, or _Decoded in decoder mode "device"
        for item in items:
            if isinstance(item, list):
                pending.extend(item)
                continue
            self._decode(pending)
            pending = []
            if item is _STOP:
                return True
            if isinstance(item, _Opened):
                self._open(item)
            elif isinstance(item, _Done):
                self._done(item.key, item.reason)
            elif isinstance(item, _EngineFailed):
                for key in list(self.streams):
                    self._end(key, "error", item.error)
        self._decode(pending)
        return False

    def _open(self, msg: _Opened) -> None:
        cfg = self.engine.config.endpoint
        assembler = TranscriptAssembler(msg.stream.stream_id, cfg, self.engine.model.text)
        self.streams[msg.key] = ws = _WorkerStream(msg.stream, None, assembler)
        if self.decoder is None:  # decoded on the device: no state here
            return
        try:
            ws.state = self.decoder.new_state()
        except Exception as e:
            logger.exception("stream %s: decoder state failed", msg.stream.stream_id)
            self._fail(msg.key, e)

    def _decode(self, chunks: list[Any]) -> None:
        if not chunks:
            return
        if self.decoder is None:
            for d in chunks:
                ws = self.streams.get(d.chunk.key)
                if ws is not None and not ws.ended:
                    ws.decode_s += d.seconds
                    self._assemble(ws, d.chunk, d.tokens, d.skip, d.padding_tokens)
            self.engine._chunks_decoded([d.chunk.key for d in chunks])
            return
        live = [c for c in chunks if c.key in self.streams and not self.streams[c.key].ended]
        if self.batched:
            # Rounds: a stream's n-th pending chunk goes in round n (order within a stream is kept).
            rounds: list[list[EncodedChunk[ChunkPayload]]] = []
            seen: dict[int, int] = {}
            for c in live:
                n = seen.get(c.key, 0)
                seen[c.key] = n + 1
                if n == len(rounds):
                    rounds.append([])
                rounds[n].append(c)
            for rnd in rounds:
                self._decode_batch(rnd)
        else:
            for c in live:
                self._decode_one(c)
        self.engine._chunks_decoded([c.key for c in chunks])

    def _decode_one(self, c: EncodedChunk[ChunkPayload]) -> None:
        ws = self.streams[c.key]
        if ws.ended:
            return
        dec: StreamDecoder = self.decoder  # type: ignore[assignment]
        skip = _already_decoded(ws, c)
        try:
            t0, c0 = time.perf_counter(), time.thread_time()
            tokens = dec.decode(ws.state, c.frames[skip : _frames_due(c)], c.first_frame + skip)
            dt, dc = time.perf_counter() - t0, time.thread_time() - c0
        except Exception as e:
            logger.exception("stream %s: decoding failed", ws.shared.stream_id)
            self._fail(c.key, e)
            return
        ws.decode_s += dt
        ws.decode_cpu_s += dc
        self.engine.hooks.decoder_step(dt, 1)
        self._assemble(ws, c, tokens, skip)

    def _decode_batch(self, rnd: list[EncodedChunk[ChunkPayload]]) -> None:
        dec: BatchDecoder = self.decoder  # type: ignore[assignment]
        wss = [self.streams[c.key] for c in rnd]
        skips = [_already_decoded(w, c) for w, c in zip(wss, rnd, strict=True)]
        try:
            t0, c0 = time.perf_counter(), time.thread_time()
            tokens = dec.decode_batch(
                [w.state for w in wss],
                [c.frames[k : _frames_due(c)] for c, k in zip(rnd, skips, strict=True)],
                [c.first_frame + k for c, k in zip(rnd, skips, strict=True)],
            )
            dt, dc = time.perf_counter() - t0, time.thread_time() - c0
        except Exception as e:
            logger.exception("batched decoding of %d streams failed", len(rnd))
            for c in rnd:
                self._fail(c.key, e)
            return
        self.engine.hooks.decoder_step(dt, len(rnd))
        for ws, c, toks, skip in zip(wss, rnd, tokens, skips, strict=True):
            ws.decode_s += dt / len(rnd)
            ws.decode_cpu_s += dc / len(rnd)
            self._assemble(ws, c, toks, skip)

    def _assemble(
        self,
        ws: _WorkerStream,
        c: EncodedChunk[ChunkPayload],
        tokens: list[Token],
        skip: int,
        padding_tokens: list[Token] | None = None,
    ) -> None:
        n = _frames_due(c)
        ws.next_frame = max(ws.next_frame, c.first_frame + n)
        try:
            events: list[AsrEvent] = []
            if ws.held is not None and (c.flush or not c.payload.silent_since_flush):
                # The caller spoke again: the final goes out as it is, since these frames may hold
                # the new speech's first pieces as well as the late word.
                events += self._release_held(ws)
            tokens = _unpublished(ws, tokens)
            if not c.flush and c.first_frame + int(c.frames.shape[0]) >= ws.spec_end:
                ws.spec = []  # the real frames behind the last flush's padding are all decoded
            energies = c.payload.energies_db[skip:n]
            events += ws.assembler.update(tokens, c.first_frame + skip, n - skip, energies)
            if c.flush:
                ws.flushes += 1
                late, word_at = self._speculate(ws, c, n, padding_tokens)
                if word_at is None:
                    events += self._close_utterance(ws, late, c.payload.speech_end_at)
                else:
                    ws.assembler.add_late(late)
                    ws.held = _HeldFinal(c.payload.speech_end_at, word_at + 1)
            elif ws.held is not None and c.first_frame + n >= ws.held.until_frame:
                events += self._release_held(ws)
        except Exception as e:
            logger.exception("stream %s: transcript assembly failed", ws.shared.stream_id)
            self._fail(c.key, e)
            return
        ws.chunks += 1
        ws.last_completed_at = c.payload.completed_at
        ws.queue_wait_max_s = max(ws.queue_wait_max_s, c.queue_wait_s)
        now = self.engine._clock()
        lag = now - c.payload.completed_at
        ws.lags.append(lag)
        self.lag.record(lag, now)
        if len(ws.lags) > _LAG_SAMPLES:
            del ws.lags[: len(ws.lags) - _LAG_SAMPLES]
        self._emit(ws, events, c.payload.completed_at)

    def _close_utterance(
        self, ws: _WorkerStream, late: Sequence[Token], speech_end_at: float | None
    ) -> list[AsrEvent]:
        closed: list[AsrEvent] = list(ws.assembler.speech_ended(late))
        if closed and speech_end_at is not None:
            self.engine.hooks.time_to_final(self.engine._clock() - speech_end_at)
        return closed

    def _release_held(self, ws: _WorkerStream) -> list[AsrEvent]:
        held, ws.held = ws.held, None
        return self._close_utterance(ws, (), held.speech_end_at) if held is not None else []

    def _speculate(
        self, ws: _WorkerStream, c: EncodedChunk[ChunkPayload], real: int, decoded: list[Token] | None = None
    ) -> tuple[list[Token], int | None]:
        """Decode a flush's padding frames from a copy of the stream's decoder state (or take them
        `decoded` on the device): the late pieces of the last word (the model emits a piece a frame
        or two after its audio) go into the final. They become `ws.spec`, the tokens already
        published that the real frames behind the padding are expected to give again. Returns those
        not published yet, and the frame of a whole word the padding gave after them, if any: the
        final then waits for the real frames up to it (`_HeldFinal`)."""
        frames = c.frames[real:]
        if not frames.shape[0]:
            return [], None
        first = c.first_frame + real
        if decoded is not None:
            spec = decoded
        elif self.batched:
            state = copy.deepcopy(ws.state)
            dec: BatchDecoder = self.decoder  # type: ignore[assignment]
            spec = dec.decode_batch([state], [frames], [first])[0]
        else:
            one: StreamDecoder = self.decoder  # type: ignore[assignment]
            spec = one.decode(copy.deepcopy(ws.state), frames, first)
        # Only pieces that finish the last word: a new word from imagined silence could be wrong
        # when the caller goes on (it comes with the real audio instead, in the next utterance).
        text = self.engine.model.text
        n = 0
        while n < len(spec) and not text.starts_word(spec[n].id) and text.decode([spec[n].id])[0]:
            n += 1
        new = _unpublished(ws, spec[:n])
        ws.spec, ws.spec_end = [t.id for t in spec[:n]], c.first_frame + int(c.frames.shape[0])
        word = next((t.frame for t in spec[n:] if text.starts_word(t.id) and text.decode([t.id])[0]), None)
        return new, word

    def _emit(self, ws: _WorkerStream, events: Sequence[AsrEvent], completed_at: float | None) -> None:
        now = self.engine._clock()
        for ev in events:
            if isinstance(ev, TranscriptEvent) and completed_at is not None:
                self.engine.hooks.transcript(ev.kind, max(0.0, now - completed_at))
            try:
                ws.shared.on_event(ev)
            except Exception:
                logger.exception("stream %s: event callback failed", ws.shared.stream_id)

    def _done(self, key: int, reason: str) -> None:
        ws = self.streams.get(key)
        if ws is None:
            return
        if ws.ended:
            del self.streams[key]
            return
        self._end(key, "finished" if reason == "finished" else "closed")

    def _fail(self, key: int, error: BaseException) -> None:
        ws = self.streams.get(key)
        if ws is None or ws.ended:
            return
        self._end(key, "error", f"{type(error).__name__}: {error}")
        self.engine._close(key)

    def _end(self, key: int, reason: EndReason, error: str | None = None) -> None:
        ws = self.streams[key]
        if ws.ended:
            return
        ws.ended = True
        events: list[AsrEvent] = []
        if reason != "error":
            try:
                events.extend(self._release_held(ws))
                events.extend(ws.assembler.finish(ws.shared.samples * 1000 // SAMPLE_RATE_HZ))
            except Exception:
                logger.exception("stream %s: final transcript failed", ws.shared.stream_id)
        lags = sorted(ws.lags)
        stats = {
            "decode_s": ws.decode_s,
            "decode_cpu_s": ws.decode_cpu_s,
            "queue_wait_max_s": ws.queue_wait_max_s,
            "lag_p50_s": lags[len(lags) // 2] if lags else 0.0,
            "lag_p95_s": lags[min(len(lags) - 1, int(0.95 * len(lags)))] if lags else 0.0,
            "lag_max_s": lags[-1] if lags else 0.0,
            "flushes": float(ws.flushes),
            "orphan_pieces": float(ws.assembler.orphan_pieces),
        }
        events.append(
            StreamEnded(
                stream_id=ws.shared.stream_id,
                reason=reason,
                audio_ms=ws.shared.samples * 1000 // SAMPLE_RATE_HZ,
                chunks=ws.chunks,
                dropped_chunks=ws.shared.dropped,
                error=error,
                stats=stats,
            )
        )
        logger.debug(
            "stream %s ended (%s): %d ms of audio, %d chunks, %d dropped",
            ws.shared.stream_id,
            reason,
            ws.shared.samples * 1000 // SAMPLE_RATE_HZ,
            ws.chunks,
            ws.shared.dropped,
        )
        self._emit(ws, events, ws.shared.finished_at)
        if reason != "error":
            del self.streams[key]
        self.engine._stream_gone(key, self.index)
