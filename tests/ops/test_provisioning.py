"""Grafana provisioning and the compose file are well-formed and point at each other correctly
(no Docker engine here: the structure is checked, not run)."""

from __future__ import annotations

from typing import Any

import yaml

from .queries import OPS


def load(rel: str) -> Any:
    return yaml.safe_load((OPS / rel).read_text())


def test_the_datasource_is_a_prometheus_with_a_fixed_uid() -> None:
    doc = load("grafana/provisioning/datasources/prometheus.yaml")
    assert doc["apiVersion"] == 1
    (ds,) = doc["datasources"]
    assert ds["type"] == "prometheus" and ds["uid"] and ds["access"] == "proxy"
    assert ds["url"] == "http://prometheus:9090"  # the compose service name


def test_the_dashboard_provider_reads_the_folder_compose_mounts_the_dashboards_into() -> None:
    (provider,) = load("grafana/provisioning/dashboards/ttg.yaml")["providers"]
    assert provider["type"] == "file"
    grafana = load("compose.yaml")["services"]["grafana"]
    mounts = dict(
        v.rsplit(":", 1)[0].split(":", 1) if v.endswith(":ro") else v.split(":", 1)
        for v in grafana["volumes"]
    )
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"


def test_compose_runs_redis_prometheus_and_grafana_on_loopback_ports_with_existing_files() -> None:
    doc = load("compose.yaml")
    services = doc["services"]
    assert set(services) == {"redis", "prometheus", "grafana"}
    for name, svc in services.items():
        assert svc["image"] and ":" in svc["image"], f"{name}: pin the image tag"
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        for volume in svc.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("./"):
                assert (OPS / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in doc["volumes"], f"{name}: undeclared volume {source}"
    assert "--appendonly" in services["redis"]["command"]
    prom_cmd = " ".join(services["prometheus"]["command"])
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom_cmd
    assert any(
        v.startswith("./prometheus/rules:/etc/prometheus/rules") for v in services["prometheus"]["volumes"]
    )
