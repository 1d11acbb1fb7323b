"""Scale-out: Kamailio's dispatcher (ops/kamailio/kamailio.cfg, as shipped) in front of two `ttg serve`
sharing one Redis. sipp calls through the proxy with a scenario that follows the route set
(ops/pbx/sipp/speech_call.xml): every call gives its finals, calls spread over both gateways; when one
gateway drains (SIGTERM), the proxy's OPTIONS probes get 503, new calls go to the other, none fails."""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gateway.sink.audit import audit, read_stream
from tests.e2e.conftest import REPO, STREAM, Serve, Speech, until
from tests.e2e.peers import Kamailio
from tests.fixtures.telephony import SippResult, run_sipp
from tools.ports import port_block

pytestmark = [pytest.mark.sipp, pytest.mark.redis, pytest.mark.slow]

SCENARIO = REPO / "ops" / "pbx" / "sipp" / "speech_call.xml"


def started_calls(gw: Serve) -> list[str]:
    return re.findall(r"call (\w+) started:", gw.log())


def speech_calls(
    port: int, speech: Speech, workdir: Path, *, calls: int, rate: float, hold_ms: int = 500
) -> SippResult:
    """ops/pbx/sipp/speech_call.xml against 127.0.0.1:`port` (the proxy, or a gateway directly); each
    call lasts the speech plus `hold_ms`."""
    workdir.mkdir(parents=True, exist_ok=True)
    shutil.copy(speech.path, workdir / "speech.ulaw")  # the scenario streams ./speech.ulaw
    ports = port_block(8 + 4 * calls)
    return run_sipp(
        SCENARIO, port, workdir, calls=calls, rate=rate, local_port=ports + 1, media_port=ports + 4,
        timeout_s=speech.ms / 1000 + 40, extra=("-d", str(speech.ms + hold_ms), "-key", "lang", "en-US"),
    )  # fmt: skip


@pytest.fixture
def kamailio(tmp_path: Path) -> Iterator[Callable[[list[int]], Kamailio]]:
    made: list[Kamailio] = []

    def make(gateways: list[int]) -> Kamailio:
        k = Kamailio(tmp_path, gateways, probe_interval_s=1)
        made.append(k)
        return k.start()

    yield make
    for k in made:
        k.stop()


# Two gateways of several processes each: run in the multi-process model only (the shipping default on
# machines of 4 cores or more; SIP, where this is decided, is the same code in both models).
@pytest.mark.parametrize("serve", ["media_workers"], indirect=True)
async def test_six_calls_through_the_dispatcher_spread_over_two_gateways_and_survive_a_drain(
    serve: Callable[..., Serve],
    kamailio: Callable[[list[int]], Kamailio],
    tiny_bundle: Path,
    redis_url: str,
    short_speech: Speech,
    tmp_path: Path,
) -> None:
    env = {"TTG_DAEMON__SHUTDOWN_GRACE_S": "30"}
    a, b = (serve(bundle=tiny_bundle, redis_url=redis_url, env=env) for _ in range(2))
    await asyncio.gather(asyncio.to_thread(a.start), asyncio.to_thread(b.start))
    proxy = await asyncio.to_thread(kamailio, [a.sip_port, b.sip_port])

    def probed() -> bool:
        return all(gw.metric("ttg_sip_responses_total", code="200") >= 1 for gw in (a, b))

    await until(probed, "OPTIONS probes answered 200 by both gateways", timeout_s=20, detail=proxy.log)

    # 1. Six calls: every one answered, streamed, hung up through the proxy; both gateways take some.
    result = await asyncio.to_thread(speech_calls, proxy.port, short_speech, tmp_path / "p1", calls=6, rate=3)
    assert result.stats.get("SuccessfulCall(C)") == 6, result.stderr + result.errors

    def ends(n: int) -> Callable[[], bool]:
        return lambda: sum(f["type"] == "call_end" for _, f in read_stream(redis_url, STREAM)) >= n

    await until(ends(6), "6 call_end events in Redis", timeout_s=60)
    report = audit(read_stream(redis_url, STREAM))
    assert not report.problems, report.problems
    assert len(report.calls) == 6
    for events in report.calls.values():
        assert any(e["type"] == "final" for e in events)
        assert events[-1]["reason"] == "bye"  # the caller's BYE reached the gateway through the proxy
    assert len(started_calls(a)) >= 1 and len(started_calls(b)) >= 1
    assert len(started_calls(a)) + len(started_calls(b)) == 6

    # 2. Gateway A drains while calls go on: its probes get 503, new calls all go to B, none fails.
    calls_on_a = len(started_calls(a))
    # Calls of ~6 s: A is still draining its call when the next probes come (1 s apart).
    batch = asyncio.create_task(
        asyncio.to_thread(
            speech_calls, proxy.port, short_speech, tmp_path / "p2", calls=8, rate=2, hold_ms=4000
        )
    )
    await until(lambda: a.metric("ttg_active_calls") >= 1, "a call on gateway A", timeout_s=30)
    a.signal(signal.SIGTERM)
    await until(lambda: "shutting down gracefully" in a.log(), "A draining", timeout_s=10)
    calls_on_a_at_drain = len(started_calls(a))
    probes_503 = 0.0

    def a_refuses_probes() -> bool:
        nonlocal probes_503  # 503s that were not INVITEs refused for draining: OPTIONS probes
        refused_invites = a.metric("ttg_calls_total", result="rejected_draining")
        probes_503 = a.metric("ttg_sip_responses_total", code="503") - refused_invites
        return probes_503 >= 1

    await until(a_refuses_probes, "an OPTIONS probe answered 503 by draining A", timeout_s=15)
    second = await batch
    assert second.stats.get("SuccessfulCall(C)") == 8, second.stderr + second.errors
    assert await asyncio.to_thread(a.wait, 60) == 0
    assert len(started_calls(a)) == calls_on_a_at_drain > calls_on_a  # nothing new after SIGTERM
    await until(ends(14), "14 call_end events in Redis", timeout_s=60)
    report = audit(read_stream(redis_url, STREAM))
    assert not report.problems, report.problems
    assert len(report.calls) == 14
    assert all(events[-1]["reason"] == "bye" for events in report.calls.values())
    assert all(any(e["type"] == "final" for e in events) for events in report.calls.values())


async def test_the_route_set_following_scenario_works_without_a_proxy_too(
    serve: Callable[..., Serve], tiny_bundle: Path, redis_url: str, short_speech: Speech, tmp_path: Path
) -> None:
    """No Record-Route: [routes] is empty and [next_url] is the gateway's Contact (the README's call)."""
    gw = serve(bundle=tiny_bundle, redis_url=redis_url)
    await asyncio.to_thread(gw.start)
    result = await asyncio.to_thread(speech_calls, gw.sip_port, short_speech, tmp_path / "d", calls=2, rate=2)
    assert result.stats.get("SuccessfulCall(C)") == 2, result.stderr + result.errors
    await until(lambda: gw.metric("ttg_calls_total", result="admitted") == 2, "2 calls admitted")
    assert gw.metric("ttg_sip_errors_total", reason="malformed") == 0
