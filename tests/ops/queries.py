"""Every PromQL query the ops files hold: dashboard panel targets, recording rules, alert queries."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

OPS = Path(__file__).resolve().parents[2] / "ops"
DASHBOARDS = sorted((OPS / "grafana" / "dashboards").glob("*.json"))
RULE_FILES = [OPS / "prometheus" / "rules" / "ttg.rules.yml", OPS / "prometheus" / "rules" / "ttg.alerts.yml"]
THRESHOLD = re.compile(r"^(?P<query>.+?)\s*(?P<op>==|!=|>=|<=|>|<)\s*(?P<value>-?[0-9.e+]+)\s*$", re.S)
METRIC = re.compile(r"\b(ttg_[a-z0-9_]+|[a-z_]+:ttg_[a-z0-9_:]+)\b")


@dataclass(frozen=True)
class Query:
    where: str  # "gateway.json: Calls by result [A]", "alert TtgRedisDown", ...
    expr: str


def load_dashboard(path: Path) -> dict[str, Any]:
    board: dict[str, Any] = json.loads(path.read_text())
    return board


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in board["panels"] if p["type"] != "row"]


def grafana_to_promql(expr: str, rate_interval: str = "10s") -> str:
    """What Grafana sends for a panel with every instance selected."""
    return expr.replace("$__rate_interval", rate_interval).replace("$instance", ".*")


def dashboard_queries() -> list[Query]:
    out = []
    for path in DASHBOARDS:
        for p in panels(load_dashboard(path)):
            for t in p["targets"]:
                out.append(Query(f"{path.name}: {p['title']} [{t['refId']}]", t["expr"]))
    return out


def rules() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            out.extend(group["rules"])
    return out


def rule_queries() -> list[Query]:
    """Recording rules as they are; alerts without their threshold (the part that must return data)."""
    out = []
    for rule in rules():
        if "record" in rule:
            out.append(Query(f"record {rule['record']}", rule["expr"]))
        else:
            m = THRESHOLD.match(rule["expr"].strip())
            assert m, f"alert {rule['alert']}: expression is not '<query> <op> <threshold>'"
            out.append(Query(f"alert {rule['alert']}", m["query"]))
    return out


def recorded_series() -> list[str]:
    return [r["record"] for r in rules() if "record" in r]
