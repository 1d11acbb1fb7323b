"""/metrics, /healthz and /readyz served by aiohttp; the exposition passes `promtool check metrics`."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client.metrics import MetricWrapperBase

from gateway import metrics
from gateway.http import HttpServer, Readiness
from gateway.metrics import init_metrics
from tests.fixtures import peers

from .activity import drive_once


@pytest.fixture
async def server() -> AsyncIterator[HttpServer]:
    srv = HttpServer(Readiness(model_loaded=True), host="127.0.0.1", port=0)
    await srv.start()
    yield srv
    await srv.stop()


async def get(url: str, **headers: str) -> tuple[int, str, str]:
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers) as r:
        return r.status, r.headers["Content-Type"], await r.text()


async def test_healthz_answers_while_the_process_runs(server: HttpServer) -> None:
    assert (await get(server.url + "/healthz"))[0] == 200


async def test_readyz_is_503_with_reasons_before_the_model_draining_or_sink_degraded(
    server: HttpServer,
) -> None:
    r = server.readiness
    assert (await get(server.url + "/readyz"))[0] == 200
    r.model_loaded = False
    r.set_sink_degraded(True)
    status, ctype, body = await get(server.url + "/readyz")
    assert status == 503 and ctype.startswith("application/json")
    assert '"ready": false' in body and "model not loaded" in body and "redis down" in body
    r.model_loaded, r.sink_degraded, r.draining = True, False, True
    status, _, body = await get(server.url + "/readyz")
    assert status == 503 and "draining" in body
    r.draining = False
    r.details["active_calls"] = lambda: 3
    status, _, body = await get(server.url + "/readyz")
    assert status == 200 and '"active_calls": 3' in body


async def test_the_http_server_binds_loopback_by_default() -> None:
    assert HttpServer(Readiness()).host == "127.0.0.1"


async def test_live_metrics_pass_promtool_check_metrics_with_every_family_present(server: HttpServer) -> None:
    init_metrics(model="test-model")
    drive_once()
    status, ctype, text = await get(server.url + "/metrics")
    assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ttg_")}
    declared = {v._name for v in vars(metrics).values() if isinstance(v, MetricWrapperBase)}
    assert len(declared) >= 27
    for name in declared:  # every family declared in gateway/metrics.py (counters carry _total)
        assert {name, f"{name}_total", f"{name}_info"} & families, name
    assert "ttg_build_info{" in text and 'model="test-model"' in text
    check = subprocess.run(
        [peers.tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert check.returncode == 0, check.stdout + check.stderr


async def test_metrics_speak_openmetrics_when_the_scraper_asks(server: HttpServer) -> None:
    status, ctype, text = await get(
        server.url + "/metrics", Accept="application/openmetrics-text; version=1.0.0"
    )
    assert status == 200 and ctype.startswith("application/openmetrics-text") and text.endswith("# EOF\n")
