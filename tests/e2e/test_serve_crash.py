"""A gateway killed mid-call (SIGKILL: no shutdown code runs) publishes, on its next start from the same
spool directory, the call_end it owed (reason=gateway_restart): every call_start gets its call_end."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.sink.audit import audit, read_stream
from tests.e2e.conftest import SIPP_DATA, STREAM, Serve, Speech, sipp_calls, until

pytestmark = [pytest.mark.sipp, pytest.mark.redis, pytest.mark.slow]


async def test_a_call_live_at_a_crash_gets_its_call_end_when_the_gateway_restarts(
    serve: Callable[..., Serve], tiny_bundle: Path, redis_url: str, two_sentences: Speech, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    first = serve(bundle=tiny_bundle, redis_url=redis_url, spool_dir=spool)
    await asyncio.to_thread(first.start)
    call = asyncio.to_thread(
        sipp_calls, first.sip_port, SIPP_DATA / "uac_stream.xml", tmp_path / "sipp", speech=two_sentences,
        hold_ms=two_sentences.ms + 1000, timeout_s=two_sentences.ms / 1000 + 10,
    )  # fmt: skip
    caller = asyncio.create_task(call)

    def has(kind: str) -> Callable[[], bool]:
        return lambda: any(f["type"] == kind for _, f in read_stream(redis_url, STREAM))

    await until(has("final"), "the call's first final in Redis", timeout_s=60, detail=first.log_tail)
    first.signal(signal.SIGKILL)
    assert await asyncio.to_thread(first.wait, 10) == -signal.SIGKILL
    await caller  # the caller gives up on its BYE; what it reports does not matter here
    assert not has("call_end")()

    second = serve(bundle=tiny_bundle, redis_url=redis_url, spool_dir=spool)
    await asyncio.to_thread(second.start)
    await until(has("call_end"), "the owed call_end in Redis", timeout_s=30, detail=second.log_tail)
    report = audit(read_stream(redis_url, STREAM))
    assert not report.problems, report.problems
    ((call_id, _),) = report.calls
    end = report.calls[(call_id, "caller")][-1]
    assert end["reason"] == "gateway_restart" and int(end["duration_ms"]) > 0
    assert f"publishing their call_end (reason=gateway_restart): {call_id}" in second.log()
