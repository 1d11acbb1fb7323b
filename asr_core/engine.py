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
each decoder worker owns its ORT sessions and the decoder states, assemblers and callbacks of the
streams pinned to it (least-loaded worker at open), so per-stream state is single-threaded. The
scheduler is shared under one lock, held only for its (cheap) pure calls, never across a step.
Everything for a stream reaches its worker through one FIFO queue (opened, chunks, done), so its
events come in order and `StreamEnded` is always last.

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
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from asr_core._blas import limit_numpy_blas_threads
from asr_core.api import SAMPLE_RATE_HZ, AsrEvent, EventCallback, StreamEnded, StreamOptions, TranscriptEvent
from asr_core.config import EngineConfig
from asr_core.errors import EngineStoppedError, StreamClosedError
from asr_core.hooks import EngineHooks, NullHooks
from asr_core.model import BatchDecoder, EncoderBackend, EngineModel, FrontEnd, StreamDecoder
from asr_core.scheduler import EncodedChunk, EncoderScheduler, StepPlan, StreamPhase
from asr_core.transcript import FRAME_MS, Token, TranscriptAssembler

logger = logging.getLogger(__name__)

SAMPLES_PER_FRAME = SAMPLE_RATE_HZ * FRAME_MS // 1000  # 1280: one encoder frame = 8 hops of 160
# Encoder frame j's receptive field ends at sample 1280*j + 200 (mel frame 8j's window); its energy
# is that of the 80 ms of audio ending there: the newest audio the frame sees.
_ENERGY_END = 200
_SILENT_DB = -120.0
_LAG_SAMPLES = 512  # chunk lags kept per stream for its end-of-stream stats (most recent)


@dataclass(frozen=True, slots=True)
class ChunkPayload:
    """What travels with a mel chunk from the caller through the encoder to the decoder worker."""

    mel: np.ndarray
    energies_db: np.ndarray  # per encoder frame of the chunk (full chunk length; a short one is cut)
    completed_at: float  # monotonic time of the push that completed the chunk


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
class _EngineFailed:
    error: str


