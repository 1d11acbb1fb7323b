"""Prometheus config and rules pass promtool; the alert unit tests hold; rules name real metrics."""

from __future__ import annotations

import subprocess

import pytest
from prometheus_client import REGISTRY

from gateway.metrics import init_metrics
from tests.fixtures import peers

from .queries import METRIC, OPS, RULE_FILES, THRESHOLD, recorded_series, rules


def promtool(*args: str, cwd: str | None = None) -> str:
    res = subprocess.run([peers.tool("promtool"), *args], capture_output=True, text=True, timeout=60, cwd=cwd)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout + res.stderr


def test_promtool_check_rules_accepts_the_recording_and_alerting_rules() -> None:
    out = promtool("check", "rules", *map(str, RULE_FILES))
    assert "SUCCESS: 7 rules found" in out and "SUCCESS: 12 rules found" in out


@pytest.mark.parametrize("name", ["prometheus.yml", "prometheus.compose.yml"])
def test_promtool_check_config_accepts_the_scrape_configs(name: str) -> None:
    assert "SUCCESS: 2 rule files found" in promtool("check", "config", str(OPS / "prometheus" / name))


def test_the_alerts_fire_when_they_should_and_not_before() -> None:
    promtool("test", "rules", "ttg.rules.test.yml", cwd=str(OPS / "prometheus" / "rules"))


def test_rules_name_only_metrics_of_gateway_metrics_or_recorded_series() -> None:
    init_metrics()
    known = {s.name for m in REGISTRY.collect() for s in m.samples} | set(recorded_series())
    for rule in rules():
        for name in METRIC.findall(rule["expr"]):
            assert name in known, f"{rule.get('record') or rule.get('alert')}: unknown metric {name}"


def test_every_alert_has_a_severity_and_a_summary_and_the_threshold_form() -> None:
    alerts = [r for r in rules() if "alert" in r]
    assert {a["alert"] for a in alerts} >= {
        "TtgDown", "TtgHigh503Rate", "TtgRtpLossHigh", "TtgFinalLatencyHigh", "TtgRedisDown",
        "TtgEventsBacklog", "TtgAsrChunksDropped", "TtgAsrQueueWaitHigh", "TtgDurableEventsDropped",
    }  # fmt: skip
    for a in alerts:
        assert a["labels"]["severity"] in {"critical", "warning", "info"}, a["alert"]
        assert a["annotations"]["summary"], a["alert"]
        assert THRESHOLD.match(a["expr"].strip()), a["alert"]
