"""The operator's HTTP endpoints (aiohttp), bound to loopback by default (TTG_HTTP__HOST):

- `/metrics`: Prometheus exposition of the default registry (OpenMetrics when the scraper asks);
- `/healthz`: 200 while the process serves requests (liveness: restart me when this fails);
- `/readyz`: 200 when calls should be sent here, else 503; JSON body with the reasons. Not ready
  before the model is loaded, while draining, or while the sink is degraded (Redis down beyond the
  memory buffer: transcripts are only being spooled).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.exposition import choose_encoder

logger = logging.getLogger(__name__)


@dataclass
class Readiness:
    """What /readyz reports; the daemon updates the flags. `details` adds facts to the JSON body."""

    model_loaded: bool = False
    draining: bool = False
    sink_degraded: bool = False
    details: dict[str, Callable[[], object]] = field(default_factory=dict)

    def reasons(self) -> list[str]:
        out = []
        if not self.model_loaded:
            out.append("model not loaded")
        if self.draining:
            out.append("draining")
        if self.sink_degraded:
            out.append("redis down beyond the memory buffer (events are being spooled)")
        return out

    @property
    def ready(self) -> bool:
        return not self.reasons()

    def set_sink_degraded(self, degraded: bool) -> None:
        self.sink_degraded = degraded


def make_app(readiness: Readiness, registry: CollectorRegistry = REGISTRY) -> web.Application:
    async def metrics(request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encoder(registry), headers={"Content-Type": content_type})

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        reasons = readiness.reasons()
        body: dict[str, object] = {"ready": not reasons, "reasons": reasons}
        for name, fn in readiness.details.items():
            try:
                body[name] = fn()
            except Exception as exc:  # a broken detail must not break the probe
                body[name] = f"error: {exc}"
        return web.json_response(body, status=200 if not reasons else 503)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


class HttpServer:
    """Runs the app on host:port (port 0: any free port; see `port` after start)."""

    def __init__(self, readiness: Readiness, host: str = "127.0.0.1", port: int = 9108) -> None:
        self.readiness = readiness
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        self._runner = web.AppRunner(make_app(self.readiness), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        if self._runner.addresses:
            self.port = int(self._runner.addresses[0][1])
        logger.info("HTTP on http://%s:%d (/metrics /healthz /readyz)", self.host, self.port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
