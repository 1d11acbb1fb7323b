"""Reading the gateway's events back from Redis (the global stream, schema v1).

The reader notes the stream's last entry before the first call and reads forward from it with a
blocking XREAD, advancing its own cursor (re-reading from `$` each time would lose what arrived between
two reads). It keeps the events whose `sip_call_id` belongs to this run, stamped with the monotonic
time the read returned: on loopback a blocking XREAD returns within a millisecond of the XADD, unless
this process is late itself (a busy load generator). So each event also carries when redis-server
stored it: an entry ID is the server's wall clock in milliseconds at the XADD (Redis "Streams
introduction": `<millisecondsTime>-<sequenceNumber>`), put on our monotonic clock by the offset
between the two clocks taken at `open()` — the same host's clock, as in the loopback capacity runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tools.replay.analysis import ReceivedEvent

logger = logging.getLogger(__name__)


class EventReader:
    def __init__(self, url: str, stream: str, clock: Callable[[], float], block_ms: int = 500) -> None:
        self.url = url
        self.stream = stream
        self._clock = clock
        self._block_ms = block_ms
        self._redis: aioredis.Redis | None = None
        self.last_id = "0-0"
        self.events: dict[str, list[ReceivedEvent]] = {}
        self._ended: dict[str, asyncio.Event] = {}
        self.entries_read = 0
        self.foreign = 0  # entries of calls that are not ours
        self.errors = 0
        self.last_error = ""
        self._stopping = False
        self._mono_minus_wall: float | None = None  # set by `anchor`

    def anchor(self, wall_now: float) -> None:
        """Relate the server's clock (entry IDs) to ours: `wall_now` is the wall-clock time now."""
        self._mono_minus_wall = self._clock() - wall_now

    def published(self, entry_id: str) -> float | None:
        """When redis-server stored the entry, on our clock (1 ms resolution); None before `anchor`
        or for an ID that is not `<ms>-<seq>`."""
        ms, sep, _seq = entry_id.partition("-")
        if self._mono_minus_wall is None or not sep or not ms.isdigit():
            return None
        return int(ms) / 1000.0 + self._mono_minus_wall

    async def open(self) -> None:
        """Connect and take the starting point. Raises RedisError when Redis is not reachable."""
        self._redis = aioredis.from_url(
            self.url, decode_responses=True, encoding_errors="replace", protocol=2
        )  # RESP2: XREAD replies as [[stream, [(id, fields), ...]]]
        await self._redis.ping()
        self.anchor(time.time())
        last = await self._redis.xrevrange(self.stream, "+", "-", count=1)
        self.last_id = str(last[0][0]) if last else "0-0"

    def watch(self, sip_call_id: str) -> None:
        self.events.setdefault(sip_call_id, [])
        self._ended.setdefault(sip_call_id, asyncio.Event())

    async def wait_call_end(self, sip_call_id: str, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._ended[sip_call_id].wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    def has_call_end(self, sip_call_id: str) -> bool:
        ev = self._ended.get(sip_call_id)
        return ev is not None and ev.is_set()

    def ingest(self, entries: list[tuple[str, dict[str, str]]], arrival: float) -> None:
        for entry_id, fields in entries:
            self.last_id = entry_id
            self.entries_read += 1
            cid = fields.get("sip_call_id", "")
            bucket = self.events.get(cid)
            if bucket is None:
                self.foreign += 1
                continue
            ev = ReceivedEvent.from_fields(fields, arrival, entry_id, self.published(entry_id))
            bucket.append(ev)
            if ev.type == "call_end":
                self._ended[cid].set()

    async def run(self) -> None:
        """Read until `stop()`; Redis errors are counted and retried (the run goes on without events)."""
        assert self._redis is not None, "open() first"
        while not self._stopping:
            try:
                resp: Any = await self._redis.xread(
                    {self.stream: self.last_id}, count=1000, block=self._block_ms
                )
            except RedisError as exc:
                if self._stopping:
                    return
                self.errors += 1
                self.last_error = str(exc)
                if self.errors == 1 or self.errors % 20 == 0:
                    logger.warning("reading %s failed (%d times): %s", self.stream, self.errors, exc)
                await asyncio.sleep(0.5)
                continue
            now = self._clock()
            for _stream, entries in resp or ():
                self.ingest(entries, now)

    async def stop(self, task: asyncio.Task[None]) -> None:
        """End `run()` after its current read. Cancelling a blocked XREAD can wedge redis-py's
        connection (seen with redis-py 8.1: the cancelled task never finishes), so the loop is asked to
        stop and only cancelled if it does not within a read's block time."""
        self._stopping = True
        done, _ = await asyncio.wait({task}, timeout=self._block_ms / 1000.0 + 2.0)
        if not done:
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None
