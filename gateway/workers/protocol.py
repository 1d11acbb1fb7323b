"""What the gateway's process and its media workers tell each other: JSON lines over a socketpair.

Control traffic only (per call leg: open, update, close, finish, abort; per leg event: DTMF,
inactivity; once a second: metric deltas). Audio never takes this path: a worker sends its chunks
straight to the engine process through a shared-memory channel (asr_core.channel).

    main -> worker   {"op": "open", "leg": L, "key": K, "plan": {...} | null, "language": ...,
                      "lookahead": ..., "stream_id": ...}
                     {"op": "update", "leg": L, "plan": {...}}
                     {"op": "close", "leg": L}     flush the media into the ASR front end; reply "closed"
                     {"op": "finish", "leg": L}    end the ASR stream (its last chunk, then FINISH)
                     {"op": "abort", "leg": L}     close the ASR stream at once, drop the leg
                     {"op": "stop"}
    worker -> main   {"op": "ready", "index": i, "ports": [lo, hi]}
                     {"op": "opened", "leg": L, "port": p}
                     {"op": "open_failed", "leg": L, "error": ..., "exhausted": b}
                     {"op": "closed", "leg": L, "stats": {...}, "audio_ms": n}
                     {"op": "dtmf", "leg": L, "digit": d, "start_ms": s, "duration_ms": t}
                     {"op": "inactive", "leg": L}
                     {"op": "metrics", "counters": [[name, {labels}, delta], ...], "streams": n}
                     once a second also "loop_lag_s", "flush_delay_s": the period's largest lateness of
                     the worker's event loop, and longest wait of a chunk to be published to its engine

A leg is named by a string the main process chooses (unique among its live legs).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import Counter, Gauge

from gateway.rtp.stats import MediaStats
from gateway.sdp import MediaPlan


def line(msg: Mapping[str, Any]) -> bytes:
    return (json.dumps(msg, separators=(",", ":")) + "\n").encode()


def plan_to_json(plan: MediaPlan | None) -> dict[str, Any] | None:
    return None if plan is None else dataclasses.asdict(plan)


def plan_from_json(d: Mapping[str, Any] | None) -> MediaPlan | None:
    return None if d is None else MediaPlan(**d)


def stats_to_json(stats: MediaStats) -> dict[str, Any]:
    return dataclasses.asdict(stats)


def stats_from_json(d: Mapping[str, Any]) -> MediaStats:
    return MediaStats(**d)


class CounterDeltas:
    """A worker's side of metric forwarding: what each counter series gained since the last call.

    The media code increments the usual `gateway.metrics` counters in the worker's own registry; the
    deltas go to the main process, which adds them to the same series in its registry (the one
    /metrics serves). Only counters travel: gauges and histograms of the media path are derived in
    the main process (open legs, the jitter in each leg's final stats). It reads only the counters it
    is given, not the whole registry: a worker reports at every leg's close, and the registry's
    histograms and process collectors cost several times what its counters do."""

    def __init__(self, counters: Iterable[Counter]) -> None:
        self._counters = list(counters)
        self._last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def take(self) -> list[list[Any]]:
        out: list[list[Any]] = []
        for counter in self._counters:
            for family in counter.collect():
                for s in family.samples:
                    if not s.name.endswith("_total"):
                        continue
                    key = (family.name, tuple(sorted(s.labels.items())))
                    delta = s.value - self._last.get(key, 0.0)
                    if delta > 0:
                        self._last[key] = s.value
                        out.append([family.name, dict(s.labels), delta])
        return out


def counters_by_name(metrics_module: Any) -> dict[str, Counter]:
    """The counters of `gateway.metrics` by family name (as `CounterDeltas` names them)."""
    out: dict[str, Counter] = {}
    for value in vars(metrics_module).values():
        if isinstance(value, Counter):
            out[next(iter(value.describe())).name] = value
    return out


def apply_deltas(counters: Mapping[str, Counter], deltas: Iterable[list[Any]]) -> int:
    """Add a worker's deltas to this process's counters; returns how many series were unknown."""
    unknown = 0
    for name, labels, delta in deltas:
        c = counters.get(name)
        if c is None:
            unknown += 1
            continue
        try:
            (c.labels(**labels) if labels else c).inc(float(delta))
        except (ValueError, TypeError):
            unknown += 1
    return unknown


def set_gauge_sum(gauge: Gauge, parts: Iterable[float]) -> None:
    gauge.set(sum(parts))
