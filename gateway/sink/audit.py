"""Read a transcript stream back and check what the sink promises (tests, harnesses, operators).

    entries = read_stream(redis_url, "ttg:transcripts")
    report = audit(entries, ended={"call-1", ...})
    assert not report.problems, report.problems

Checked, per call+leg: seq is 1, 2, 3 ... in stream order with no gap and no repeat; `event_id` is
`{call_id}:{leg}:{seq}` and unique in the stream; call_start (when present) comes first and call_end
(exactly one, required for calls listed in `ended`) comes last; a final closes each segment at most
once; every entry is schema v1 with a known type.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import redis

from gateway.events import EVENT_TYPES, SCHEMA_VERSION, event_id

Entry = tuple[str, dict[str, str]]


def read_stream(url: str, stream: str, *, call_id: str | None = None, page: int = 1000) -> list[Entry]:
    """Every entry of `stream` in order (optionally one call's), read in pages with XRANGE."""
    out: list[Entry] = []
    with redis.Redis.from_url(url, decode_responses=True) as r:
        start = "-"
        while True:
            chunk = r.xrange(stream, min=start, max="+", count=page)
            if not chunk:
                break
            for entry_id, fields in chunk:
                if call_id is None or fields.get("call_id") == call_id:
                    out.append((entry_id, fields))
            if len(chunk) < page:
                break
            start = "(" + chunk[-1][0]
    return out


@dataclass
class AuditReport:
    problems: list[str] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)  # entries by type
    calls: dict[tuple[str, str], list[dict[str, str]]] = field(default_factory=dict)  # (call, leg) -> events

    def finals(self, call_id: str, leg: str = "caller") -> list[str]:
        return [f["text"] for f in self.calls.get((call_id, leg), []) if f["type"] == "final"]

    def texts(self, kind: str) -> Counter[str]:
        """How many times each text appears among events of `kind` (e.g. every final exactly once)."""
        return Counter(f["text"] for evs in self.calls.values() for f in evs if f["type"] == kind)


def audit(entries: Sequence[Entry], *, ended: Iterable[str] = (), max_problems: int = 50) -> AuditReport:
    report = AuditReport()
    problems = report.problems
    seen_ids: set[str] = set()
    by_key: dict[tuple[str, str], list[dict[str, str]]] = defaultdict(list)

    def problem(text: str) -> None:
        if len(problems) < max_problems:
            problems.append(text)

    for entry_id, f in entries:
        kind = f.get("type", "")
        report.counts[kind] += 1
        if f.get("v") != SCHEMA_VERSION or kind not in EVENT_TYPES:
            problem(f"{entry_id}: not a schema v{SCHEMA_VERSION} event: v={f.get('v')!r} type={kind!r}")
            continue
        try:
            seq = int(f["seq"])
            key = (f["call_id"], f["leg"])
        except (KeyError, ValueError):
            problem(f"{entry_id}: missing call_id/leg/seq")
            continue
        eid = f.get("event_id", "")
        if eid != event_id(key[0], key[1], seq):
            problem(f"{entry_id}: event_id {eid!r} does not match call_id/leg/seq")
        if eid in seen_ids:
            problem(f"{entry_id}: duplicate event_id {eid}")
        seen_ids.add(eid)
        by_key[key].append(f)

    for (call_id, leg), evs in by_key.items():
        seqs = [int(f["seq"]) for f in evs]
        if seqs != list(range(1, len(seqs) + 1)):
            bad = next(i for i, s in enumerate(seqs) if s != i + 1)
            around = seqs[max(0, bad - 2) : bad + 3]
            problem(f"{call_id}/{leg}: seq not gapless from 1 in stream order, at index {bad}: {around}")
        types = [f["type"] for f in evs]
        if "call_start" in types and types[0] != "call_start":
            problem(f"{call_id}/{leg}: call_start is not the first event")
        n_end = types.count("call_end")
        if n_end > 1:
            problem(f"{call_id}/{leg}: {n_end} call_end events")
        if n_end == 1 and types[-1] != "call_end":
            problem(f"{call_id}/{leg}: events after call_end")
        final_segments = [f["segment_id"] for f in evs if f["type"] == "final"]
        for seg, n in Counter(final_segments).items():
            if n > 1:
                problem(f"{call_id}/{leg}: segment {seg} has {n} finals")
    ended_calls = set(ended)
    keys_by_call: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for key in by_key:
        keys_by_call[key[0]].append(key)
    for call_id in sorted(ended_calls):
        if not any(f["type"] == "call_end" for key in keys_by_call.get(call_id, []) for f in by_key[key]):
            problem(f"{call_id}: no call_end")
    report.calls = dict(by_key)
    return report
