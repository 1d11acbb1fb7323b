from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from gateway.sink import ClientConfig, RedisSink, SinkConfig, StreamLayout

SinkFactory = Callable[..., RedisSink]


@pytest.fixture
async def make_sink(tmp_path: Path) -> AsyncIterator[SinkFactory]:
    """Build (not start) RedisSinks on a spool dir under tmp_path; every one is closed at the end."""
    made: list[RedisSink] = []

    def factory(
        url: str, *, spool: str = "spool", layout: StreamLayout | None = None, **cfg: float
    ) -> RedisSink:
        sink = RedisSink.create(
            spool_dir=str(tmp_path / spool),
            layout=layout or StreamLayout(),
            client_cfg=ClientConfig(url, socket_timeout_s=1.0, connect_timeout_s=0.5, retries=1),
            sink_cfg=SinkConfig(**cfg),  # type: ignore[arg-type]
            fsync_interval_s=0.05,
            backoff_cap_s=0.3,
        )
        made.append(sink)
        return sink

    yield factory
    for sink in made:
        await sink.close(timeout_s=0.5)
