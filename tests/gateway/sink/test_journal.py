"""The crash journal: every call_start gets its call_end, also when the process died mid-call; and a
restart that replays a spool with Redis up is never reported as degraded."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gateway.events import CallEvent
from gateway.sink.audit import audit, read_stream
from gateway.sink.journal import JOURNAL_FILE, CallJournal
from tests.fixtures.redis import RedisServer

from .conftest import SinkFactory
from .synthetic import wait_until

pytestmark = pytest.mark.redis

STREAM = "ttg:transcripts"


def started(call: str, ts: float = 100.0) -> list[CallEvent]:
    return [
        CallEvent("call_start", call, f"{call}@sip", lang="en-US", ts=ts),
        CallEvent("final", call, f"{call}@sip", segment_id=0, text="hello", lang="en-US", ts=ts + 4.5),
    ]


def ended(call: str) -> CallEvent:
    return CallEvent("call_end", call, f"{call}@sip", ts=200.0, extra={"reason": "bye"})


async def test_calls_left_live_get_call_end_gateway_restart_on_the_next_start(
    redis_url: str, make_sink: SinkFactory, caplog: pytest.LogCaptureFixture
) -> None:
    first = make_sink(redis_url)
    await first.start()
    for e in [*started("live"), *started("done"), ended("done")]:
        first.publish(e)
    await wait_until(lambda: first.core.idle, what="events in Redis")
    await first.close()  # the process stops while "live" is up: nobody publishes its call_end
    with caplog.at_level(logging.WARNING, logger="gateway.sink.publisher"):
        second = make_sink(redis_url)
    await second.start()
    await wait_until(lambda: second.core.idle, what="the restart's call_end in Redis")
    entries = read_stream(redis_url, STREAM)
    report = audit(entries, ended=["live", "done"])
    assert not report.problems, report.problems
    end = report.calls[("live", "caller")][-1]
    assert (end["type"], end["reason"], end["seq"]) == ("call_end", "gateway_restart", "3")
    assert (end["sip_call_id"], end["lang"], end["duration_ms"]) == ("live@sip", "en-US", "4500")
    assert [e["reason"] for _, e in entries if e["type"] == "call_end"] == ["bye", "gateway_restart"]
    assert any("1 calls were live" in m and "live" in m for m in caplog.messages)
    # Once ended, the journal forgets it: a third start publishes nothing new.
    await second.close(timeout_s=1.0)
    third = make_sink(redis_url)
    await third.start()
    assert third.core.idle and len(read_stream(redis_url, STREAM)) == len(entries)


async def test_a_call_still_in_the_spool_continues_its_seq_after_the_spooled_records(
    redis_private: RedisServer, make_sink: SinkFactory
) -> None:
    redis_private.stop()
    first = make_sink(redis_private.url, spill_after_s=0.1)
    await first.start()
    for e in started("s"):
        first.publish(e)
    await wait_until(lambda: first.core.spool.pending == 2, what="spooled")
    await first.close(timeout_s=0.2)
    redis_private.start()
    second = make_sink(redis_private.url)
    await second.start()
    await wait_until(lambda: second.core.idle, what="replayed")
    report = audit(read_stream(redis_private.url, STREAM), ended=["s"])
    assert not report.problems, report.problems
    assert [(e["type"], e["seq"]) for e in report.calls[("s", "caller")]] == [
        ("call_start", "1"),
        ("final", "2"),
        ("call_end", "3"),
    ]


async def test_replaying_a_spool_with_redis_up_is_never_reported_degraded(
    redis_private: RedisServer, make_sink: SinkFactory, caplog: pytest.LogCaptureFixture
) -> None:
    redis_private.stop()
    first = make_sink(redis_private.url, spill_after_s=60)
    await first.start()
    for e in [*started("r"), ended("r")]:
        first.publish(e)
    await first.close(timeout_s=0.3)
    assert first.core.spool.pending == 3
    redis_private.start()
    states: list[bool] = []
    second = make_sink(redis_private.url)
    second._on_degraded = states.append
    assert not second.degraded
    with caplog.at_level(logging.WARNING, logger="gateway.sink.publisher"):
        await second.start()
        await wait_until(lambda: second.core.idle, what="replayed")
    assert states == [] and not any("degraded" in m for m in caplog.messages)


def test_a_torn_last_line_is_skipped_and_the_file_is_compacted_to_the_live_calls(tmp_path: Path) -> None:
    journal, orphans = CallJournal.open(tmp_path)
    assert orphans == []
    for call in ("a", "b"):
        fields = {"type": "call_start", "call_id": call, "leg": "caller", "seq": "1", "ts": "10.0"}
        journal.committed({**fields, "sip_call_id": f"{call}@sip", "lang": "de-DE"})
    journal.committed({"type": "final", "call_id": "a", "leg": "caller", "seq": "7", "ts": "12.5"})
    journal.committed({"type": "call_end", "call_id": "b", "leg": "caller", "seq": "2", "ts": "13.0"})
    journal.flush()
    with (tmp_path / JOURNAL_FILE).open("ab") as f:
        f.write(b'Q {"call_id": "a", "leg": "caller", "se')  # a crash in the middle of a write
    journal.close()
    again, orphans = CallJournal.open(tmp_path)
    assert [(c.call_id, c.seq, c.lang, c.sip_call_id, c.last_ts) for c in orphans] == [
        ("a", 7, "de-DE", "a@sip", 12.5)
    ]
    lines = (tmp_path / JOURNAL_FILE).read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("S ")
    again.close()


def test_the_journal_stays_small_over_a_long_call_and_keeps_its_last_seq(tmp_path: Path) -> None:
    journal, _ = CallJournal.open(tmp_path)
    base = {"call_id": "long", "leg": "caller", "sip_call_id": "long@sip", "lang": "en-US"}
    journal.committed({**base, "type": "call_start", "seq": "1", "ts": "1.0"})
    for seq in range(2, 5002):  # one flush per batch; here a batch per event
        journal.committed({**base, "type": "partial", "seq": str(seq), "ts": str(seq / 10)})
        journal.flush()
    lines = (tmp_path / JOURNAL_FILE).read_text().splitlines()
    assert len(lines) <= 1001
    journal.close()
    _, (call,) = CallJournal.open(tmp_path)
    assert (call.seq, call.started_ts, call.last_ts) == (5001, 1.0, 500.1)