_STOP = object()
EndReason = Literal["finished", "closed", "error"]


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
        self._streams: dict[int, AsrStream] = {}  # open or draining streams, until StreamEnded
        self._idle = threading.Condition(self._lock)
        self._keys = itertools.count(1)
        self._load = [0] * self.config.decoder.workers
        self._slots: dict[int, int] = {}  # MLX thread only
        self._encoder: EncoderBackend | None = None  # built and owned by the MLX thread
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
        batched = self.config.decoder.mode == "batched"
        for i in range(self.config.decoder.workers):
            dec: StreamDecoder | BatchDecoder = (
                self.model.new_batch_decoder() if batched else self.model.new_decoder()
            )
            self._workers.append(_DecoderWorker(self, i, dec, batched))
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
    def active_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    def shutdown(self, *, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop taking streams; finish (drain=True: flush, finals for all) or close every open stream,
        wait for their `StreamEnded` (closing what is left after `timeout`), then join the threads."""
        with self._lock:
            self._accepting = False
            streams = list(self._streams.values())
        for s in streams:
            with contextlib.suppress(StreamClosedError, EngineStoppedError):
                s.finish() if drain else s.close()
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
        """Start a stream; its events go to `on_event` (called on engine threads, in order)."""
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
        frontend = self.model.new_frontend(lookahead)
        with self._lock:
            self._check_running()
            key = next(self._keys)
            worker = min(range(len(self._load)), key=self._load.__getitem__)
            self._load[worker] += 1
            shared = _StreamShared(key, stream_id, on_event, lookahead, prompt_id, worker)
            stream = AsrStream(self, shared, frontend)
            self._streams[key] = stream
            self._route[key] = worker
            # The worker learns of the stream before any of its chunks can reach it (FIFO).
            self._workers[worker].queue.put(_Opened(key, shared))
            self._sched.add_stream(key, prompt_id, lookahead)
        logger.debug("stream %s opened (%s, lookahead %d, worker %d)", stream_id, language, lookahead, worker)
        return stream

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
                dropped += self._sched.push_chunk(key, p, now, is_last=is_last)
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
            # On a GPU the step is mx.compile'd per batch bucket: trace them all now (seconds) so
            # that no live step pays for it. A no-op where the encoder is not compiled.
            warmup = getattr(self._encoder, "warmup", None)
            if warmup is not None:
                lookahead = self.config.default_lookahead
                warmup(
                    self.model.default_lookahead if lookahead is None else lookahead,
                    self.config.scheduler.max_batch,
                )
        except BaseException as e:
            logger.critical("ASR encoder could not be built", exc_info=e)
            self._failure = e
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
                self._run(plan)
        except BaseException as e:  # any failure here is fatal, reported loudly
            self._fail(e)

    def _run(self, plan: StepPlan[ChunkPayload]) -> None:
        encoder = self._encoder
        assert encoder is not None
        for left in plan.left:
            if left.had_slot:
                encoder.release(self._slots.pop(left.key))
        with self._lock:
            routes = [(self._route.pop(left.key, None), left) for left in plan.left]
        for worker, left in routes:
            if worker is not None:
                self._workers[worker].queue.put(_Done(left.key, left.reason))
        for j in plan.joined:
            self._slots[j.key] = encoder.alloc(j.prompt_id, j.lookahead)
        if not plan.rows:
            return
        rows = [(self._slots[r.key], r.payload.mel, r.is_last) for r in plan.rows]
        t0 = time.perf_counter()
        frames = encoder.step(rows)
        seconds = time.perf_counter() - t0
        by_worker: dict[int, list[EncodedChunk[ChunkPayload]]] = {}
        with self._lock:
            for c in self._sched.update_from_output(plan, frames, self._clock()):
                by_worker.setdefault(self._route[c.key], []).append(c)
        self.hooks.encoder_step(seconds, len(rows), [r.queue_wait_s for r in plan.rows])
        for w, chunks in by_worker.items():
            self._workers[w].queue.put(chunks)

    def _fail(self, error: BaseException) -> None:
        logger.critical("ASR encoder thread failed; the engine stops", exc_info=error)
        with self._wake:
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


class AsrStream:
    """Handle of one stream: `push` audio, then `finish` (flush + finals) or `close` (abort).

    `push`, `finish` and `close` may be called from any one thread at a time per stream (typically
    the event loop). After `StreamEnded` (or after finish/close) `push` raises `StreamClosedError`.
    """

    def __init__(self, engine: AsrEngine, shared: _StreamShared, frontend: FrontEnd) -> None:
        self._engine = engine
        self.shared = shared
        self._frontend = frontend
        self._lock = threading.Lock()
        self._state = "open"
        self._chunks = 0  # chunks handed to the scheduler (its seq numbers)
        self._frame_span = shared.lookahead + 1
        self._hist = np.zeros(0, np.float32)  # audio from sample _hist_start on (for frame energies)
        self._hist_start = 0

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

    def push(self, pcm: np.ndarray) -> None:
        """Add 16 kHz mono float32 audio in [-1, 1] (any length)."""
        x = _as_pcm(pcm)
        with self._lock:
            if self._state != "open":
                raise StreamClosedError(f"stream {self.stream_id} is {self._state}")
            if x.size == 0:
                return
            chunks = self._frontend.push(x)
            self._append_audio(x)
            if chunks:
                try:
                    self._engine._submit(self.shared.key, self._payloads(chunks), last=False, end=False)
                except StreamClosedError:
                    self._state = "ended"
                    raise

    def finish(self) -> None:
        """End of audio: flush the front end (final short chunk), then the final transcript and
        `StreamEnded(reason="finished")` arrive through the callback."""
        with self._lock:
            if self._state != "open":
                raise StreamClosedError(f"stream {self.stream_id} is {self._state}")
            self._state = "finished"
            self.shared.finished_at = self._engine._clock()
            chunks, last_is_final = self._frontend.finish()
            self._engine._submit(self.shared.key, self._payloads(chunks), last=last_is_final, end=True)

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

    # -- helpers -------------------------------------------------------------------------------

    def _append_audio(self, x: np.ndarray) -> None:
        self._hist = np.concatenate([self._hist, x]) if self._hist.size else x.copy()
        self.shared.samples += x.size

    def _payloads(self, chunks: list[np.ndarray]) -> list[ChunkPayload]:
        now = self._engine._clock()
        out = []
        for mel in chunks:
            first = self._chunks * self._frame_span
            out.append(ChunkPayload(mel=mel, energies_db=self._energies(first), completed_at=now))
            self._chunks += 1
        # Keep only the audio the next chunk's frame energies need.
        keep_from = max(
            0, self._chunks * self._frame_span * SAMPLES_PER_FRAME + _ENERGY_END - SAMPLES_PER_FRAME
        )
        if keep_from > self._hist_start:
            self._hist = self._hist[keep_from - self._hist_start :]
            self._hist_start = keep_from
        return out

    def _energies(self, first_frame: int) -> np.ndarray:
        out = np.full(self._frame_span, _SILENT_DB, np.float32)
        for i in range(self._frame_span):
            end = (first_frame + i) * SAMPLES_PER_FRAME + _ENERGY_END
            lo = max(0, end - SAMPLES_PER_FRAME) - self._hist_start
            hi = min(end, self.shared.samples) - self._hist_start
            if hi > lo and lo >= 0:
                seg = self._hist[lo:hi]
                out[i] = max(_SILENT_DB, 10.0 * math.log10(float(np.dot(seg, seg)) / seg.size + 1e-12))
        return out


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


class _DecoderWorker:
    """One decoder thread: owns its decoder (ORT sessions) and the state of its pinned streams."""

    def __init__(
        self, engine: AsrEngine, index: int, decoder: StreamDecoder | BatchDecoder, batched: bool
    ) -> None:
        self.engine = engine
        self.index = index
        self.decoder = decoder
        self.batched = batched
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.streams: dict[int, _WorkerStream] = {}
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
        pending: list[EncodedChunk[ChunkPayload]] = []
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
        try:
            ws.state = self.decoder.new_state()
        except Exception as e:
            logger.exception("stream %s: decoder state failed", msg.stream.stream_id)
            self._fail(msg.key, e)

    def _decode(self, chunks: list[EncodedChunk[ChunkPayload]]) -> None:
        if not chunks:
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
        try:
            t0, c0 = time.perf_counter(), time.thread_time()
            tokens = dec.decode(ws.state, c.frames, c.first_frame)
            dt, dc = time.perf_counter() - t0, time.thread_time() - c0
        except Exception as e:
            logger.exception("stream %s: decoding failed", ws.shared.stream_id)
            self._fail(c.key, e)
            return
        ws.decode_s += dt
        ws.decode_cpu_s += dc
        self.engine.hooks.decoder_step(dt, 1)
        self._assemble(ws, c, tokens)

    def _decode_batch(self, rnd: list[EncodedChunk[ChunkPayload]]) -> None:
        dec: BatchDecoder = self.decoder  # type: ignore[assignment]
        wss = [self.streams[c.key] for c in rnd]
        try:
            t0, c0 = time.perf_counter(), time.thread_time()
            tokens = dec.decode_batch(
                [w.state for w in wss], [c.frames for c in rnd], [c.first_frame for c in rnd]
            )
            dt, dc = time.perf_counter() - t0, time.thread_time() - c0
        except Exception as e:
            logger.exception("batched decoding of %d streams failed", len(rnd))
            for c in rnd:
                self._fail(c.key, e)
            return
        self.engine.hooks.decoder_step(dt, len(rnd))
        for ws, c, toks in zip(wss, rnd, tokens, strict=True):
            ws.decode_s += dt / len(rnd)
            ws.decode_cpu_s += dc / len(rnd)
            self._assemble(ws, c, toks)

    def _assemble(self, ws: _WorkerStream, c: EncodedChunk[ChunkPayload], tokens: list[Token]) -> None:
        n = int(c.frames.shape[0])
        try:
            events = ws.assembler.update(tokens, c.first_frame, n, c.payload.energies_db[:n])
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
        if len(ws.lags) > _LAG_SAMPLES:
            del ws.lags[: len(ws.lags) - _LAG_SAMPLES]
        self._emit(ws, events, c.payload.completed_at)

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
