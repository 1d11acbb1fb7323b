"""Grafana dashboards load as provisioned: datasource variable, sound layout, only real metric names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from gateway.metrics import init_metrics
from tools.gen_dashboards import main as gen_dashboards

from .queries import DASHBOARDS, METRIC, dashboard_queries, load_dashboard, panels, recorded_series


def test_the_dashboards_are_the_generated_files() -> None:
    assert [p.name for p in DASHBOARDS] == ["asr.json", "gateway.json"]
    assert gen_dashboards(["--check"]) == 0, "run python -m tools.gen_dashboards"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_panel_uses_the_datasource_variable_never_an_export_input(path: Path) -> None:
    text = path.read_text()
    assert "DS_PROMETHEUS" not in text and "__inputs" not in text
    board = load_dashboard(path)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    assert variables["instance"]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    for p in panels(board):
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert 'instance=~"$instance"' in t["expr"], f"{p['title']}: not filtered by $instance"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_panels_have_unique_ids_and_fit_the_24_column_grid_without_overlap(path: Path) -> None:
    board = load_dashboard(path)
    assert board["uid"].startswith("ttg-") and board["schemaVersion"] >= 36
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))
    json.dumps(board)  # plain JSON, nothing Python-specific


def test_every_metric_a_panel_names_is_declared_in_gateway_metrics() -> None:
    init_metrics()
    # a labelled series no process has reported yet (a media worker's, in single-process mode) has no
    # sample, but its family is declared
    exported = {s.name for m in REGISTRY.collect() for s in m.samples} | {m.name for m in REGISTRY.collect()}
    known = exported | set(recorded_series())
    for q in dashboard_queries():
        for name in METRIC.findall(q.expr):
            assert name in known, f"{q.where}: {name} is not a metric of gateway/metrics.py"


def test_the_panels_operators_expect_are_there() -> None:
    titles = {p["title"] for path in DASHBOARDS for p in panels(load_dashboard(path))}
    for expected in [
        "Active calls",
        "Calls refused with 503",
        "Loss, late and duplicate ratio",
        "Jitter at hang-up (RFC 3550)",
        "Responses by code",
        "Events published by type",
        "Batch size",
        "Step time",
        "Queue wait of a ready chunk",
        "Time to final, transcript latency by type",
        "Decode step time",
        "Audio chunks dropped",
    ]:
        assert expected in titles


def test_the_latency_panel_shows_time_to_final() -> None:
    latency = [
        p
        for path in DASHBOARDS
        for p in panels(load_dashboard(path))
        if p["title"] == "Time to final, transcript latency by type"
    ]
    (panel,) = latency
    exprs = [t["expr"] for t in panel["targets"]]
    assert any("ttg_time_to_final_seconds_bucket" in e and "histogram_quantile(0.95" in e for e in exprs)
