"""Write the Grafana dashboards ops/grafana/dashboards/{gateway,asr}.json from the panel lists below.

    python -m tools.gen_dashboards          # rewrite the files
    python -m tools.gen_dashboards --check  # exit 1 if a file differs (tests/ops runs this)

Every panel queries the datasource chosen in the `datasource` variable (`${datasource}`, never the
export-only `${DS_PROMETHEUS}`), and the `instance` variable filters the gateways shown. Only metric
names declared in gateway/metrics.py are used (tests/ops checks it, and evaluates every query
against a real Prometheus).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUT_DIR = Path(__file__).resolve().parents[1] / "ops" / "grafana" / "dashboards"
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = '{instance=~"$instance"}'
RI = "$__rate_interval"
CODE_503 = 'code="503"'
INVITE = 'method="INVITE"'


def sel(labels: str = "") -> str:
    """A label selector with the instance filter (and more matchers)."""
    inner = 'instance=~"$instance"' + (f",{labels}" if labels else "")
    return "{" + inner + "}"


def rate(metric: str, labels: str = "") -> str:
    return f"rate({metric}{sel(labels)}[{RI}])"


def quantiles(metric: str, by: str = "", qs: tuple[float, ...] = (0.5, 0.95, 0.99)) -> list[tuple[str, str]]:
    group = f"le{', ' + by if by else ''}"
    legend = ("{{" + by + "}} " if by else "") + "p{q}"
    return [
        (
            f"histogram_quantile({q}, sum by ({group}) ({rate(metric + '_bucket')}))",
            legend.replace("{q}", f"{int(q * 100)}"),
        )
        for q in qs
    ]


@dataclass
class Panel:
    title: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"
    description: str = ""
    width: int = 12
    height: int = 8
    stack: bool = False
    instant: bool = False


@dataclass
class Row:
    title: str
    panels: list[Panel] = field(default_factory=list)


def _panel_json(p: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    targets = []
    for i, (expr, legend) in enumerate(p.targets):
        t: dict[str, Any] = {
            "datasource": DS,
            "refId": chr(ord("A") + i),
            "expr": expr,
            "legendFormat": legend,
        }
        if p.instant:
            t.update({"instant": True, "range": False, "format": "table"})
        targets.append(t)
    out: dict[str, Any] = {
        "id": pid,
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "datasource": DS,
        "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y},
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
    }
    if p.kind == "timeseries":
        custom = {"fillOpacity": 10, "showPoints": "never", "lineWidth": 1}
        if p.stack:
            custom["stacking"] = {"mode": "normal", "group": "A"}
        out["fieldConfig"]["defaults"]["custom"] = custom
        out["options"] = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    elif p.kind == "stat":
        out["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}
    elif p.kind == "table":
        out["options"] = {"showHeader": True}
        out["transformations"] = [
            {"id": "organize", "options": {"excludeByName": {"Time": True, "Value": True, "__name__": True}}}
        ]
    return out


def dashboard(uid: str, title: str, description: str, rows: list[Row]) -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for row in rows:
        panels.append(
            {"id": pid, "type": "row", "title": row.title, "collapsed": False, "panels": [],
             "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}}
        )  # fmt: skip
        pid, y = pid + 1, y + 1
        x, row_h = 0, 0
        for p in row.panels:
            if x + p.width > 24:
                x, y, row_h = 0, y + row_h, 0
            panels.append(_panel_json(p, pid, x, y))
            pid, x, row_h = pid + 1, x + p.width, max(row_h, p.height)
        y += row_h
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["ttg", "telephony", "asr"],
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "links": [],
        "annotations": {"list": []},
        "templating": {
            "list": [
                {
                    "type": "datasource",
                    "name": "datasource",
                    "label": "Data source",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                    "refresh": 1,
                    "regex": "",
                    "options": [],
                },
                {
                    "type": "query",
                    "name": "instance",
                    "label": "Gateway",
                    "datasource": DS,
                    "definition": "label_values(ttg_build_info, instance)",
                    "query": {"query": "label_values(ttg_build_info, instance)", "refId": "instance"},
                    "includeAll": True,
                    "allValue": ".*",
                    "multi": True,
                    "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
                    "refresh": 2,
                    "sort": 1,
                    "hide": 0,
                    "options": [],
                },
            ]
        },
        "panels": panels,
    }


def gateway_rows() -> list[Row]:
    rx = "ttg_rtp_packets_received_total"
    lost = f"sum({rate('ttg_rtp_packets_lost_total')})"
    received = f"sum({rate(rx)})"
    return [
        Row(
            "Calls",
            [
                Panel(
                    "Active calls",
                    [(f"sum(ttg_active_calls{SEL})", "calls"), (f"sum(ttg_active_streams{SEL})", "streams")],
                    kind="stat",
                    width=6,
                    description="Streams: the calls' legs (SIPREC: one per party), what MAX_CALLS counts",
                ),
                Panel(
                    "Redis up",
                    [(f"min(ttg_redis_up{SEL})", "up")],
                    kind="stat",
                    width=6,
                    description="0: the sink cannot write to Redis (events wait in memory, then on disk)",
                ),
                Panel(
                    "Calls by result",
                    [(f"sum by (result) ({rate('ttg_calls_total')})", "{{result}}")],
                    unit="cps",
                    stack=True,
                ),
                Panel(
                    "Calls refused with 503",
                    [(f"sum({rate('ttg_sip_responses_total', CODE_503)})", "503/s")],
                    unit="cps",
                    description="Capacity (max_calls), draining or rate limit: callers retry elsewhere",
                ),
                Panel(
                    "503 share of INVITEs",
                    [
                        (
                            f"sum({rate('ttg_sip_responses_total', CODE_503)}) / "
                            f"clamp_min(sum({rate('ttg_sip_requests_total', INVITE)}), 1e-9)",
                            "503 / INVITE",
                        )
                    ],
                    unit="percentunit",
                ),
            ],
        ),
        Row(
            "SIP",
            [
                Panel(
                    "Requests by method",
                    [(f"sum by (method) ({rate('ttg_sip_requests_total')})", "{{method}}")],
                    unit="reqps",
                    width=6,
                ),
                Panel(
                    "Responses by code",
                    [(f"sum by (code) ({rate('ttg_sip_responses_total')})", "{{code}}")],
                    unit="reqps",
                    width=6,
                ),
                Panel(
                    "Malformed or refused messages",
                    [(f"sum by (reason) ({rate('ttg_sip_errors_total')})", "{{reason}}")],
                    unit="reqps",
                    width=6,
                ),
                Panel(
                    "Failed authentications and bans",
                    [
                        (f"sum({rate('ttg_sip_auth_failures_total')})", "failed (403)"),
                        (f"sum({rate('ttg_sip_auth_bans_total')})", "sources banned"),
                    ],
                    unit="reqps",
                    width=6,
                    description="Password guessing: each failure is a log line fail2ban reads (ops/fail2ban)",
                ),
            ],
        ),
        Row(
            "RTP",
            [
                Panel(
                    "Packets received by codec", [(f"sum by (codec) ({rate(rx)})", "{{codec}}")], unit="pps"
                ),
                Panel(
                    "Loss, late and duplicate ratio",
                    [
                        (f"{lost} / clamp_min({received} + {lost}, 1e-9)", "lost"),
                        (f"sum({rate('ttg_rtp_packets_late_total')}) / clamp_min({received}, 1e-9)", "late"),
                        (
                            f"sum({rate('ttg_rtp_packets_duplicate_total')}) / clamp_min({received}, 1e-9)",
                            "duplicate",
                        ),
                    ],
                    unit="percentunit",
                    description="Lost = never arrived (concealed); late = after its playout deadline",
                ),
                Panel(
                    "Jitter at hang-up (RFC 3550)",
                    quantiles("ttg_rtp_jitter_seconds", qs=(0.5, 0.95)),
                    unit="s",
                    width=6,
                ),
                Panel(
                    "Invalid datagrams by reason",
                    [(f"sum by (reason) ({rate('ttg_rtp_packets_invalid_total')})", "{{reason}}")],
                    unit="pps",
                    width=6,
                ),
                Panel(
                    "DTMF events (RFC 4733)",
                    [(f"sum({rate('ttg_dtmf_events_total')})", "DTMF/s")],
                    unit="cps",
                    width=6,
                ),
                Panel(
                    "RTCP reports to the peers",
                    [
                        (f"sum({rate('ttg_rtcp_reports_sent_total')})", "sent"),
                        (f"sum({rate('ttg_rtcp_send_errors_total')})", "not sent"),
                    ],
                    unit="pps",
                    width=6,
                    description="Receiver reports, one per call leg every 2-6 s: peers that hear neither "
                    "RTP nor RTCP hang up (linphone after 30 s, Asterisk's rtptimeout)",
                ),
            ],
        ),
        Row(
            "Transcripts to Redis",
            [
                Panel(
                    "Events published by type",
                    [(f"sum by (type) ({rate('ttg_events_published_total')})", "{{type}}")],
                    unit="cps",
                    stack=True,
                ),
                Panel(
                    "Events dropped by type and reason",
                    [(f"sum by (type, reason) ({rate('ttg_events_dropped_total')})", "{{type}} {{reason}}")],
                    unit="cps",
                    description="Partials are dropped first; any other type here means data loss",
                ),
                Panel(
                    "Events waiting for Redis (memory + spool)",
                    [(f"sum(ttg_events_buffered{SEL})", "buffered")],
                    width=8,
                ),
                Panel(
                    "Spooled and deduplicated events",
                    [
                        (f"sum by (type) ({rate('ttg_events_spooled_total')})", "spooled {{type}}"),
                        (f"sum({rate('ttg_events_duplicates_total')})", "already in Redis"),
                    ],
                    unit="cps",
                    width=8,
                ),
                Panel(
                    "Redis request time",
                    quantiles("ttg_redis_request_seconds", qs=(0.5, 0.95, 0.99)),
                    unit="s",
                    width=8,
                ),
            ],
        ),
        Row(
            "Build",
            [Panel("Build", [(f"ttg_build_info{SEL}", "")], kind="table", width=24, height=5, instant=True)],
        ),
    ]


def asr_rows() -> list[Row]:
    bs = "ttg_encoder_batch_size"
    refused = rate("ttg_calls_total", 'result=~"rejected_overload|rejected_limit"')
    return [
        Row(
            "Encoder (one batched step for all ready calls)",
            [
                Panel(
                    "Batch size",
                    [
                        *quantiles(bs, qs=(0.5, 0.95)),
                        (f"sum({rate(bs + '_sum')}) / clamp_min(sum({rate(bs + '_count')}), 1e-9)", "mean"),
                    ],
                    description="Chunks (calls) per encoder step",
                ),
                Panel("Step time", quantiles("ttg_encoder_step_seconds"), unit="s"),
                Panel(
                    "Steps per second",
                    [(f"sum({rate('ttg_encoder_step_seconds_count')})", "steps/s")],
                    unit="ops",
                    width=8,
                ),
                Panel(
                    "Encoder busy",
                    [(f"sum({rate('ttg_encoder_step_seconds_sum')})", "busy")],
                    unit="percentunit",
                    width=8,
                    description="Share of wall time the MLX thread spends in steps; near 1 = saturated",
                ),
                Panel(
                    "Queue wait of a ready chunk", quantiles("ttg_asr_queue_wait_seconds"), unit="s", width=8
                ),
            ],
        ),
        Row(
            "Decoder (RNN-T, onnxruntime workers)",
            [
                Panel("Decode step time", quantiles("ttg_decoder_step_seconds"), unit="s"),
                Panel(
                    "Decode steps per second",
                    [(f"sum({rate('ttg_decoder_step_seconds_count')})", "steps/s")],
                    unit="ops",
                ),
            ],
        ),
        Row(
            "Transcripts",
            [
                Panel(
                    "Time to final, transcript latency by type",
                    [(q, "time to final " + legend) for q, legend in quantiles("ttg_time_to_final_seconds")]
                    + quantiles("ttg_transcript_latency_seconds", by="type"),
                    unit="s",
                    description="Time to final: from the caller's last speech sample (VAD) to the final "
                    "it closed. By type: from the arrival of the audio completing a chunk to its event",
                ),
                Panel(
                    "Transcripts per second by type",
                    [(f"sum by (type) ({rate('ttg_transcript_latency_seconds_count')})", "{{type}}")],
                    unit="cps",
                ),
            ],
        ),
        Row(
            "Falling behind",
            [
                Panel(
                    "Audio chunks dropped",
                    [(f"sum({rate('ttg_asr_chunks_dropped_total')})", "dropped/s")],
                    unit="cps",
                    description="A call's queue overflowed: the engine cannot keep up",
                ),
                Panel(
                    "Active calls",
                    [
                        (f"sum(ttg_active_calls{SEL})", "calls"),
                        (f"sum(ttg_active_streams{SEL})", "streams"),
                        (f"sum(ttg_call_limit{SEL})", "limit"),
                    ],
                    description="'limit': the streams the adaptive call limit admits now "
                    "(TTG_SIP__CALL_LIMIT_LAG_MS)",
                ),
                Panel(
                    "Engine lag",
                    [
                        (f"max(ttg_engine_lag_seconds{SEL})", "lag"),
                        (f"max(ttg_engine_overloaded{SEL})", "refusing"),
                        (f"max(ttg_engine_load{SEL})", "load"),
                    ],
                    unit="s",
                    description="Longest recent delay from a chunk's audio to its decoding; past "
                    "TTG_SIP__MAX_ENGINE_LAG_MS new calls get 503 ('refusing' = 1). 'load': the encoder's "
                    "utilisation by the rows coming in (1 = its capacity); the call limit stops growing "
                    "at TTG_SIP__CALL_LIMIT_LOAD",
                ),
                Panel(
                    "Calls refused for engine overload",
                    [(f"sum({refused})", "refused/s")],
                    unit="cps",
                    description="503: the engine too far behind, or the adaptive call limit reached",
                ),
            ],
        ),
        Row(
            "Processes",
            [
                Panel(
                    "Media worker processes",
                    [
                        (f"sum(ttg_media_workers{SEL})", "running"),
                        (f"sum({rate('ttg_media_worker_deaths_total')})", "deaths/s"),
                    ],
                    description="RTP receive and the ASR front end; 0 in single-process mode",
                ),
                Panel(
                    "ASR engine processes",
                    [
                        (f"sum(ttg_engines_up{SEL})", "up"),
                        (f"sum({rate('ttg_engine_failures_total')})", "failures/s"),
                    ],
                    description="Engines taking calls (0 in single-process mode); one that fails while "
                    "others run is replaced with its media workers",
                ),
                Panel(
                    "Streams per ASR engine",
                    [(f"sum by (engine) (ttg_engine_streams{SEL})", "engine {{engine}}")],
                    description="The audio streams each engine process holds; new legs go to the engine "
                    "with the fewest, so the lines should stay together",
                ),
                Panel(
                    "Lag per ASR engine",
                    [
                        (f"max by (engine) (ttg_engine_process_lag_seconds{SEL})", "lag {{engine}}"),
                        (f"max by (engine) (ttg_engine_process_load{SEL})", "load {{engine}}"),
                        (f"max by (engine) (ttg_engine_process_busy{SEL})", "busy {{engine}}"),
                    ],
                    unit="s",
                    description="Each engine process's own lag and load ('Engine lag' shows the largest) and "
                    "the share of time its MLX thread spent stepping: behind while busy near 1, the "
                    "engine is short of capacity (the load leaves a step's fixed cost out); behind while "
                    "neither is near 1, it is stalled",
                ),
                Panel(
                    "Where each ASR engine's lag sits",
                    [
                        (f"max by (engine) (ttg_engine_process_lag_seconds{SEL})", "all {{engine}}"),
                        (
                            f"max by (engine) (ttg_engine_process_arrival_lag_seconds{SEL})",
                            "to its process {{engine}}",
                        ),
                        (
                            f"max by (engine) (ttg_engine_process_receive_lag_seconds{SEL})",
                            "to the queue {{engine}}",
                        ),
                        (
                            f"max by (engine) (ttg_engine_process_queue_wait_seconds{SEL})",
                            "in the queue {{engine}}",
                        ),
                    ],
                    unit="s",
                    description="A chunk's longest delay over the last second or two, from its audio to its "
                    "decoding, beside its first two parts: from its audio to the engine's queue (the media "
                    "worker and the channel; 'to its process' is the part until the engine process read "
                    "it) and in the queue waiting for a step; the rest is the step, the decoding and the "
                    "transcript's assembly",
                ),
                Panel(
                    "Media workers' event loops",
                    [
                        (f"max by (worker) (ttg_media_worker_loop_lag_seconds{SEL})", "loop lag {{worker}}"),
                        (
                            f"max by (worker) (ttg_media_worker_flush_delay_seconds{SEL})",
                            "to the channel {{worker}}",
                        ),
                    ],
                    unit="s",
                    description="Per media worker, the most each second that its event loop ran a timer late "
                    "(a long turn delays its calls' packets and chunks) and that a chunk its front end "
                    "completed waited to be published to its engine: the worker's part of 'to the queue' "
                    "above; the rest of that is the channel and the engine's receiving thread "
                    "(single-process mode: the gateway's own loop, which carries the media path, as "
                    "worker 0)",
                ),
            ],
        ),
    ]


def dashboards() -> dict[str, dict[str, Any]]:
    return {
        "gateway.json": dashboard(
            "ttg-gateway",
            "ttg / Gateway",
            "Calls, SIP, RTP health and transcript delivery to Redis",
            gateway_rows(),
        ),
        "asr.json": dashboard(
            "ttg-asr", "ttg / ASR engine", "Batched encoder, decoder workers, transcript latency", asr_rows()
        ),
    }


def render(board: dict[str, Any]) -> str:
    return json.dumps(board, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    stale = []
    for name, board in dashboards().items():
        path = OUT_DIR / name
        text = render(board)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print("out of date (run python -m tools.gen_dashboards):", *stale, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
