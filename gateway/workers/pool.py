"""The main process's side of the media workers: start them, give each leg to one, talk to them.

`MediaWorkerPool.start()` spawns `n` processes (`python -m gateway.workers.media_worker`), each with its
own slice of the RTP port range, a control socketpair (JSON lines, gateway.workers.protocol) and its
end of a chunk channel to an engine process. A leg goes to the engine that carries the fewest legs and
there to its worker with the fewest (`place_leg`); its messages then go to that worker. Answers
(opened / open_failed / closed) resolve the awaiting calls, events (DTMF, inactivity) go to
`on_event`, metric deltas into this process's registry.

A worker whose control socket reaches EOF is dead: its pending requests fail (`WorkerGone`), its legs
are reported through `on_worker_died(index, legs)`, and it takes no new legs; the others go on.

When an engine process fails, the workers that fed it are `suspend`ed (no new legs), and once their
calls have ended (`drained`) each is `replace`d by a fresh process with its slice of the ports and its
end of the new engine's channel; a replaced worker's end is not a death. Then they are `resume`d.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asr_core.channel import ChannelEnd
from gateway import metrics
from gateway.rtp.stats import MediaStats
from gateway.sdp import MediaPlan
from gateway.workers.protocol import apply_deltas, counters_by_name, line, plan_to_json, stats_from_json

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


class WorkerGone(Exception):
    """The media worker that owned a leg is not running any more."""


class OpenFailed(Exception):
    def __init__(self, message: str, exhausted: bool) -> None:
        super().__init__(message)
        self.exhausted = exhausted


@dataclass(eq=False)
class _Worker:
    index: int
    proc: subprocess.Popen[bytes]
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    ports: tuple[int, int]
    legs: set[str] = field(default_factory=set)
    alive: bool = True
    streams: int = 0
    ready: asyncio.Future[None] | None = None
    task: asyncio.Task[None] | None = None
    accepting: bool = True  # takes new legs (False while its engine is being replaced)
    retired: bool = False  # stopped to be replaced: its end is not a death


def split_ports(port_min: int, port_max: int, n: int) -> list[tuple[int, int]]:
    """n disjoint slices of the range, each starting on an even port (RTP even, RTCP odd)."""
    first = port_min + (port_min & 1)
    pairs = (port_max - first + 1) // 2
    per = pairs // n
    if per < 1:
        raise ValueError(f"RTP ports {port_min}-{port_max} hold {pairs} pairs: fewer than {n} media workers")
    return [(first + 2 * per * i, first + 2 * per * (i + 1) - 1) for i in range(n)]


def place_leg(engines: Sequence[int], legs: Sequence[int], taking: Sequence[bool]) -> int | None:
    """The worker for a new leg, given each worker's engine, legs and whether it takes new legs: on the
    engine that carries the fewest legs among those with a worker taking legs, its taking worker with
    the fewest (the lowest index on ties); None when no worker takes legs.

    By engine first, because an engine batches the calls of all its workers: when the engine count does
    not divide the worker count, some engines are fed by more workers than others (12 workers, 5
    engines: 3, 3, 2, 2, 2), and placing by the workers' legs alone would give those engines that much
    more of the calls (a quarter each instead of a fifth)."""
    if not len(engines) == len(legs) == len(taking):
        raise ValueError("one engine, leg count and taking flag per worker")
    load: dict[int, int] = {}
    for engine, n in zip(engines, legs, strict=True):
        load[engine] = load.get(engine, 0) + n
    open_ = [i for i, t in enumerate(taking) if t]
    if not open_:
        return None
    return min(open_, key=lambda i: (load[engines[i]], legs[i], i))


class MediaWorkerPool:
    def __init__(
        self,
        n: int,
        *,
        spec_file: Path,
        chunk_ends: Sequence[ChannelEnd],
        engines: Sequence[int],
        media_config: dict[str, Any],
        host: str,
        port_min: int,
        port_max: int,
        quarantine_s: float,
        intake_tick_s: float = 0.0,
        log_level: str = "INFO",
        uvloop: bool = False,
        python: str = sys.executable,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
        on_worker_died: Callable[[int, list[str]], None] | None = None,
    ) -> None:
        if len(chunk_ends) < n:
            raise ValueError(f"{n} media workers need {n} chunk channels, got {len(chunk_ends)}")
        # Worker i's engine (the one its chunk channel leads to): legs are spread over engines first.
        self.engines = list(engines)
        if len(self.engines) != n:
            raise ValueError(f"{n} media workers need {n} engine indices, got {len(self.engines)}")
        self.n = n
        self.spec_file = spec_file
        self.chunk_ends = list(chunk_ends)
        self.media_config = media_config
        self.host = host
        self.slices = split_ports(port_min, port_max, n)
        self.quarantine_s = quarantine_s
        self.intake_tick_s = intake_tick_s
        self.log_level = log_level
        self.uvloop = uvloop
        self.python = python
        self.on_event = on_event or (lambda leg, msg: None)
        self.on_worker_died = on_worker_died or (lambda index, legs: None)
        self.workers: list[_Worker] = []
        self._owner: dict[str, _Worker] = {}
        self._pending: dict[tuple[str, str], asyncio.Future[dict[str, Any]]] = {}
        self._counters = counters_by_name(metrics)
        self._stopping = False

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        for i in range(self.n):
            self.workers.append(await self._spawn(i, self.chunk_ends[i]))
        for w in self.workers:
            await self._until_ready(w)

    async def _spawn(self, i: int, end: ChannelEnd, *, accepting: bool = True) -> _Worker:
        """Worker process i with its port slice and `end` of its engine's chunk channel (not waited for)."""
        here, there = socket.socketpair()
        there.set_inheritable(True)
        lo, hi = self.slices[i]
        media = {"config": self.media_config, "host": self.host, "port_min": lo, "port_max": hi,
                 "quarantine_s": self.quarantine_s, "intake_tick_s": self.intake_tick_s}  # fmt: skip
        cmd = [
            self.python, "-m", "gateway.workers.media_worker", "--index", str(i),
            "--control", str(there.fileno()), "--chunks", end.encode(), "--spec", str(self.spec_file),
            "--media", json.dumps(media), "--log-level", self.log_level, "--role", f"media_{i}",
        ]  # fmt: skip
        if self.uvloop:
            cmd.append("--uvloop")
        proc = subprocess.Popen(cmd, pass_fds=[there.fileno(), *end.fds()])
        there.close()
        reader, writer = await asyncio.open_unix_connection(sock=here)
        loop = asyncio.get_running_loop()
        w = _Worker(i, proc, reader, writer, (lo, hi), ready=loop.create_future(), accepting=accepting)
        w.task = loop.create_task(self._read(w))
        return w

    async def _until_ready(self, w: _Worker) -> None:
        assert w.ready is not None
        try:
            await asyncio.wait_for(asyncio.shield(w.ready), START_TIMEOUT_S)
        except TimeoutError:
            raise RuntimeError(
                f"media worker {w.index} did not start within {START_TIMEOUT_S:.0f} s"
            ) from None

    @property
    def alive(self) -> int:
        return sum(w.alive for w in self.workers)

    async def stop(self) -> None:
        """Ask every worker to stop (its legs are aborted), then wait for the processes."""
        self._stopping = True
        await asyncio.gather(*(self._end(w) for w in self.workers))

    async def _end(self, w: _Worker) -> None:
        """Stop worker w's process (its legs are aborted there) and wait for it; kill it past the limit."""
        if w.alive:
            with contextlib.suppress(ConnectionError, RuntimeError):
                w.writer.write(line({"op": "stop"}))
        try:
            await asyncio.wait_for(asyncio.to_thread(w.proc.wait), STOP_TIMEOUT_S)
        except TimeoutError:
            logger.warning("media worker %d did not stop; killing it", w.index)
            w.proc.kill()
            await asyncio.to_thread(w.proc.wait)
        if w.task is not None:
            w.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await w.task
        w.writer.close()

    # -- replacing the workers of an engine that failed ------------------------------------------

    def suspend(self, indices: Sequence[int]) -> None:
        """Workers that take no new legs (their engine is gone); their legs stay theirs until they end."""
        for i in indices:
            self.workers[i].accepting = False

    def resume(self, indices: Sequence[int]) -> None:
        for i in indices:
            self.workers[i].accepting = True

    async def drained(self, indices: Sequence[int], timeout: float) -> int:
        """Wait (at most `timeout` s) until the workers hold no legs; how many they still hold."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (left := sum(len(self.workers[i].legs) for i in indices)) and loop.time() < deadline:
            await asyncio.sleep(0.1)
        return left

    async def replace(self, indices: Sequence[int], ends: Sequence[ChannelEnd]) -> None:
        """Stop workers `indices` and start fresh ones in their places, each with its port slice and its
        end of the new engine's channel; they come up suspended. A leg still on an old worker fails
        (`WorkerGone`): its call already ended with its engine. RuntimeError if one does not start."""
        old = [self.workers[i] for i in indices]
        for w in old:
            w.retired = True
        await asyncio.gather(*(self._end(w) for w in old))
        for i, end in zip(indices, ends, strict=True):
            self.workers[i] = await self._spawn(i, end, accepting=False)
        for i in indices:
            await self._until_ready(self.workers[i])

    # -- legs ------------------------------------------------------------------------------------

    async def open_leg(
        self,
        leg: str,
        key: int,
        plan: MediaPlan | None,
        *,
        language: str,
        lookahead: int | None,
        stream_id: str,
    ) -> int:
        """Give the leg to a worker and open its port there; its port (OpenFailed, WorkerGone)."""
        i = place_leg(
            self.engines,
            [len(w.legs) if w.alive else 0 for w in self.workers],
            [w.alive and w.accepting for w in self.workers],
        )
        if i is None:
            raise WorkerGone("no media worker is taking calls")
        w = self.workers[i]
        w.legs.add(leg)
        self._owner[leg] = w
        msg = {"op": "open", "leg": leg, "key": key, "plan": plan_to_json(plan), "language": language,
               "lookahead": lookahead, "stream_id": stream_id}  # fmt: skip
        reply = await self._request(w, leg, "open", msg, ("opened", "open_failed"))
        if reply["op"] == "open_failed":
            raise OpenFailed(str(reply.get("error", "")), bool(reply.get("exhausted")))
        return int(reply["port"])

    def update_leg(self, leg: str, plan: MediaPlan) -> None:
        self._send(leg, {"op": "update", "leg": leg, "plan": plan_to_json(plan)})

    async def close_leg(self, leg: str) -> tuple[MediaStats | None, int]:
        """Flush the leg's media into its ASR front end; (its stats, audio ms) — (None, 0) if its
        worker is gone."""
        w = self._owner.get(leg)
        if w is None or not w.alive:
            return None, 0
        try:
            reply = await self._request(w, leg, "close", {"op": "close", "leg": leg}, ("closed",))
        except WorkerGone:
            return None, 0
        stats = reply.get("stats")
        return (stats_from_json(stats) if stats else None), int(reply.get("audio_ms", 0))

    def finish_leg(self, leg: str) -> bool:
        """End the leg's ASR stream (after close_leg); False when its worker is gone."""
        ok = self._send(leg, {"op": "finish", "leg": leg})
        self._forget(leg)
        return ok

    def abort_leg(self, leg: str) -> None:
        self._send(leg, {"op": "abort", "leg": leg})
        self._forget(leg)

    def owner(self, leg: str) -> int | None:
        w = self._owner.get(leg)
        return None if w is None else w.index

    # -- internals -------------------------------------------------------------------------------

    def _forget(self, leg: str) -> None:
        w = self._owner.pop(leg, None)
        if w is not None:
            w.legs.discard(leg)

    def _send(self, leg: str, msg: dict[str, Any]) -> bool:
        w = self._owner.get(leg)
        if w is None or not w.alive:
            return False
        w.writer.write(line(msg))
        return True

    async def _request(
        self, w: _Worker, leg: str, op: str, msg: dict[str, Any], answers: tuple[str, ...]
    ) -> dict[str, Any]:
        if not w.alive:
            raise WorkerGone(f"media worker {w.index} is not running")
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        for a in answers:
            self._pending[(leg, a)] = fut
        try:
            w.writer.write(line(msg))
            return await fut
        finally:
            for a in answers:
                self._pending.pop((leg, a), None)

    async def _read(self, w: _Worker) -> None:
        try:
            while True:
                raw = await w.reader.readline()
                if not raw:
                    break
                try:
                    self._dispatch(w, json.loads(raw))
                except Exception:
                    logger.exception("media worker %d: bad message %r", w.index, raw[:200])
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._died(w)

    def _dispatch(self, w: _Worker, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "metrics":
            apply_deltas(self._counters, msg.get("counters") or [])
            w.streams = int(msg.get("streams", 0))
            metrics.RTP_STREAMS.set(sum(x.streams for x in self.workers if x.alive))
            if "loop_lag_s" in msg:
                loop_lag, flush_delay = float(msg["loop_lag_s"]), float(msg.get("flush_delay_s", 0.0))
                metrics.set_media_worker_timing(str(w.index), loop_lag, flush_delay)
            return
        if op == "ready":
            if w.ready is not None and not w.ready.done():
                w.ready.set_result(None)
            return
        leg = str(msg.get("leg", ""))
        fut = self._pending.get((leg, str(op)))
        if fut is not None:
            if not fut.done():
                fut.set_result(msg)
            return
        self.on_event(leg, msg)

    def _died(self, w: _Worker) -> None:
        if not w.alive:
            return
        w.alive = False
        metrics.set_media_worker_timing(str(w.index), 0.0, 0.0)
        legs = sorted(w.legs)
        w.legs.clear()
        for leg in legs:
            self._owner.pop(leg, None)
            for key in [k for k in self._pending if k[0] == leg]:
                fut = self._pending.pop(key)
                if not fut.done():
                    fut.set_exception(WorkerGone(f"media worker {w.index} died"))
        if w.ready is not None and not w.ready.done():
            w.ready.set_exception(RuntimeError(f"media worker {w.index} exited before it was ready"))
        if self._stopping or w.retired:
            return
        code = w.proc.poll()
        logger.error(
            "media worker %d (pid %d) is gone (exit status %s): its %d legs end as errors",
            w.index, w.proc.pid, code, len(legs),
        )  # fmt: skip
        metrics.MEDIA_WORKER_DEATHS.inc()
        self.on_worker_died(w.index, legs)
