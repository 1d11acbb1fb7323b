"""Acceptance 1 at the sink level: calls keep talking while redis-server is stopped for seconds and
restarted (and, once, while the gateway itself restarts during the outage). Afterwards every final
is in the stream exactly once, seq is gapless per call+leg, and every call has its call_end."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from prometheus_client import REGISTRY

from gateway.sink import RedisSink
from gateway.sink.audit import audit, read_stream
from tests.fixtures.redis import RedisServer

from .conftest import SinkFactory
from .synthetic import CallLog, synthetic_call, wait_until

pytestmark = [pytest.mark.redis, pytest.mark.slow]

STREAM = "ttg:transcripts"
OUTAGE_S = 3.0


def check(url: str, logs: list[CallLog]) -> None:
    report = audit(read_stream(url, STREAM), ended=[log.call_id for log in logs])
    assert not report.problems, report.problems
    finals = report.texts("final")
    expected = Counter(text for log in logs for text in log.finals)
    assert finals == expected  # every final exactly once (and nothing invented)
    assert report.counts["dtmf"] == sum(log.n_dtmf for log in logs)
    assert report.counts["call_start"] == report.counts["call_end"] == len(logs)


def published() -> float:
    return sum(
        REGISTRY.get_sample_value("ttg_events_published_total", {"type": t}) or 0.0
        for t in ("call_start", "partial", "final", "dtmf", "call_end")
    )


def dropped(type: str) -> float:
    return sum(
        REGISTRY.get_sample_value("ttg_events_dropped_total", {"type": type, "reason": r}) or 0.0
        for r in ("buffer_full", "redis_down", "shutdown", "spool_full", "rejected", "invalid")
    )


async def test_a_redis_outage_loses_and_duplicates_no_final(
    redis_private: RedisServer, make_sink: SinkFactory
) -> None:
    # A small memory buffer and a short spill delay, so that both the memory path and the spool are used.
    sink = make_sink(redis_private.url, max_buffered=150, spill_after_s=0.5, batch_max=64)
    await sink.start()
    finals_dropped_before, published_before = dropped("final"), published()
    stop = asyncio.Event()
    calls = [asyncio.create_task(synthetic_call(sink, f"out-{i}", stop=stop, pace_s=0.02)) for i in range(8)]
    await asyncio.sleep(1.0)
    redis_private.stop()
    await wait_until(lambda: sink.degraded, what="the sink to report degraded")
    await asyncio.sleep(OUTAGE_S)
    assert sink.core.spool.pending > 0
    redis_private.start()
    await asyncio.sleep(1.0)
    stop.set()
    logs = await asyncio.gather(*calls)
    await wait_until(lambda: sink.core.idle, what="everything sent")
    assert not sink.degraded
    assert sum(len(log.finals) for log in logs) > 100
    check(redis_private.url, logs)
    assert dropped("final") == finals_dropped_before
    # The metrics tell the truth: every entry in the stream counted once as published, nothing waiting.
    n_entries = len(read_stream(redis_private.url, STREAM))
    assert published() - published_before == n_entries
    assert REGISTRY.get_sample_value("ttg_events_buffered") == 0
    assert REGISTRY.get_sample_value("ttg_redis_up") == 1


async def test_a_gateway_restart_during_the_outage_replays_the_spool_on_start(
    redis_private: RedisServer, make_sink: SinkFactory
) -> None:
    current: list[RedisSink] = [make_sink(redis_private.url, spill_after_s=0.3)]
    await current[0].start()
    stop_first = asyncio.Event()
    first_calls = [
        asyncio.create_task(
            synthetic_call(lambda: current[0], f"first-{i}", stop=stop_first, end_reason="shutdown")
        )
        for i in range(4)
    ]
    await asyncio.sleep(0.8)
    redis_private.stop()
    await asyncio.sleep(1.0)
    # The gateway shuts down during the outage: its calls end (call_end reason=shutdown), the sink spools.
    stop_first.set()
    logs = list(await asyncio.gather(*first_calls))
    await current[0].close(timeout_s=1.0)
    spooled = current[0].core.spool.pending
    assert spooled > 0
    # ... and starts again, still without Redis, reading the spool; new calls arrive.
    current[0] = make_sink(redis_private.url, spill_after_s=0.3)
    assert current[0].core.spool.pending == spooled
    await current[0].start()
    stop_second = asyncio.Event()
    second_calls = [
        asyncio.create_task(synthetic_call(current[0], f"second-{i}", stop=stop_second)) for i in range(4)
    ]
    await asyncio.sleep(1.5)
    redis_private.start()
    await asyncio.sleep(0.8)
    stop_second.set()
    logs += await asyncio.gather(*second_calls)
    await wait_until(lambda: current[0].core.idle, what="spool and memory replayed")
    check(redis_private.url, logs)
