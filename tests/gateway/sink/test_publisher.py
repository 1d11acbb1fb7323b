"""The asyncio publisher against a real redis-server: publish, outages, restarts, lost replies."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from pathlib import Path

import pytest
import redis
from prometheus_client import REGISTRY

from gateway.events import CallEvent
from gateway.sink import StreamLayout
from gateway.sink.audit import audit, read_stream
from tests.fixtures.redis import RedisServer

from .conftest import SinkFactory
from .synthetic import wait_until

pytestmark = pytest.mark.redis

STREAM = "ttg:transcripts"


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def call_events(call: str, n_finals: int = 3) -> list[CallEvent]:
    evs = [CallEvent("call_start", call, f"{call}@sip", ts=1.0)]
    for seg in range(n_finals):
        evs.append(CallEvent("partial", call, f"{call}@sip", segment_id=seg, text="…", ts=1.0))
        evs.append(
            CallEvent("final", call, f"{call}@sip", segment_id=seg, text=f"{call} final {seg}", ts=1.0)
        )
    evs.append(CallEvent("call_end", call, f"{call}@sip", ts=1.0, extra={"reason": "bye"}))
    return evs


async def test_published_events_reach_the_stream_and_the_metrics_say_so(
    redis_url: str, make_sink: SinkFactory
) -> None:
    before = metric("ttg_events_published_total", type="final")
    sink = make_sink(redis_url)
    await sink.start()
    for e in call_events("a"):
        sink.publish(e)
    await wait_until(lambda: sink.core.idle, what="sink idle")
    report = audit(read_stream(redis_url, STREAM), ended=["a"])
    assert not report.problems
    assert report.finals("a") == ["a final 0", "a final 1", "a final 2"]
    assert metric("ttg_events_published_total", type="final") - before == 3
    assert metric("ttg_redis_up") == 1 and metric("ttg_events_buffered") == 0


async def test_an_event_without_ts_is_stamped_with_the_wall_clock(
    redis_url: str, make_sink: SinkFactory
) -> None:
    sink = make_sink(redis_url)
    await sink.start()
    sink.publish(CallEvent("call_start", "t", "t@sip"))
    await wait_until(lambda: sink.core.idle)
    ((_, fields),) = read_stream(redis_url, STREAM)
    assert float(fields["ts"]) > 1e9


async def test_redis_down_at_start_spools_then_replays_in_order_when_it_comes_up(
    redis_private: RedisServer, make_sink: SinkFactory
) -> None:
    redis_private.stop()
    states: list[bool] = []
    sink = make_sink(redis_private.url, spill_after_s=0.2)
    sink._on_degraded = states.append
    await sink.start()
    for e in call_events("b", 5):
        sink.publish(e)
    await wait_until(lambda: sink.core.spool.pending == 7, what="durables spooled")  # 5 finals + start/end
    assert sink.degraded and states == [True]
    assert metric("ttg_redis_up") == 0 and metric("ttg_events_buffered") == 7
    redis_private.start()
    await wait_until(lambda: sink.core.idle, what="replayed")
    assert states == [True, False]
    report = audit(read_stream(redis_private.url, STREAM), ended=["b"])
    assert not report.problems and len(report.finals("b")) == 5
    assert report.counts["partial"] == 0  # stale partials were dropped, not replayed


async def test_close_with_redis_down_spools_everything_and_the_next_start_replays_it(
    redis_private: RedisServer, make_sink: SinkFactory
) -> None:
    redis_private.stop()
    first = make_sink(redis_private.url, spill_after_s=60)
    await first.start()
    for e in call_events("c", 2):
        first.publish(e)
    await first.close(timeout_s=0.5)
    assert first.core.spool.pending == 4
    redis_private.start()
    second = make_sink(redis_private.url)
    await second.start()
    await wait_until(lambda: second.core.idle, what="replayed after restart")
    report = audit(read_stream(redis_private.url, STREAM), ended=["c"])
    assert not report.problems and report.finals("c") == ["c final 0", "c final 1"]


async def test_a_crash_after_xadd_before_the_spool_cursor_moved_does_not_duplicate(
    redis_private: RedisServer, make_sink: SinkFactory, tmp_path: Path
) -> None:
    redis_private.stop()
    first = make_sink(redis_private.url, spool="a", spill_after_s=0.0)
    await first.start()
    for e in call_events("d", 3):
        first.publish(e)
    await wait_until(lambda: first.core.spool.pending == 5)
    await first.close(timeout_s=0.2)
    # The spool as it is on disk before the replay moves the cursor: what a gateway that crashed right
    # after its XADDs would find on its next start.
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    redis_private.start()
    replayer = make_sink(redis_private.url, spool="a")
    await replayer.start()
    await wait_until(lambda: replayer.core.idle)
    dup_before = metric("ttg_events_duplicates_total", type="final")
    restarted = make_sink(redis_private.url, spool="b")
    await restarted.start()
    await wait_until(lambda: restarted.core.idle)
    assert metric("ttg_events_duplicates_total", type="final") - dup_before == 3
    report = audit(read_stream(redis_private.url, STREAM), ended=["d"])
    assert not report.problems and len(report.finals("d")) == 3


class ReplyDropper:
    """A TCP proxy in front of Redis that forwards the first script call (EVALSHA) whose reply is not
    NOSCRIPT, then cuts the connection instead of passing the reply on: a lost reply."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.dropped = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _client(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        armed = False

        async def up() -> None:
            nonlocal armed
            while data := await cr.read(65536):
                armed = armed or (b"EVALSHA" in data.upper() and self.dropped == 0)
                uw.write(data)
                await uw.drain()

        async def down() -> None:
            nonlocal armed
            while data := await ur.read(65536):
                if armed and not data.startswith(b"-NOSCRIPT"):
                    self.dropped += 1
                    cw.close()  # the reply never reaches the client
                    return
                armed = False
                cw.write(data)
                await cw.drain()

        tasks = [asyncio.create_task(up()), asyncio.create_task(down())]
        with contextlib.suppress(Exception):
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()
        cw.close()
        uw.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()


