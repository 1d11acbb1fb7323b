"""Issue 6, acceptance 4: SIGTERM during 5 live calls → 5 calls hung up with their finals and call_end
events in Redis, and exit status 0; while draining, /readyz is 503 and a new INVITE gets 503."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.sink.audit import AuditReport, audit, read_stream
from tests.e2e.conftest import DATA, SIPP_DATA, STREAM, Serve, Speech, sipp_calls, until
from tests.fixtures.telephony import SippResult, run_sipp

pytestmark = [pytest.mark.sipp, pytest.mark.redis, pytest.mark.slow]


async def test_sigterm_during_five_live_calls_hangs_them_up_with_finals_and_exits_zero(
    serve: Callable[..., Serve], tiny_bundle: Path, redis_url: str, short_speech: Speech, tmp_path: Path
) -> None:
    grace_s = 2.0
    gw = serve(bundle=tiny_bundle, redis_url=redis_url, env={"TTG_DAEMON__SHUTDOWN_GRACE_S": str(grace_s)})
    await asyncio.to_thread(gw.start)
    callers = _talk_until_hung_up(gw, short_speech, tmp_path, calls=5)

    def live() -> bool:
        # Live: every call started and has transcribed something (its audio flows through the engine).
        entries = read_stream(redis_url, STREAM)
        started = {f["call_id"] for _, f in entries if f["type"] == "call_start"}
        talking = {f["call_id"] for _, f in entries if f["type"] in ("partial", "final")}
        return len(started) == 5 and talking == started

    def seen() -> str:
        types = [(f["call_id"][:8], f["type"]) for _, f in read_stream(redis_url, STREAM)]
        return f"events: {types[:60]}\ngateway log:\n{gw.log_tail(40)}"

    await until(live, "5 calls started and transcribing", timeout_s=40, detail=seen)
    assert gw.metric("ttg_active_calls") == 5
    gw.signal(signal.SIGTERM)

    # Draining: not ready, new calls refused with 503 + Retry-After, the five go on for the grace period.
    await until(lambda: gw.readyz()[0] == 503, "/readyz 503 while draining", timeout_s=5, every_s=0.02)
    _, body = gw.readyz()
    assert "draining" in body["reasons"], body
    (tmp_path / "late").mkdir()
    refused = await asyncio.to_thread(
        run_sipp, SIPP_DATA / "uac_expect_503.xml", gw.sip_port, tmp_path / "late", timeout_s=10,
        extra=("-key", "dnis", "1000"),
    )  # fmt: skip
    assert refused.stats.get("SuccessfulCall(C)") == 1, refused.stderr + refused.errors

    code = await asyncio.to_thread(gw.wait, 60)
    assert code == 0, gw.log_tail()
    result = await callers
    # Every caller got the gateway's BYE (Reason: shutdown) and answered it.
    assert result.stats.get("SuccessfulCall(C)") == 5, result.stderr + result.errors

    entries = read_stream(redis_url, STREAM)
    starts = [f["call_id"] for _, f in entries if f["type"] == "call_start"]
    report = audit(entries, ended=starts)
    assert not report.problems, report.problems
    assert report.counts["call_start"] == report.counts["call_end"] == 5
    for call_id in starts:
        events = report.calls[(call_id, "caller")]
        end = events[-1]
        assert (end["reason"], end["asr"]) == ("shutdown", "finished"), end
        finals = [f for f in events if f["type"] == "final"]
        assert finals, f"call {call_id} has no final"
        assert finals[-1]["text"], f"call {call_id}: empty last final"
        assert events[-2]["type"] == "final"  # the final of the last utterance, flushed at hang-up
    log = gw.log()
    assert "SIGTERM: shutting down gracefully" in log
    assert log.count(" ended: shutdown after ") == 5  # one INFO line per call end, with its counters
    assert "stopped in" in log and "exit status 0" in log


async def test_a_second_signal_cuts_the_grace_period_short_and_still_ends_every_call(
    serve: Callable[..., Serve], tiny_bundle: Path, redis_url: str, short_speech: Speech, tmp_path: Path
) -> None:
    gw = serve(bundle=tiny_bundle, redis_url=redis_url, env={"TTG_DAEMON__SHUTDOWN_GRACE_S": "600"})
    await asyncio.to_thread(gw.start)
    callers = _talk_until_hung_up(gw, short_speech, tmp_path, calls=2)
    # Answered and transcribing (a call still being set up when the signal comes is refused, 503).
    await until(lambda: _transcribing(redis_url) == 2, "2 calls transcribing", timeout_s=40)
    gw.signal(signal.SIGTERM)
    await until(
        lambda: "draining: 2 calls may go on" in gw.log(), "draining with a 600 s grace", timeout_s=10
    )
    gw.signal(signal.SIGINT)  # Ctrl-C: do not wait out the grace period
    assert await asyncio.to_thread(gw.wait, 30) == 0, gw.log_tail()
    report = _hung_up_and_audited(await callers, redis_url, calls=2)
    assert [evs[-1]["reason"] for evs in report.calls.values()] == ["shutdown", "shutdown"]
    assert "SIGINT again: hanging up every call now" in gw.log()


async def test_sigterm_to_the_whole_process_group_drains_as_one_to_the_daemon(
    serve: Callable[..., Serve], tiny_bundle: Path, redis_url: str, short_speech: Speech, tmp_path: Path
) -> None:
    """systemd stops a unit by signalling every process of its control group, and Ctrl-C reaches the
    terminal's whole process group: the media workers and the engine process ignore both, so the daemon
    drains its calls, then stops them in order, exactly as when it alone is signalled."""
    gw = serve(bundle=tiny_bundle, redis_url=redis_url, env={"TTG_DAEMON__SHUTDOWN_GRACE_S": "1"})
    await asyncio.to_thread(gw.start)
    callers = _talk_until_hung_up(gw, short_speech, tmp_path, calls=2)
    await until(lambda: _transcribing(redis_url) == 2, "2 calls transcribing", timeout_s=40)
    gw.signal_group(signal.SIGTERM)
    assert await asyncio.to_thread(gw.wait, 60) == 0, gw.log_tail()
    report = _hung_up_and_audited(await callers, redis_url, calls=2)
    for events in report.calls.values():
        assert (events[-1]["reason"], events[-1]["asr"]) == ("shutdown", "finished"), events[-1]
        assert events[-2]["type"] == "final" and events[-2]["text"]
    log = gw.log()
    assert "is gone" not in log and "exited with status" not in log, gw.log_tail(40)


def _transcribing(redis_url: str) -> int:
    """Calls with a partial or a final in the stream: answered, their audio through the engine."""
    entries = read_stream(redis_url, STREAM)
    return len({f["call_id"] for _, f in entries if f["type"] in ("partial", "final")})


def _talk_until_hung_up(gw: Serve, speech: Speech, tmp_path: Path, calls: int) -> asyncio.Task[SippResult]:
    """`calls` sipp callers that keep talking (the file in a loop) until the gateway hangs up."""
    return asyncio.create_task(
        asyncio.to_thread(
            sipp_calls, gw.sip_port, DATA / "uac_stream_until_bye.xml", tmp_path / "callers",
            speech=speech, calls=calls, rate=20, loops=-1, timeout_s=60,
        )
    )  # fmt: skip


def _hung_up_and_audited(callers: SippResult, redis_url: str, calls: int) -> AuditReport:
    """Every caller got the gateway's BYE and answered it; the stream's audit finds nothing wrong."""
    assert callers.stats.get("SuccessfulCall(C)") == calls, callers.stderr + callers.errors
    entries = read_stream(redis_url, STREAM)
    report = audit(entries, ended=[f["call_id"] for _, f in entries if f["type"] == "call_start"])
    assert not report.problems, report.problems
    return report
