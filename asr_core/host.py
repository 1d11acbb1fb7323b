"""The engine in a process of its own, fed by front ends in other processes.

    front-end process k --(channel k: OPEN/CHUNK/FINISH/CLOSE)--> [engine process]
                                                                   receiver thread -> AsrEngine
    publishing process <--(results channel: EVENT/ENDED/hooks/STATUS)-- decoder threads, flusher

`EngineHost` carries records into an `AsrEngine` (streams opened with `open_chunk_stream`) and the
engine's events and hook calls out as records. A front-end process that goes away (its channel
reaches EOF) has its streams closed: the text decoded so far still comes out as a final, then
`StreamEnded(reason="closed")`, so the publisher loses nothing already decoded.

`python -m asr_core.host ...` is the process (`EngineProcess` in asr_core.remote starts it): it loads
the model, starts the engine, says `ready` on its control socket (JSON lines) with the front-end spec,
serves until `shutdown` (or until its parent closes the control socket), then drains, releases MLX
and exits 0. An engine failure is reported (`fatal`) and the process exits 1 once told to stop.
`add_input` on the control socket, with the channel's two fds attached (SCM_RIGHTS), adds a front-end
channel while it runs: the one of a media worker that replaces a dead one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import selectors
import socket
import sys
import threading
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

from asr_core.api import AsrEvent, StreamEnded, StreamOptions
from asr_core.channel import ChannelEnd, ChannelReader, ChannelWriter
from asr_core.engine import AsrEngine, ChunkStream, RecentMax
from asr_core.errors import AsrError
from asr_core.wire import (
    DECODE,
    DROPPED,
    LATENCY,
    STATUS,
    STEP,
    TTF,
    Chunk,
    Close,
    Finish,
    Open,
    WireError,
    decode_input,
    encode_decode,
    encode_dropped,
    encode_event,
    encode_latency,
    encode_status,
    encode_step,
    encode_ttf,
)

logger = logging.getLogger(__name__)


class _Output:
    """The results channel, written by several engine threads; one flusher thread publishes."""

    def __init__(self, writer: ChannelWriter, status_period_s: float) -> None:
        self.writer = writer
        self._lock = threading.Condition()
        self._dirty = False
        self._stop = False
        self._period = status_period_s
        self.status: Any = None  # () -> dict, set by the host
        self._thread = threading.Thread(target=self._loop, name="asr-results", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def write(self, kind: int, parts: Sequence[bytes | memoryview]) -> None:
        """Never drops a record: waits for the reader when the ring is full (bounded by its liveness)."""
        with self._lock:
            while not self.writer.write(kind, *parts):
                if self.writer.closed:
                    return
                self.writer.flush()
                self._lock.wait(0.005)
            if not self._dirty:
                self._dirty = True
                self._lock.notify()

    def _loop(self) -> None:
        next_status = time.monotonic()
        while True:
            with self._lock:
                while not self._dirty and not self._stop:
                    wait = next_status - time.monotonic()
                    if wait <= 0:
                        break
                    self._lock.wait(wait)
                stop = self._stop
            if time.monotonic() >= next_status and self.status is not None:
                with contextlib.suppress(Exception):
                    self.write(STATUS, encode_status(self.status()))
                next_status = time.monotonic() + self._period
            with self._lock:
                # A position the reader's socket did not take: publish again shortly, not only with
                # the next record (a call's last final may be the last record for a while).
                self._dirty = not self._published()
                if self._dirty and not stop:
                    self._lock.wait(0.005)
            if stop:
                return

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        self._thread.join(5)
        deadline = time.monotonic() + 1.0
        with self._lock:
            while not self._published() and time.monotonic() < deadline:
                self._lock.wait(0.005)

    def _published(self) -> bool:
        """Flush; whether everything written is announced (or nobody is left to read it)."""
        return self.writer.flush() or self.writer.closed


class _WireHooks:
    """EngineHooks that travel as records (the publishing process feeds its metrics with them)."""

    def __init__(self, out: _Output) -> None:
        self._out = out

    def encoder_step(self, seconds: float, batch_size: int, queue_waits_s: Sequence[float]) -> None:
        self._out.write(STEP, encode_step(seconds, batch_size, queue_waits_s))

    def decoder_step(self, seconds: float, n_streams: int) -> None:
        self._out.write(DECODE, encode_decode(seconds, n_streams))

    def chunk_dropped(self, stream_id: str) -> None:
        self._out.write(DROPPED, encode_dropped(0))

    def transcript(self, kind: str, latency_s: float) -> None:
        self._out.write(LATENCY, encode_latency(kind, latency_s))

    def time_to_final(self, seconds: float) -> None:
        self._out.write(TTF, encode_ttf(seconds))


class EngineHost:
    """Front-end channels in, results channel out, around one engine (see the module docstring)."""

    def __init__(self, engine: AsrEngine, inputs: Sequence[ChannelReader], out: _Output) -> None:
        self.engine = engine
        self.inputs = list(inputs)
        self.out = out
        out.status = self.status
        self._streams: list[dict[int, ChunkStream]] = [{} for _ in inputs]
        self._finished: list[set[int]] = [set() for _ in inputs]  # no more input expected
        self._gone = [False] * len(inputs)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the per-input lists: grown by the receiver, read by `emit`
        self._added: list[ChannelReader] = []  # inputs for the receiver to take on
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._receive, name="asr-receiver", daemon=True)
        self.records = 0
        # The longest time from a chunk's completion in its front end to this thread reading it (the media
        # worker's publishing, then the channel's wake-up of this thread): the first part of receive_lag_s.
        self._arrival_lag = RecentMax()

    def start(self) -> None:
        self.out.start()
        self._thread.start()

    def stop(self) -> None:
        """Stop reading front ends (streams already open go on until the engine shuts down)."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(10)

    def add_input(self, reader: ChannelReader) -> None:
        """Another front end's channel (from any thread): the receiver reads it from its next turn."""
        with self._lock:
            self._added.append(reader)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"+")

    def status(self) -> dict[str, Any]:
        """The engine's status, with how many front ends went away and `arrival_lag_s`: the longest time,
        over the last second or two, from a chunk's completion in its front end to this process reading it
        from the channel (what is left of the engine's `receive_lag_s` is this process applying it: the
        receiving thread's turn, the stream's and the engine's locks)."""
        s: dict[str, Any] = dict(self.engine.status())
        s["front_ends_gone"] = sum(self._gone)
        s["arrival_lag_s"] = self._arrival_lag.value(time.monotonic())
        return s

    def emit(self, key: int, ev: AsrEvent) -> None:
        kind, parts = encode_event(key, ev)
        self.out.write(kind, parts)
        if isinstance(ev, StreamEnded):
            with self._lock:
                for streams, finished in zip(self._streams, self._finished, strict=True):
                    streams.pop(key, None)
                    finished.discard(key)

    # -- the receiver thread ---------------------------------------------------------------------

    def _receive(self) -> None:
        sel = selectors.DefaultSelector()
        for i, r in enumerate(self.inputs):
            sel.register(r.fileno(), selectors.EVENT_READ, i)
        sel.register(self._wake_r, selectors.EVENT_READ, -1)
        try:
            while not self._stop.is_set():
                for sk, _ in sel.select(1.0):
                    i = sk.data
                    if i < 0:
                        self._take_added(sel)
                        continue
                    if not self._take_records(i, sel):
                        continue
                    # Found gone, maybe by the position just sent back: what it published before it
                    # went may still wait on the socket. Read it, then close what is left.
                    gone = self.inputs[i].closed and not self._gone[i]
                    if gone and self._take_records(i, sel):
                        self._front_end_gone(i, sel)
        except Exception:
            logger.exception("engine receiver failed")
        finally:
            sel.close()

    def _take_records(self, i: int, sel: selectors.BaseSelector) -> bool:
        """Apply what front end i published since the last call; False if it sent a bad record (its
        streams are dropped then)."""
        r = self.inputs[i]
        now, oldest = time.monotonic(), None
        try:
            for kind, view in r.poll():
                self.records += 1
                rec = decode_input(kind, view)
                if isinstance(rec, Chunk) and (oldest is None or rec.payload.completed_at < oldest):
                    oldest = rec.payload.completed_at
                self._apply(i, rec)
        except WireError as e:
            logger.error("front end %d sent a bad record (%s); dropping its streams", i, e)
            self._front_end_gone(i, sel)
            return False
        if oldest is not None:
            self._arrival_lag.record(now - oldest, now)
        r.release()
        return True

    def _take_added(self, sel: selectors.BaseSelector) -> None:
        with contextlib.suppress(OSError):
            self._wake_r.recv(4096)
        with self._lock:
            added, self._added = self._added, []
            for r in added:
                i = len(self.inputs)
                sel.register(r.fileno(), selectors.EVENT_READ, i)
                self.inputs.append(r)
                self._streams.append({})
                self._finished.append(set())
                self._gone.append(False)
                logger.info("front end %d added", i)

    def _front_end_gone(self, i: int, sel: selectors.BaseSelector) -> None:
        self._gone[i] = True
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(self.inputs[i].fileno())
        streams = [s for k, s in self._streams[i].items() if k not in self._finished[i]]
        if streams:
            logger.error("front end %d went away: closing its %d streams", i, len(streams))
        for s in streams:
            with contextlib.suppress(AsrError):
                s.close()

    def _apply(self, i: int, rec: Open | Chunk | Finish | Close) -> None:
        streams = self._streams[i]
        if isinstance(rec, Chunk):
            s = streams.get(rec.key)
            if s is None:
                return  # ended already (closed, or refused at open)
            with contextlib.suppress(AsrError):
                if rec.last:
                    self._finished[i].add(rec.key)
                    s.finish([rec.payload], True, rec.samples)
                else:
                    s.push_chunks([rec.payload], rec.samples)
        elif isinstance(rec, Open):
            options = StreamOptions(language=rec.language, lookahead=rec.lookahead)
            try:
                streams[rec.key] = self.engine.open_chunk_stream(
                    rec.stream_id, options, partial(self.emit, rec.key)
                )
            except (AsrError, ValueError) as e:
                self.emit(rec.key, StreamEnded(rec.stream_id, "error", error=f"{type(e).__name__}: {e}"))
        elif isinstance(rec, Finish):
            s = streams.get(rec.key)
            if s is not None:
                self._finished[i].add(rec.key)
                with contextlib.suppress(AsrError):
                    s.finish([], False, rec.samples)
        elif isinstance(rec, Close):
            s = streams.get(rec.key)
            if s is not None:
                s.close()


