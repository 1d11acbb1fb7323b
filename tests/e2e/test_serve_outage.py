"""Issue 5, acceptance 1, through the daemon: calls produce finals while redis-server is stopped for
several seconds and then restarted — once with the same gateway throughout, once with the gateway
restarted during the outage (the second process replays the first one's spool). Afterwards every
final the engine produced is in the stream exactly once, `seq` is gapless per call, call_end is there
(gateway.sink.audit checks the stream's promises)."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.sink.audit import AuditReport, audit, read_stream
from tests.e2e.conftest import DATA, SIPP_DATA, STREAM, Serve, Speech, sipp_calls, until
from tests.fixtures.redis import RedisServer
from tests.fixtures.telephony import SippResult

pytestmark = [pytest.mark.sipp, pytest.mark.redis, pytest.mark.slow]
CALLS = 3
OUTAGE_S = 4.0  # longer than TTG_SINK__SPILL_AFTER_S (2 s): durable events go through the spool


def finals_made(gw: Serve) -> float:
    """Finals the engine has produced so far (one latency observation per final)."""
    return gw.metric("ttg_transcript_latency_seconds_count", type="final")


def check_stream(url: str, n_calls: int) -> AuditReport:
    entries = read_stream(url, STREAM)
    starts = [f["call_id"] for _, f in entries if f["type"] == "call_start"]
    assert len(starts) == n_calls
    report = audit(entries, ended=starts)
    assert not report.problems, report.problems  # seq gapless, no event twice, call_end last
    for call_id in starts:
        segments = [int(f["segment_id"]) for f in report.calls[(call_id, "caller")] if f["type"] == "final"]
        assert segments == list(range(len(segments))), f"{call_id}: finals of segments {segments}"
    return report


def finals_in_outage(report: AuditReport, t0: float, t1: float) -> int:
    return sum(
        1 for evs in report.calls.values() for f in evs if f["type"] == "final" and t0 <= float(f["ts"]) <= t1
    )


def stream_calls(
    gw: Serve, scenario: Path, workdir: Path, speech: Speech, **kw: Any
) -> asyncio.Task[SippResult]:
    """CALLS callers streaming `speech` (in a thread: sipp blocks), as a task to await later."""
    return asyncio.create_task(
        asyncio.to_thread(
            sipp_calls, gw.sip_port, scenario, workdir, speech=speech, calls=CALLS, rate=20, **kw
        )
    )


async def test_finals_made_while_redis_is_down_arrive_exactly_once_after_it_is_back(
    serve: Callable[..., Serve], tiny_bundle: Path, redis_private: RedisServer, two_sentences: Speech,
    tmp_path: Path,
) -> None:  # fmt: skip
    url = redis_private.url
    gw = serve(bundle=tiny_bundle, redis_url=url)
    await asyncio.to_thread(gw.start)
    callers = stream_calls(
        gw, SIPP_DATA / "uac_stream.xml", tmp_path / "sipp", two_sentences,
        hold_ms=two_sentences.ms + 1000, timeout_s=60,
    )  # fmt: skip
    await until(lambda: gw.metric("ttg_active_calls") == CALLS, f"{CALLS} calls up", timeout_s=30)
    before = finals_made(gw)
    await asyncio.to_thread(redis_private.stop)
    down_at = time.time()
    await until(lambda: finals_made(gw) >= before + CALLS, "a final per call during the outage", timeout_s=30)
    await asyncio.sleep(max(0.0, OUTAGE_S - (time.time() - down_at)))  # keep it down for several seconds
    assert gw.metric("ttg_redis_up") == 0
    assert gw.readyz()[0] == 503  # down beyond the memory buffer: events are being spooled
    up_at = time.time()
    await asyncio.to_thread(redis_private.start)

    result = await callers
    assert result.stats.get("SuccessfulCall(C)") == CALLS, result.stderr + result.errors
    await until(lambda: gw.metric("ttg_active_calls") == 0, "calls ended", timeout_s=30)
    await until(lambda: gw.metric("ttg_events_buffered") == 0, "the backlog sent", timeout_s=30)
    report = check_stream(url, CALLS)
    # Every final this gateway's engine produced (since its start) is in the stream, once.
    assert report.counts["final"] == finals_made(gw)
    assert finals_in_outage(report, down_at, up_at) >= CALLS
    assert gw.metric("ttg_events_spooled_total", type="final") >= 1
    assert gw.metric("ttg_events_dropped_total", type="final", reason="redis_down") == 0
    assert gw.readyz()[0] == 200
    assert gw.stop() == 0


async def test_a_gateway_restarted_during_the_outage_delivers_the_first_ones_finals_exactly_once(
    serve: Callable[..., Serve], tiny_bundle: Path, redis_private: RedisServer, two_sentences: Speech,
    tmp_path: Path,
) -> None:  # fmt: skip
    url = redis_private.url
    spool = tmp_path / "spool"
    first = serve(
        bundle=tiny_bundle, redis_url=url, spool_dir=spool, env={"TTG_DAEMON__SHUTDOWN_GRACE_S": "0.5"}
    )
    await asyncio.to_thread(first.start)
    callers = stream_calls(
        first, DATA / "uac_stream_until_bye.xml", tmp_path / "sipp", two_sentences, loops=-1, timeout_s=60
    )
    await until(lambda: first.metric("ttg_active_calls") == CALLS, f"{CALLS} calls up", timeout_s=30)
    before = finals_made(first)
    await asyncio.to_thread(redis_private.stop)
    down_at = time.time()
    await until(
        lambda: finals_made(first) >= before + CALLS, "a final per call during the outage", timeout_s=30
    )

    # The gateway restarts while Redis is down: it hangs the calls up, their last finals and call_end
    # go to the spool with the rest, and it exits cleanly.
    first.signal(signal.SIGTERM)
    assert await asyncio.to_thread(first.wait, 60) == 0, first.log_tail()
    result = await callers
    assert result.stats.get("SuccessfulCall(C)") == CALLS, result.stderr + result.errors
    made = [int(n) for n in re.findall(r" ended: shutdown after .*?, (\d+) finals,", first.log())]
    assert len(made) == CALLS  # one end line per call with its count of finals

    second = serve(bundle=tiny_bundle, redis_url=url, spool_dir=spool)
    await asyncio.to_thread(second.start, wait="loaded")  # Redis still down: not ready, but serving
    await asyncio.sleep(max(0.0, OUTAGE_S - (time.time() - down_at)))
    up_at = time.time()
    await asyncio.to_thread(redis_private.start)
    await until(lambda: second.readyz()[0] == 200, "the second gateway ready", timeout_s=30)
    await until(lambda: second.metric("ttg_events_buffered") == 0, "the spool replayed", timeout_s=30)

    report = check_stream(url, CALLS)
    assert report.counts["final"] == sum(made)
    assert sorted(len(report.finals(cid)) for cid, _ in report.calls) == sorted(made)
    assert finals_in_outage(report, down_at, up_at) >= CALLS
    assert all(evs[-1]["reason"] == "shutdown" for evs in report.calls.values())
    assert second.stop() == 0
