"""The Lua batch script on a real redis-server: at most once per event, in order, exact answers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from gateway.events import to_fields
from gateway.sink.script import LUA_APPLY_BATCH, StreamLayout, batch_call, parse_outcome
from gateway.sink.spool import Record

from .factories import ev

pytestmark = pytest.mark.redis

TEXTS = ["Добрий день, як справи?", "你好，世界。今日は", "👋🏽 emoji — and “quotes”", "plain ascii"]


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        yield client


def records(
    call: str = "c1", kinds: tuple[str, ...] = ("call_start", "final", "final", "call_end")
) -> list[Record]:
    return [
        Record(to_fields(ev(k, call, seg=i, text=TEXTS[i % len(TEXTS)]), i + 1)) for i, k in enumerate(kinds)
    ]


def apply(r: redis.Redis, layout: StreamLayout, recs: list[Record]) -> tuple[tuple[bool, ...], str | None]:
    keys, args = batch_call(layout, recs)
    out = parse_outcome(r.register_script(LUA_APPLY_BATCH)(keys=keys, args=args), len(recs))
    return out.stored, out.error


def test_a_batch_is_stored_in_order_with_every_field_and_utf8_text_intact(r: redis.Redis) -> None:
    layout = StreamLayout()
    recs = records()
    assert apply(r, layout, recs) == ((True,) * 4, None)
    entries = r.xrange(layout.stream)
    assert [fields for _, fields in entries] == [rec.fields for rec in recs]
    assert [f["text"] for _, f in entries][1:3] == TEXTS[1:3]


def test_the_same_batch_sent_again_is_refused_record_by_record(r: redis.Redis) -> None:
    layout = StreamLayout()
    recs = records()
    apply(r, layout, recs[:2])  # the first attempt stored two records; its reply was lost
    assert apply(r, layout, recs) == ((False, False, True, True), None)
    assert [f["seq"] for _, f in r.xrange(layout.stream)] == ["1", "2", "3", "4"]
    assert r.ttl(layout.guard_key("c1", "caller")) > 0  # the guard expires on its own


def test_the_calls_index_gets_only_call_start_and_call_end_with_the_entry_id(r: redis.Redis) -> None:
    layout = StreamLayout()
    apply(r, layout, records())
    index = r.xrange(layout.calls_stream)
    assert [f["type"] for _, f in index] == ["call_start", "call_end"]
    main_ids = [eid for eid, _ in r.xrange(layout.stream)]
    assert [f["entry_id"] for _, f in index] == [main_ids[0], main_ids[-1]]


def test_per_call_streams_use_the_seq_as_explicit_id_and_expire(r: redis.Redis) -> None:
    layout = StreamLayout(per_call_ttl_s=600)
    apply(r, layout, records())
    key = layout.call_stream("c1", "caller")
    assert [eid for eid, _ in r.xrange(key)] == ["1-0", "2-0", "3-0", "4-0"]
    assert [eid for eid, _ in r.xrange(key, "2", "3")] == ["2-0", "3-0"]  # XRANGE by seq
    assert 0 < r.ttl(key) <= 600


def test_an_expired_guard_still_cannot_duplicate_when_per_call_streams_are_on(r: redis.Redis) -> None:
    layout = StreamLayout(per_call_ttl_s=600)
    recs = records()
    apply(r, layout, recs)
    r.delete(layout.guard_key("c1", "caller"))
    assert apply(r, layout, recs) == ((False,) * 4, None)
    assert r.xlen(layout.stream) == 4


def test_an_error_stops_the_batch_at_that_record_and_says_why(r: redis.Redis) -> None:
    layout = StreamLayout()
    r.rpush(layout.guard_key("c2", "caller"), "x")  # a key of the wrong type where c2's guard lives
    batch = records("c1", ("final",)) + records("c2", ("final",)) + records("c3", ("final",))
    stored, error = apply(r, layout, batch)
    assert stored == (True,) and error is not None and error.startswith("WRONGTYPE")
    assert [f["call_id"] for _, f in r.xrange(layout.stream)] == ["c1"]  # c3 was not tried


def test_the_global_stream_is_trimmed_approximately_to_maxlen(r: redis.Redis) -> None:
    layout = StreamLayout(maxlen=100)
    for start in range(0, 1000, 250):
        batch = [Record(to_fields(ev("final", "c1", seg=i), i + 1)) for i in range(start, start + 250)]
        apply(r, layout, batch)
    assert 100 <= r.xlen(layout.stream) < 300  # MAXLEN ~ removes whole nodes (100 entries each)