# --- the process -----------------------------------------------------------------------------------


def _send(control: socket.socket, msg: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        control.sendall((json.dumps(msg) + "\n").encode())


def main(argv: Sequence[str] | None = None) -> int:
    from asr_core.remote import ignore_stop_signals

    ignore_stop_signals()
    p = argparse.ArgumentParser(prog="python -m asr_core.host", description="the ASR engine process")
    p.add_argument("--model", required=True)
    p.add_argument("--precision", default="auto")
    p.add_argument("--device-share", type=float, default=1.0, help="part of the accelerator's memory")
    p.add_argument(
        "--switch-interval-ms", type=float, default=None, help="interpreter-lock hand-over interval"
    )
    p.add_argument("--config", required=True, help="EngineConfig as JSON")
    p.add_argument("--inputs", required=True, help="front-end channel ends, comma-separated")
    p.add_argument("--output", required=True, help="results channel end")
    p.add_argument("--control", type=int, required=True, help="control socket fd")
    p.add_argument("--role", default="engine", help="a name for process listings")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s.%(msecs)03dZ %(levelname)s %(name)s: %(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S",
    )
    logging.Formatter.converter = time.gmtime
    # Before any thread starts. The MLX thread lets go of the lock in every `mx.eval` and large numpy
    # operation and waits up to this interval to get it back (TTG_DAEMON__ENGINE_SWITCH_INTERVAL_MS).
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    control = socket.socket(fileno=args.control)
    fatal = threading.Event()

    def on_fatal(error: BaseException) -> None:
        fatal.set()
        _send(control, {"fatal": f"{type(error).__name__}: {error}"})

    from asr_core.config import engine_config_from_json
    from asr_core.heap import freeze_startup_heap
    from asr_core.model import AsrModel, release_mlx_thread

    try:
        model = AsrModel.load(args.model, args.precision, args.device_share)
        config = engine_config_from_json(json.loads(args.config))
        out = _Output(ChannelWriter.open(ChannelEnd.decode(args.output)), status_period_s=0.25)
        inputs = [ChannelReader.open(ChannelEnd.decode(x)) for x in args.inputs.split(",") if x]
        engine = AsrEngine(model, config, _WireHooks(out), on_fatal=on_fatal).start()
    except Exception as e:
        if not isinstance(e, AsrError):  # a bad bundle is the operator's to fix: one line, no traceback
            logger.exception("the engine did not start")
        _send(control, {"failed": str(e), "kind": type(e).__name__})
        return 1
    host = EngineHost(engine, inputs, out)
    host.start()
    info = {
        "precision": model.info.precision,
        "device": model.info.device,
        "pid": os.getpid(),
        "max_streams": engine.max_streams,
        "switch_interval_ms": round(sys.getswitchinterval() * 1e3, 3),
    }
    spec = model.frontend_spec(vad=config.vad if config.vad.enabled else None)
    freeze_startup_heap()
    _send(control, {"ready": spec.to_json(), "info": info})
    shutdown = _serve_control(control, host)
    host.stop()
    engine.shutdown(drain=bool(shutdown.get("drain", True)), timeout=float(shutdown.get("timeout", 10.0)))
    out.stop()
    del engine, model
    try:
        release_mlx_thread()
    except RuntimeError as e:  # the device failed earlier (the fatal error was reported): one line
        logger.error("releasing the accelerator failed: %s", e)
        fatal.set()
    _send(control, {"stopped": True, "records": host.records})
    return 1 if fatal.is_set() else 0


def _serve_control(control: socket.socket, host: EngineHost) -> dict[str, Any]:
    """Serve the parent's requests until it says `shutdown` (or goes away: then no drain)."""
    buf = b""
    fds: list[int] = []  # received with `add_input` lines, two per line, in order
    while True:
        try:
            data, received, _, _ = socket.recv_fds(control, 4096, 16)
        except OSError:
            data, received = b"", []
        fds += received
        if not data:
            for fd in fds:
                os.close(fd)
            return {"drain": False, "timeout": 2.0}
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "shutdown" in msg:
                return dict(msg["shutdown"])
            if "add_input" in msg and len(fds) >= 2:
                memory_fd, socket_fd = fds.pop(0), fds.pop(0)
                end = ChannelEnd(memory_fd, int(msg["add_input"]["size"]), socket_fd)
                host.add_input(ChannelReader.open(end))


if __name__ == "__main__":
    from asr_core import configure_process

    configure_process()  # this process runs MLX: set up before the model loads mlx
    status = main()
    # A child process ends like multiprocessing's do: its work is done and reported, its streams and
    # device state released; os._exit skips the C++ static destructors of native libraries, which
    # have no part in the result but can abort at interpreter teardown.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
