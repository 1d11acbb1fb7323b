"""`ttg bench ttf`'s account of where a final's time goes inside the gateway: means of the daemon's own
histograms, read from a real /metrics endpoint."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, start_http_server

from tools.bench.gateway import scrape
from tools.bench.ttf import INSIDE_METRICS, inside_the_gateway
from tools.ports import free_port


def test_the_inside_account_is_the_mean_of_each_histogram_and_of_each_event_type() -> None:
    registry = CollectorRegistry()
    ttf = Histogram("ttg_time_to_final_seconds", "", registry=registry)
    latency = Histogram("ttg_transcript_latency_seconds", "", ["type"], registry=registry)
    step = Histogram("ttg_encoder_step_seconds", "", registry=registry)
    for v in (0.2, 0.3):
        ttf.observe(v)
    latency.labels(type="final").observe(0.04)
    for v in (0.05, 0.07, 0.09):
        latency.labels(type="partial").observe(v)
    step.observe(0.025)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        inside = inside_the_gateway(scrape(f"http://127.0.0.1:{port}/metrics", INSIDE_METRICS))
    finally:
        server.shutdown()
        thread.join(5)
    assert inside["speech_end_to_final"] == pytest.approx(250.0)
    assert inside["chunk_to_final"] == pytest.approx(40.0)
    assert inside["chunk_to_partial"] == pytest.approx(70.0)
    assert inside["encoder_step"] == pytest.approx(25.0)
    assert inside["queue_wait"] is None  # nothing observed: no mean, rather than 0
