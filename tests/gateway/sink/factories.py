"""Builders for sink tests: events of synthetic calls, a recording SinkHooks, a fake Redis model."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from gateway.events import CallEvent
from gateway.sink.core import BatchOutcome, Probe, SendBatch, SinkConfig, SinkCore
from gateway.sink.spool import Record, Spool


def ev(
    kind: str, call: str = "c1", *, leg: str = "caller", seg: int | None = None, text: str = ""
) -> CallEvent:
    return CallEvent(kind, call, f"sip-{call}", leg=leg, segment_id=seg, text=text, ts=1.0)  # type: ignore[arg-type]


class Hooks:
    """A SinkHooks that counts what the core reports."""

    def __init__(self) -> None:
        self.pub: Counter[str] = Counter()
        self.dup: Counter[str] = Counter()
        self.drop: Counter[tuple[str, str]] = Counter()
        self.spool: Counter[str] = Counter()
        self.up_changes: list[bool] = []

    def published(self, type: str, duplicate: bool) -> None:
        self.pub[type] += 1
        if duplicate:
            self.dup[type] += 1

    def dropped(self, type: str, reason: str, n: int = 1) -> None:
        self.drop[(type, reason)] += n

    def spooled(self, type: str) -> None:
        self.spool[type] += 1

    def redis_up(self, up: bool) -> None:
        self.up_changes.append(up)


def make_core(tmp_path: Path, *, up: bool = True, **cfg: float) -> tuple[SinkCore, Hooks]:
    """A core on a fresh spool, backoff 1 s; `up`: Redis answered a PING at t=0."""
    spool, scan = Spool.open(tmp_path / "spool")
    hooks = Hooks()
    core = SinkCore(SinkConfig(**cfg), spool, scan, hooks, backoff=lambda n: 1.0)  # type: ignore[arg-type]
    if up:
        core.probe_done(True, 0.0)
    return core, hooks


class FakeRedis:
    """The Lua script's semantics in memory: store a record iff its seq is above the call+leg's last."""

    def __init__(self) -> None:
        self.stream: list[dict[str, str]] = []
        self.last: dict[tuple[str, str], int] = {}

    def apply(self, records: tuple[Record, ...] | list[Record]) -> BatchOutcome:
        stored = []
        for rec in records:
            key = (rec.call_id, rec.leg)
            if rec.seq <= self.last.get(key, 0):
                stored.append(False)
            else:
                self.stream.append(rec.fields)
                self.last[key] = rec.seq
                stored.append(True)
        return BatchOutcome(tuple(stored))


def drain(core: SinkCore, redis: FakeRedis, now: float) -> int:
    """Send batches until the core has nothing left to send; returns how many batches were sent."""
    n = 0
    while True:
        action = core.poll(now)
        if isinstance(action, Probe):
            core.probe_done(True, now)
            continue
        if not isinstance(action, SendBatch):
            return n
        core.batch_done(action, redis.apply(action.records), now)
        n += 1
