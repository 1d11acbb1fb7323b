"""Acceptance 3: Debian's prometheus scrapes a live /metrics; the PromQL of every dashboard panel, every
recording rule and every alert (without its threshold) parses and returns data.

Without settings it scrapes our own HTTP server while our components work (the sink publishing
through a real Redis, the engine hooks fed, SIP/RTP counters moving). To check a running gateway
with a call in progress instead:  TTG_TEST_METRICS_TARGET=127.0.0.1:9108 pytest tests/ops -k live
"""

from __future__ import annotations

import asyncio
import math
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.http import HttpServer, Readiness
from gateway.metrics import init_metrics
from gateway.sink import ClientConfig, RedisSink, SinkConfig, StreamLayout

from .activity import drive
from .prometheus import PrometheusServer
from .queries import RULE_FILES, Query, dashboard_queries, grafana_to_promql, recorded_series, rule_queries

pytestmark = [pytest.mark.redis, pytest.mark.slow]

TARGET_ENV = "TTG_TEST_METRICS_TARGET"


async def query(session: aiohttp.ClientSession, prom: PrometheusServer, expr: str) -> dict[str, Any]:
    async with session.get(prom.query_url(expr)) as r:
        body: dict[str, Any] = await r.json()
        return body


def finite(result: list[dict[str, Any]]) -> bool:
    return any(not math.isnan(float(s["value"][1])) for s in result)


async def test_every_dashboard_panel_and_rule_query_returns_data(redis_url: str, tmp_path: Path) -> None:
    target = os.environ.get(TARGET_ENV)
    stop = asyncio.Event()
    driver: asyncio.Task[int] | None = None
    http: HttpServer | None = None
    sink: RedisSink | None = None
    if target is None:
        init_metrics(model="prometheus-test")
        sink = RedisSink.create(
            spool_dir=str(tmp_path / "spool"),
            layout=StreamLayout(),
            client_cfg=ClientConfig(redis_url),
            sink_cfg=SinkConfig(),
        )
        await sink.start()
        http = HttpServer(Readiness(model_loaded=True), host="127.0.0.1", port=0)
        await http.start()
        target = f"127.0.0.1:{http.port}"
        driver = asyncio.create_task(drive(sink, stop))
    prom = PrometheusServer(tmp_path / "prometheus", target, RULE_FILES)
    await asyncio.to_thread(prom.start)
    try:
        async with aiohttp.ClientSession() as session:
            # Enough scrapes for rate() over the panels' window, and the rules evaluated on them.
            for _ in range(300):
                up = await query(session, prom, 'count_over_time(up{job="ttg"}[1m]) >= 5')
                if up["data"]["result"]:
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail(f"prometheus never scraped {target}: {prom.log_tail()}")
            await asyncio.sleep(1.5)  # one more rule evaluation over the latest scrapes

            queries = [Query(q.where, grafana_to_promql(q.expr)) for q in dashboard_queries()]
            queries += rule_queries()
            queries += [Query(f"recorded series {name}", name) for name in recorded_series()]
            queries.append(Query("variable instance", "group by (instance) (ttg_build_info)"))
            assert len(queries) >= 60
            failures = []
            for q in queries:
                res = await query(session, prom, q.expr)
                if res.get("status") != "success":
                    failures.append(f"{q.where}: {res.get('error')}  [{q.expr}]")
                elif not res["data"]["result"]:
                    failures.append(f"{q.where}: no data  [{q.expr}]")
                elif not finite(res["data"]["result"]):
                    failures.append(f"{q.where}: only NaN  [{q.expr}]")
            assert not failures, "\n".join(failures)
    finally:
        stop.set()
        if driver is not None:
            await driver
        await asyncio.to_thread(prom.stop)
        if http is not None:
            await http.stop()
        if sink is not None:
            await sink.close()
