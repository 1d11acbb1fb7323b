"""Issue 5, acceptances 2 and 3, through the daemon: while calls go through `ttg serve`, its live
/metrics passes `promtool check metrics`, and Debian's prometheus scraping it answers every dashboard
panel's PromQL (and every recording rule and alert query) with data. The Prometheus half is the sink
helper's live test (tests/ops/test_prometheus_live.py) pointed at the daemon via TTG_TEST_METRICS_TARGET,
so the two always check the same queries."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

import tests.ops.test_prometheus_live as live
from asr_core.accelerator import this_process
from tests.e2e.conftest import SIPP_DATA, Serve, Speech, sipp_calls, until
from tests.fixtures import peers

pytestmark = [pytest.mark.sipp, pytest.mark.redis, pytest.mark.slow]


async def test_live_metrics_of_the_daemon_feed_every_dashboard_panel(
    serve: Callable[..., Serve],
    tiny_bundle: Path,
    redis_url: str,
    short_speech: Speech,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    peers.tool("prometheus"), peers.tool("promtool")
    gw = serve(bundle=tiny_bundle, redis_url=redis_url)
    await asyncio.to_thread(gw.start)
    # Calls all through the check: two at a time, a new one each second, each ending with a BYE (so the
    # per-call histograms, e.g. RTP jitter at hang-up, move too).
    callers = asyncio.create_task(
        asyncio.to_thread(
            sipp_calls, gw.sip_port, SIPP_DATA / "uac_stream.xml", tmp_path / "sipp", speech=short_speech,
            calls=10, limit=2, rate=1, hold_ms=short_speech.ms + 1200, timeout_s=90,
        )
    )  # fmt: skip
    try:
        await until(
            lambda: (
                gw.metric("ttg_rtp_jitter_seconds_count") >= 1
                and gw.metric("ttg_transcript_latency_seconds_count", type="final") >= 1
            ),
            "a call ended with a final",
            timeout_s=40,
        )
        status, text = gw.http("/metrics")
        assert status == 200
        # Which device the engines run on, as MLX in this (test) process sees this machine.
        assert gw.metric("ttg_build_info", device=this_process().kind) == 1
        check = subprocess.run(
            ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
        )
        assert check.returncode == 0, check.stdout + check.stderr

        monkeypatch.setenv(live.TARGET_ENV, f"127.0.0.1:{gw.http_port}")
        await live.test_every_dashboard_panel_and_rule_query_returns_data(redis_url, tmp_path / "prom")
    finally:
        result = await callers
    assert result.stats.get("FailedCall(C)") == 0, result.stderr + result.errors
    assert gw.stop() == 0
