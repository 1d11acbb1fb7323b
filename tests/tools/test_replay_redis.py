"""The replay's Redis reader against a real redis-server, with schema-v1 events written the way the
gateway's sink writes them (`gateway.events.to_fields`)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from gateway.events import CallEvent, to_fields
from tests.fixtures.redis import RedisServer
from tools.replay.events import EventReader

pytestmark = pytest.mark.redis
STREAM = "ttg:transcripts"


def xadd(r: redis.Redis, ev: CallEvent, seq: int) -> None:
    r.xadd(STREAM, to_fields(ev, seq))  # type: ignore[arg-type]


def event(type_: str, sip_call_id: str, **kw: object) -> CallEvent:
    return CallEvent(type=type_, call_id="gw-" + sip_call_id, sip_call_id=sip_call_id, **kw)  # type: ignore[arg-type]


async def test_reader_starts_after_the_last_entry_and_keeps_only_this_runs_calls(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    xadd(r, event("final", "mine", text="old run"), 1)  # written before the run: not ours to read
    reader = EventReader(redis_url, STREAM, time.monotonic, block_ms=100)
    await reader.open()
    reader.watch("mine")
    task = asyncio.create_task(reader.run())
    try:
        t0 = time.monotonic()
        xadd(r, event("call_start", "mine"), 1)
        xadd(r, event("call_start", "someone-else"), 1)
        xadd(r, event("partial", "mine", segment_id=0, text="hel", start_ms=100, end_ms=400), 2)
        xadd(r, event("final", "mine", segment_id=0, text="hello", start_ms=100, end_ms=900), 3)
        xadd(r, event("call_end", "mine", extra={"reason": "bye", "rtp_packets": "250"}), 4)
        assert await reader.wait_call_end("mine", 5.0)
    finally:
        await reader.stop(task)
        await reader.close()
        r.close()
    got = reader.events["mine"]
    assert [(e.type, e.seq, e.text) for e in got] == [
        ("call_start", 1, ""),
        ("partial", 2, "hel"),
        ("final", 3, "hello"),
        ("call_end", 4, ""),
    ]
    assert (got[2].segment_id, got[2].start_ms, got[2].end_ms) == (0, 100, 900)
    assert got[3].fields["rtp_packets"] == "250" and got[3].fields["reason"] == "bye"
    assert all(t0 <= e.arrival <= time.monotonic() for e in got)
    # When redis-server stored each entry (its ID's milliseconds), on our clock: after the first XADD
    # was asked for and before the read returned (1 ms slack for the ID's resolution).
    assert all(e.published is not None and t0 - 0.002 <= e.published <= e.arrival + 0.002 for e in got)
    assert reader.entries_read == 5 and reader.foreign == 1


def test_an_entry_id_is_put_on_the_readers_clock_by_the_offset_anchored_at_open() -> None:
    reader = EventReader("redis://127.0.0.1:1/0", STREAM, lambda: 50.0)
    assert reader.published("1700000000123-0") is None  # not anchored: no offset known
    reader.anchor(1_700_000_000.0)  # our clock reads 50.0 when the wall clock reads 1.7e9
    assert reader.published("1700000000123-4") == pytest.approx(50.123)
    assert reader.published("*") is None and reader.published("12x-0") is None


async def test_reader_reads_an_empty_or_missing_stream_from_the_start(redis_url: str) -> None:
    reader = EventReader(redis_url, "no:such:stream", time.monotonic, block_ms=50)
    await reader.open()
    assert reader.last_id == "0-0"
    await reader.close()


async def test_reader_survives_redis_going_away_and_reads_on_after_it_returns(
    redis_private: RedisServer,
) -> None:
    reader = EventReader(redis_private.url, STREAM, time.monotonic, block_ms=100)
    await reader.open()
    reader.watch("c")
    task = asyncio.create_task(reader.run())
    try:
        r = redis_private.client()
        xadd(r, event("call_start", "c"), 1)
        await asyncio.sleep(0.3)
        redis_private.stop()
        await asyncio.sleep(1.0)
        assert reader.errors >= 1 and not task.done()
        redis_private.start()
        r = redis_private.client()
        xadd(r, event("call_end", "c"), 2)
        assert await reader.wait_call_end("c", 10.0)
    finally:
        await reader.stop(task)
        await reader.close()
    assert [e.type for e in reader.events["c"]] == ["call_start", "call_end"]
