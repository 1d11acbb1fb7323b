"""The asyncio adapter of the sink: one publisher task owns the Redis connection and the spool.

`publish(ev)` is synchronous and only enqueues (call it on the event loop's thread; the ASR engine's
events reach the loop through `call_soon_threadsafe`). The task asks the core what to do, sends one
script call per batch (redis-py asyncio + hiredis, with redis-py's async `Retry` and exponential
backoff for the command itself, and health checks), feeds the outcome back, and sleeps until the
next event or `core.next_deadline()`. Spool fsyncs run on a worker thread, never on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import EqualJitterBackoff, ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.events import CallEvent
from gateway.metrics import PrometheusSinkHooks
from gateway.sink.core import BatchOutcome, Probe, SendBatch, SinkConfig, SinkCore
from gateway.sink.script import LUA_APPLY_BATCH, StreamLayout, batch_call, parse_outcome
from gateway.sink.spool import Spool

if TYPE_CHECKING:
    from gateway.config import Settings

logger = logging.getLogger(__name__)

_NO_ANSWER = (RedisConnectionError, RedisTimeoutError, OSError)


@dataclasses.dataclass(frozen=True, slots=True)
class ClientConfig:
    url: str = "redis://127.0.0.1:6379/0"
    socket_timeout_s: float = 2.0
    connect_timeout_s: float = 1.0
    retries: int = 2
    health_check_interval_s: int = 5


def make_client(cfg: ClientConfig) -> aioredis.Redis:
    # The async Retry (redis.asyncio.retry): the sync one does nothing in an asyncio client.
    retry = Retry(ExponentialWithJitterBackoff(cap=0.5, base=0.05), cfg.retries)
    return aioredis.Redis.from_url(
        cfg.url,
        decode_responses=True,
        socket_timeout=cfg.socket_timeout_s,
        socket_connect_timeout=cfg.connect_timeout_s,
        retry=retry,
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        health_check_interval=cfg.health_check_interval_s,
        client_name="ttg-sink",
    )


class RedisSink:
    """EventPublisher to Redis Streams: never blocks the caller; nothing committed is lost or doubled."""

    def __init__(
        self,
        core: SinkCore,
        layout: StreamLayout,
        client: aioredis.Redis,
        *,
        fsync_interval_s: float = 0.2,
        flush_timeout_s: float = 5.0,
        on_degraded: Callable[[bool], None] | None = None,
        hooks: PrometheusSinkHooks | None = None,
    ) -> None:
        self.core = core
        self.flush_timeout_s = flush_timeout_s
        self.layout = layout
        self.client = client
        self.fsync_interval_s = fsync_interval_s
        self._on_degraded = on_degraded
        self._hooks = hooks
        self._script = client.register_script(LUA_APPLY_BATCH)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._closed = False
        self._degraded = False
        self._last_sync = float("-inf")
        self._warned_down = False
        if hooks is not None:
            hooks.bind_buffered(lambda: core.buffered)
            hooks.redis_up(core.redis_up)  # 0 until the first round trip succeeds

    @classmethod
    def create(
        cls,
        *,
        spool_dir: str,
        layout: StreamLayout,
        client_cfg: ClientConfig,
        sink_cfg: SinkConfig,
        spool_max_bytes: int = 1 << 30,
        fsync_interval_s: float = 0.2,
        flush_timeout_s: float = 5.0,
        backoff_cap_s: float = 5.0,
        on_degraded: Callable[[bool], None] | None = None,
        metrics: bool = True,
    ) -> RedisSink:
        """Open the spool (checking it), build the core and the client."""
        hooks = PrometheusSinkHooks() if metrics else None
        spool, scan = Spool.open(spool_dir, spool_max_bytes)
        if hooks is not None and scan.corrupt:
            hooks.spool_corrupt(scan.corrupt)
        backoff = EqualJitterBackoff(cap=backoff_cap_s, base=0.05)
        core = SinkCore(sink_cfg, spool, scan, hooks, backoff.compute)
        return cls(
            core,
            layout,
            make_client(client_cfg),
            fsync_interval_s=fsync_interval_s,
            flush_timeout_s=flush_timeout_s,
            on_degraded=on_degraded,
            hooks=hooks,
        )

    @classmethod
    def from_settings(
        cls, settings: Settings, on_degraded: Callable[[bool], None] | None = None, metrics: bool = True
    ) -> RedisSink:
        """From gateway.config.Settings (its redis and sink sections)."""
        r, s = settings.redis, settings.sink
        layout = StreamLayout(
            stream=r.stream,
            maxlen=r.maxlen,
            calls_stream=r.calls_stream,
            calls_maxlen=r.calls_maxlen,
            guard_ttl_s=r.dedupe_ttl_s,
            per_call_ttl_s=r.per_call_ttl_s if r.per_call_streams else 0,
        )
        client_cfg = ClientConfig(
            r.url, r.socket_timeout_s, r.connect_timeout_s, r.retries, r.health_check_interval_s
        )
        sink_cfg = SinkConfig(
            max_buffered=s.max_buffered,
            batch_max=s.batch_max,
            spill_after_s=s.spill_after_s,
            probe_interval_s=float(max(1, r.health_check_interval_s)),
        )
        return cls.create(
            spool_dir=s.spool_dir,
            layout=layout,
            client_cfg=client_cfg,
            sink_cfg=sink_cfg,
            spool_max_bytes=s.spool_max_bytes,
            fsync_interval_s=s.spool_fsync_interval_s,
            flush_timeout_s=s.flush_timeout_s,
            backoff_cap_s=s.backoff_cap_s,
            on_degraded=on_degraded,
            metrics=metrics,
        )

    # --- the caller's side ------------------------------------------------------------------------
    def publish(self, ev: CallEvent) -> None:
        """Enqueue an event (event-loop thread). Never blocks, never raises."""
        try:
            if ev.ts == 0.0:
                ev = dataclasses.replace(ev, ts=time.time())
            if self._closed:
                logger.warning(
                    "event %s of call %s published after the sink closed: spooled", ev.type, ev.call_id
                )
            self.core.publish(ev)
            self._report_degraded()
        except Exception:  # a bug here must not reach the media or ASR path
            logger.exception("sink: publish failed for a %s event of call %s", ev.type, ev.call_id)
        self._wake.set()

    def publish_threadsafe(self, ev: CallEvent) -> None:
        """`publish` from another thread (e.g. an engine thread): handed to the loop, never blocks."""
        if self._loop is None:
            raise RuntimeError("the sink is not started")
        self._loop.call_soon_threadsafe(self.publish, ev)

    @property
    def degraded(self) -> bool:
        return self.core.degraded

    @property
    def redis_up(self) -> bool:
        return self.core.redis_up

    # --- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="ttg-sink")

    async def close(self, timeout_s: float | None = None) -> None:
        """Send what is left for up to `timeout_s` while Redis takes it; spool the rest; fsync; close."""
        if self._closed:
            return
        timeout_s = self.flush_timeout_s if timeout_s is None else timeout_s
        self._closing = True
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except TimeoutError:
                self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        loop = asyncio.get_running_loop()
        self.core.shutdown(loop.time())
        self._closed = True
        await asyncio.to_thread(self.core.spool.sync)
        self.core.spool.close()
        self._report_degraded()
        with contextlib.suppress(RedisError, OSError):
            await self.client.aclose()
        if self.core.spool.pending:
            logger.info(
                "sink closed: %d events wait in the spool for the next start", self.core.spool.pending
            )

    async def __aenter__(self) -> RedisSink:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- the publisher task -----------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            if self._closing and (self.core.idle or not self.core.redis_up):
                return
            action = self.core.poll(loop.time())
            self._report_degraded()
            if isinstance(action, SendBatch):
                await self._send(action, loop)
            elif isinstance(action, Probe) and not self._closing:
                await self._probe(loop)
            else:
                await self._sleep(loop)
            self._report_degraded()
            if self.core.spool.unsynced and loop.time() - self._last_sync >= self.fsync_interval_s:
                self._last_sync = loop.time()
                await asyncio.to_thread(self.core.spool.sync)

    async def _sleep(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._closing:
            return
        deadline = self.core.next_deadline()
        if self.core.spool.unsynced:
            sync_at = self._last_sync + self.fsync_interval_s
            deadline = sync_at if deadline is None else min(deadline, sync_at)
        if deadline is not None and deadline <= loop.time():
            await asyncio.sleep(0)
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                await self._wake.wait()

    async def _send(self, batch: SendBatch, loop: asyncio.AbstractEventLoop) -> None:
        keys, args = batch_call(self.layout, batch.records)
        t0 = loop.time()
        try:
            reply = await self._script(keys=keys, args=args)
        except _NO_ANSWER as exc:
            self._down(exc)
            self.core.batch_failed(batch, loop.time())
            return
        except ResponseError as exc:  # the whole call refused (e.g. OOM, BUSY): the core classifies it
            self.core.batch_done(batch, BatchOutcome((), str(exc)), loop.time())
            return
        except asyncio.CancelledError:
            self.core.batch_failed(batch, loop.time())
            raise
        except Exception as exc:  # an unexpected client error: keep the records, retry with backoff
            logger.exception("sink: Redis batch failed")
            self._down(exc)
            self.core.batch_failed(batch, loop.time())
            return
        self._request_done(loop.time() - t0)
        self.core.batch_done(batch, parse_outcome(reply, len(batch.records)), loop.time())

    async def _probe(self, loop: asyncio.AbstractEventLoop) -> None:
        t0 = loop.time()
        try:
            ok = bool(await self.client.ping())
        except (RedisError, OSError) as exc:
            self._down(exc)
            ok = False
        if ok:
            self._request_done(loop.time() - t0)
        self.core.probe_done(ok, loop.time())

    def _request_done(self, seconds: float) -> None:
        if self._warned_down:
            logger.info("Redis is back: %d events to send", self.core.buffered)
            self._warned_down = False
        if self._hooks is not None:
            self._hooks.request(seconds)

    def _down(self, exc: BaseException) -> None:
        if not self._warned_down:
            logger.warning("Redis unreachable (%s): buffering events, durable ones to the spool", exc)
            self._warned_down = True

    def _report_degraded(self) -> None:
        degraded = self.core.degraded
        if degraded != self._degraded:
            self._degraded = degraded
            logger.warning(
                "sink %s", "degraded: Redis down beyond the memory buffer" if degraded else "recovered"
            )
            if self._on_degraded is not None:
                self._on_degraded(degraded)
