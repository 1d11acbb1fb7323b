"""Both ends of the engine in its own process: `EngineProcess` starts it and reads its results,
`ChunkSender` is what a front-end process writes streams with (asr_core.host is the engine's side).

    engine = EngineProcess(model_dir, "auto", config, front_ends=4)
    spec = engine.start(timeout=600)          # blocks until the model is loaded and the engine up
    ends = engine.front_end_ends()            # pass ends[i] (inheritable fds) to front-end process i
    ...  for out in engine.read_results(): ...  (when engine.results.fileno() is readable)
    engine.shutdown(drain=True, timeout=10)   # exit status of the engine process

In front-end process i:
    sender = ChunkSender(ChannelWriter.open(end))
    sender.open(key, lookahead, language, stream_id); sender.chunks(key, payloads, samples)
    sender.finish(key, samples) / sender.close(key); sender.flush() once per batch
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asr_core.channel import ChannelEnd, ChannelReader, ChannelWriter, SharedMemory, channel_pair
from asr_core.config import EngineConfig, engine_config_to_json
from asr_core.errors import EngineStoppedError
from asr_core.frontend import ChunkPayload, FrontEndSpec
from asr_core.wire import (
    CHUNK,
    CLOSE,
    FINISH,
    OPEN,
    Decode,
    Dropped,
    Event,
    Latency,
    Status,
    Step,
    TimeToFinal,
    decode_output,
    encode_chunk,
    encode_close,
    encode_finish,
    encode_open,
)


def ignore_stop_signals() -> None:
    """For a process the daemon starts (the engine, a media worker): SIGINT and SIGTERM are the
    daemon's. systemd stops a unit by signalling every process of its control group, and a terminal's
    Ctrl-C reaches its whole process group; a child that died of them would end its calls without their
    finals. The daemon drains the calls, then stops its children in order over their control sockets
    (and kills one that does not stop); a child whose daemon is gone sees its control socket close."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


CHUNK_CHANNEL_BYTES = 16 << 20  # ~1,000 chunks of 32 x 128 mels: seconds of a busy worker's output
RESULTS_CHANNEL_BYTES = 8 << 20


class ChunkSender:
    """Streams into the engine through one channel. Records that find the ring full wait here, in
    order, and go first at the next `flush` (nothing is dropped; the engine's own queue bound and
    the gateway's admission are where overload is handled)."""

    def __init__(self, writer: ChannelWriter) -> None:
        self.writer = writer
        self._pending: deque[tuple[int, list[bytes | memoryview]]] = deque()
        self.dirty = False

    @property
    def backlog(self) -> int:
        return len(self._pending)

    def open(self, key: int, lookahead: int | None, language: str, stream_id: str) -> None:
        self._put(OPEN, list(encode_open(key, lookahead, language, stream_id)))

    def chunks(
        self, key: int, payloads: Sequence[ChunkPayload], samples: int, *, last_is_final: bool = False
    ) -> None:
        for i, p in enumerate(payloads):
            last = last_is_final and i == len(payloads) - 1
            self._put(CHUNK, encode_chunk(key, p, samples, last=last))

    def finish(self, key: int, samples: int) -> None:
        self._put(FINISH, list(encode_finish(key, samples)))

    def close(self, key: int) -> None:
        self._put(CLOSE, list(encode_close(key)))

    def flush(self) -> bool:
        """Publish what was written; False while records still wait for room, or while their position
        did not reach the engine (its socket full): call again soon, or the last records of a front
        end that writes nothing more (a call's FINISH) would sit in the ring unannounced. True once the
        engine is gone: nothing will take them."""
        while self._pending:
            kind, parts = self._pending[0]
            if not self.writer.write(kind, *parts):
                break
            self._pending.popleft()
        published = self.writer.flush()
        self.dirty = False
        return self.writer.closed or (published and not self._pending)

    def _put(self, kind: int, parts: list[bytes | memoryview]) -> None:
        self.dirty = True
        if self._pending or not self.writer.write(kind, *parts):
            # keep the bytes: views of a caller's arrays must not change under us
            self._pending.append((kind, [bytes(p) for p in parts]))