async def test_a_lost_reply_is_retried_by_redis_py_and_nothing_is_stored_twice(
    redis_server: RedisServer, redis_url: str, make_sink: SinkFactory
) -> None:
    proxy = ReplyDropper(redis_server.port)
    port = await proxy.start()
    dup_before = metric("ttg_events_duplicates_total", type="final")
    sink = make_sink(f"redis://127.0.0.1:{port}/0")
    await sink.start()
    for e in call_events("e", 3):
        sink.publish(e)
    await wait_until(lambda: sink.core.idle and proxy.dropped == 1, what="delivered despite the lost reply")
    await proxy.close()
    report = audit(read_stream(redis_url, STREAM), ended=["e"])
    assert not report.problems and len(report.finals("e")) == 3
    assert (
        metric("ttg_events_duplicates_total", type="final") - dup_before >= 1
    )  # the retry found them stored


async def test_per_call_streams_and_the_calls_index_are_written_when_enabled(
    redis_url: str, make_sink: SinkFactory
) -> None:
    layout = StreamLayout(per_call_ttl_s=300)
    sink = make_sink(redis_url, layout=layout)
    await sink.start()
    for e in call_events("f", 1):
        sink.publish(e)
    await wait_until(lambda: sink.core.idle)
    with redis.Redis.from_url(redis_url, decode_responses=True) as r:
        assert [eid for eid, _ in r.xrange(layout.call_stream("f", "caller"))] == ["1-0", "2-0", "3-0", "4-0"]
        assert [f["type"] for _, f in r.xrange(layout.calls_stream)] == ["call_start", "call_end"]


async def test_publish_after_close_still_keeps_durable_events_in_the_spool(
    redis_url: str, make_sink: SinkFactory
) -> None:
    sink = make_sink(redis_url)
    await sink.start()
    await sink.close()
    spool_dir = sink.core.spool.dir
    sink.publish(CallEvent("call_end", "g", "g@sip", ts=1.0))  # a straggler after shutdown: must not raise
    assert (spool_dir / "events.spool").exists()