class EngineProcess:
    """The engine process (python -m asr_core.host) and this process's ends of its channels."""

    def __init__(
        self,
        model_dir: str | Path,
        precision: str,
        config: EngineConfig,
        front_ends: int,
        *,
        python: str = sys.executable,
        log_level: str = "INFO",
        chunk_channel_bytes: int = CHUNK_CHANNEL_BYTES,
        results_channel_bytes: int = RESULTS_CHANNEL_BYTES,
        env: dict[str, str] | None = None,
        role: str = "engine",
        device_share: float = 1.0,
        switch_interval_ms: float | None = None,
    ) -> None:
        self.model_dir = str(model_dir)
        self.switch_interval_ms = switch_interval_ms  # sys.setswitchinterval there; None: Python's
        self.device_share = device_share  # of the accelerator's memory (several engines share one)
        self.role = role  # its name in process listings
        self.precision = precision
        self.config = config
        self.n_front_ends = front_ends
        self.python = python
        self.log_level = log_level
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.spec: FrontEndSpec | None = None
        self.info: dict[str, Any] = {}
        self.failure: str | None = None
        self.status: dict[str, Any] = {}
        self._chunk_bytes = chunk_channel_bytes
        self._results_bytes = results_channel_bytes
        self._front_end_ends: list[ChannelEnd] = []
        self._keep: list[Any] = []  # fds and memories to close once handed over
        self.results: ChannelReader | None = None
        self._control: socket.socket | None = None
        self._control_buf = b""
        self.exit_status: int | None = None
        self.start_error: tuple[str, str] | None = None  # (exception type, message) of a failed start
        self.control_eof = False

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self, timeout: float = 600.0) -> FrontEndSpec:
        """Spawn the engine and wait until it is ready (or failed: EngineStoppedError)."""
        engine_inputs: list[ChannelEnd] = []
        for _ in range(self.n_front_ends):
            w, r, mem, socks = channel_pair(self._chunk_bytes)
            self._front_end_ends.append(w)
            engine_inputs.append(r)
            self._keep += [mem, *socks]
        w, r, mem, (sw, sr) = channel_pair(self._results_bytes)
        self.results = ChannelReader(SharedMemory.attach(os.dup(mem.fd), mem.size), sr)
        self._keep += [mem, sw]
        ctrl_here, ctrl_there = socket.socketpair()
        ctrl_there.set_inheritable(True)
        fds = [fd for e in [*engine_inputs, w] for fd in e.fds()] + [ctrl_there.fileno()]
        cmd = [
            self.python, "-m", "asr_core.host",
            "--model", self.model_dir, "--precision", self.precision,
            "--device-share", repr(self.device_share),
            "--config", json.dumps(engine_config_to_json(self.config)),
            "--inputs", ",".join(e.encode() for e in engine_inputs),
            "--output", w.encode(),
            "--control", str(ctrl_there.fileno()),
            "--log-level", self.log_level, "--role", self.role,
        ]  # fmt: skip
        if self.switch_interval_ms is not None:
            cmd += ["--switch-interval-ms", repr(self.switch_interval_ms)]
        self.proc = subprocess.Popen(cmd, pass_fds=fds, env=self.env)
        ctrl_there.close()
        self._control = ctrl_here
        # The engine's ends live in its process now; ours of its inputs go when the front ends have theirs.
        deadline = time.monotonic() + timeout
        ctrl_here.settimeout(1.0)
        while self.spec is None:
            if time.monotonic() > deadline:
                self.kill()
                raise EngineStoppedError(f"the engine process was not ready within {timeout:.0f} s")
            for msg in self._read_control(block=True):
                if "ready" in msg:
                    self.spec = FrontEndSpec.from_json(msg["ready"])
                    self.info = dict(msg.get("info", {}))
                elif "failed" in msg:
                    self.wait(10)
                    self.start_error = (str(msg.get("kind", "")), str(msg["failed"]))
                    raise EngineStoppedError(f"the engine process failed to start: {msg['failed']}")
            if self.proc.poll() is not None and self.spec is None:
                raise EngineStoppedError(f"the engine process exited with status {self.proc.returncode}")
        ctrl_here.setblocking(False)
        return self.spec

    def front_end_ends(self) -> list[ChannelEnd]:
        return list(self._front_end_ends)

    def add_front_end(self) -> ChannelEnd:
        """A new chunk channel into the running engine (for a front-end process that replaces a dead
        one): the engine's end goes over the control socket (SCM_RIGHTS); the returned end is for the
        new front end, and this process's copies close at `handed_over`. OSError if the engine is gone."""
        if self._control is None:
            raise OSError("the engine process's control socket is closed")
        w, r, mem, socks = channel_pair(self._chunk_bytes)
        self._keep += [mem, *socks]
        line = (json.dumps({"add_input": {"size": r.size}}) + "\n").encode()
        self._control.setblocking(True)
        try:
            socket.send_fds(self._control, [line], list(r.fds()))
        finally:
            self._control.setblocking(False)
        return w

    def handed_over(self) -> None:
        """The front-end processes hold their ends now: close this process's copies (so that a
        front end that dies is seen as EOF by the engine)."""
        for obj in self._keep:
            with contextlib.suppress(OSError):
                obj.close()
        self._keep.clear()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def control_fileno(self) -> int:
        assert self._control is not None
        return self._control.fileno()

    def poll_control(self) -> bool:
        """Read what the engine said (non-blocking): `failure` is set on 'fatal'; True while it lives."""
        for msg in self._read_control(block=False):
            if "fatal" in msg:
                self.failure = str(msg["fatal"])
        if self.control_eof or (self.proc is not None and self.proc.poll() is not None):
            if self.failure is None and self.exit_status is None:
                self.failure = (
                    f"the engine process exited (status {self.proc.returncode if self.proc else '?'})"
                )
            return False
        return True

    def read_results(self) -> list[Event | Step | Decode | Dropped | Latency | TimeToFinal | Status]:
        """Everything the engine published since the last call (non-blocking)."""
        assert self.results is not None
        out = [decode_output(kind, view) for kind, view in self.results.poll()]
        self.results.release()
        for o in out:
            if isinstance(o, Status):
                self.status = o.values
        return out

    def shutdown(self, *, drain: bool = True, timeout: float = 10.0) -> int:
        """Ask the engine to finish (drain) or close its streams and exit; its exit status."""
        if self._control is not None:
            with contextlib.suppress(OSError):
                self._control.setblocking(True)
                self._control.sendall(
                    (json.dumps({"shutdown": {"drain": drain, "timeout": timeout}}) + "\n").encode()
                )
        return self.wait(timeout + 30.0)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.wait()
        self.exit_status = code
        return code

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        self.handed_over()
        if self.results is not None:
            self.results.close()
        if self._control is not None:
            with contextlib.suppress(OSError):
                self._control.close()
            self._control = None

    def _read_control(self, *, block: bool) -> list[dict[str, Any]]:
        sock = self._control
        if sock is None or self.control_eof:
            return []
        msgs: list[dict[str, Any]] = []
        while True:
            try:
                data = sock.recv(65536)
            except (BlockingIOError, TimeoutError, InterruptedError):
                break
            except OSError:
                data = b""
            if not data:
                self.control_eof = True  # the engine process is gone (the socket is closed by close())
                break
            self._control_buf += data
            if block:
                break
        while b"\n" in self._control_buf:
            line, self._control_buf = self._control_buf.split(b"\n", 1)
            with contextlib.suppress(ValueError):
                msgs.append(json.loads(line))
        return msgs
