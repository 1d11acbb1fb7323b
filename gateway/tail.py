"""`ttg tail`: print transcripts from Redis as a person reads a call.

Finals are printed as lines; on a terminal the partial of each call+leg is shown below them and
rewritten in place as it grows (rich Live); DTMF and call start/end are marked. `--json` prints one
JSON object per event instead (for scripts). It is also the reference consumer: it keeps the last
seq per call+leg, so a redelivered event is shown once and a gap is pointed out.

    ttg tail                        # the last 20 events, then exit
    ttg tail -f                     # ... and follow
    ttg tail --call ID [-f]         # one call from its start (found through the calls index); its
                                    # legs (SIPREC: caller and callee) interleaved by media time
    ttg tail --group G --consumer C # a consumer-group worker: XREADGROUP + XACK, resumes its pending
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import heapq
import json
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

Entry = tuple[str, dict[str, str]]
PAGE = 500
BLOCK_MS = 2000


def _clock(ts: str) -> str:
    try:
        return dt.datetime.fromtimestamp(float(ts)).strftime("%H:%M:%S.%f")[:-3]
    except (ValueError, OverflowError, OSError):
        return "--:--:--.---"


def _media(ms: str) -> str:
    if not ms:
        return "?"
    total = int(ms)
    return f"{total // 60000}:{total % 60000 / 1000:04.1f}"


@dataclass
class TailView:
    """Pure: events in, lines to print out; keeps the open partial of each call+leg."""

    call_id: str | None = None
    partials: dict[tuple[str, str], Text] = field(default_factory=dict)
    last_seq: dict[tuple[str, str], int] = field(default_factory=dict)
    speakers: dict[tuple[str, str], str] = field(default_factory=dict)  # call+leg -> who speaks on it

    def feed(self, fields: Mapping[str, str]) -> list[Text]:
        call, leg = fields.get("call_id", "?"), fields.get("leg", "?")
        if self.call_id is not None and call != self.call_id:
            return []
        if fields.get("type") == "call_start":
            self.speakers.update({(call, k): v for k, v in speakers(fields).items()})
        key = (call, leg)
        lines: list[Text] = []
        try:
            seq = int(fields.get("seq", "0"))
        except ValueError:
            seq = 0
        last = self.last_seq.get(key)
        if last is not None and seq <= last:
            return []  # delivered again (consumer-group redelivery, an overlapping read)
        if last is not None and seq > last + 1:
            lines.append(
                Text(f"   ({call}/{leg}: events {last + 1}..{seq - 1} are not in the stream)", "yellow")
            )
        self.last_seq[key] = seq
        kind = fields.get("type", "?")
        speaker = self.speakers.get(key)
        who = f"{call}/{leg}" + (f" ({speaker})" if speaker else "")
        when = _clock(fields.get("ts", ""))
        if kind == "partial":
            self.partials[key] = Text.assemble(
                ("… ", "dim"), (who, "cyan dim"), ("  ", ""), (fields["text"], "italic")
            )
            return lines
        if kind == "final":
            self.partials.pop(key, None)
            span = f"{_media(fields.get('start_ms', ''))}–{_media(fields.get('end_ms', ''))}"
            lines.append(
                Text.assemble(
                    (when, "dim"),
                    "  ",
                    (who, "cyan"),
                    "  ",
                    (f"#{fields.get('segment_id', '')}", "dim"),
                    "  ",
                    (span, "dim"),
                    "  ",
                    fields.get("text", ""),
                )
            )
        elif kind == "dtmf":
            at = _media(fields.get("start_ms", ""))
            lines.append(
                Text.assemble(
                    (when, "dim"), "  ", (who, "cyan"), "  ", (f"☎ DTMF {fields['text']} at {at}", "magenta")
                )
            )
        elif kind == "call_start":
            meta = "  ".join(f"{k}={fields[k]}" for k in ("from", "to", "lang") if fields.get(k))
            lines.append(
                Text.assemble((when, "dim"), "  ", (f"▶ call {call} started", "green bold"), f"  {meta}")
            )
        elif kind == "call_end":
            for k in [k for k in self.partials if k[0] == call]:
                del self.partials[k]
            for k in [k for k in self.speakers if k[0] == call]:
                del self.speakers[k]
            reason = fields.get("reason", "")
            lines.append(
                Text.assemble((when, "dim"), "  ", (f"■ call {call} ended", "red bold"), f"  {reason}")
            )
        else:
            lines.append(Text(f"{when}  {who}  {kind}: {fields.get('text', '')}"))
        return lines

    def live(self) -> Group:
        return Group(*self.partials.values())


def speakers(call_start: Mapping[str, str]) -> dict[str, str]:
    """Leg -> the name (else AoR) of the participant heard on it, from call_start's `participants`
    (SIPREC, docs/events.md); {} for a call without them."""
    out: dict[str, str] = {}
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        for p in json.loads(call_start.get("participants") or "[]"):
            label = str(p.get("name") or p.get("aor") or "")
            for leg in p.get("legs") or ():
                if label:
                    out.setdefault(str(leg), label)
    return out


def interleave(entries: list[Entry]) -> list[Entry]:
    """One call's events with its legs merged by media time (`start_ms`), each leg's own order kept
    (its seq must stay increasing): who said what, in the order it was said. call_start stays first
    and call_end last."""
    firsts = [e for e in entries if e[1].get("type") == "call_start"]
    lasts = [e for e in entries if e[1].get("type") == "call_end"]
    legs: dict[str, list[Entry]] = {}
    for e in entries:
        if e[1].get("type") not in ("call_start", "call_end"):
            legs.setdefault(e[1].get("leg", ""), []).append(e)

    def media_ms(e: Entry) -> int:
        value = e[1].get("start_ms", "")
        return int(value) if value.isdigit() else 0

    return [*firsts, *heapq.merge(*legs.values(), key=media_ms), *lasts]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from gateway.config import Settings

    settings = Settings()
    p.add_argument("--url", default=settings.redis.url, help="Redis URL (default: TTG_REDIS__URL)")
    p.add_argument("--stream", default=settings.redis.stream, help="stream (default: TTG_REDIS__STREAM)")
    p.add_argument(
        "--calls-stream", default=settings.redis.calls_stream, help="calls index, to find --call fast"
    )
    p.add_argument("--call", help="only this call_id, from its start")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new events")
    p.add_argument("-n", "--count", type=int, default=20, help="past events to print first (without --call)")
    p.add_argument("--group", help="read as this consumer group (created at the stream start if missing)")
    p.add_argument("--consumer", default="ttg-tail", help="consumer name within --group")
    p.add_argument("--json", action="store_true", help="one JSON object per event")
    p.add_argument("--no-partials", action="store_true", help="do not show partials")


def _entries(raw: Any) -> list[Entry]:
    """XRANGE/XREAD entries as (id, fields); an entry deleted under a consumer group has no fields."""
    return [(str(entry_id), dict(fields or {})) for entry_id, fields in (raw or [])]


def _call_start_id(r: redis.Redis, calls_stream: str, call_id: str) -> str:
    """Entry ID of the call's call_start in the global stream (via the calls index), or '-'."""
    if not calls_stream:
        return "-"
    last = "+"
    for _ in range(200):  # newest first, bounded
        page = _entries(r.xrevrange(calls_stream, max=last, min="-", count=PAGE))
        for index_id, f in page:
            if f.get("call_id") == call_id and f.get("type") == "call_start":
                return f.get("entry_id") or "-"
            last = "(" + index_id
        if len(page) < PAGE:
            break
    return "-"


def _history(r: redis.Redis, args: argparse.Namespace) -> tuple[list[Entry], str]:
    """Past entries to show first, and the ID to follow from."""
    if args.call:
        start = _call_start_id(r, args.calls_stream, args.call)
        out: list[Entry] = []
        last = "0-0"
        while True:
            page = _entries(r.xrange(args.stream, min=start, max="+", count=PAGE))
            out.extend(e for e in page if e[1].get("call_id") == args.call)
            if page:
                last = page[-1][0]
                start = "(" + last
            if len(page) < PAGE:
                return out, last
    if args.count <= 0:
        info = _entries(r.xrevrange(args.stream, count=1))
        return [], info[0][0] if info else "0-0"
    page = _entries(r.xrevrange(args.stream, count=args.count))
    page.reverse()
    return page, page[-1][0] if page else "0-0"


def _follow(r: redis.Redis, args: argparse.Namespace, last_id: str) -> Iterator[Entry]:
    while True:
        reply: Any = r.xread({args.stream: last_id}, count=PAGE, block=BLOCK_MS)
        for _, raw in reply or []:
            for entry in _entries(raw):
                last_id = entry[0]
                yield entry


def _group(r: redis.Redis, args: argparse.Namespace) -> Iterator[Entry]:
    try:
        r.xgroup_create(args.stream, args.group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
    # First what this consumer was given and never acknowledged (it crashed), then new entries.
    cursor = "0"
    while True:
        block = BLOCK_MS if args.follow else None  # without --follow: what is there, then exit
        reply: Any = r.xreadgroup(args.group, args.consumer, {args.stream: cursor}, count=PAGE, block=block)
        entries = [e for _, raw in (reply or []) for e in _entries(raw)]
        if cursor != ">" and not entries:
            cursor = ">"
            continue
        for entry in entries:
            if entry[1]:  # an entry trimmed away while pending comes back without fields
                yield entry
            r.xack(args.stream, args.group, entry[0])
        if cursor != ">":
            cursor = entries[-1][0]
        elif not entries and not args.follow:
            return


def main(args: argparse.Namespace) -> int:
    err = Console(stderr=True, highlight=False)
    out = Console(file=sys.stdout, highlight=False, soft_wrap=True)
    view = TailView(call_id=args.call)
    show_live = out.is_terminal and not args.json and not args.no_partials
    try:
        r = redis.Redis.from_url(args.url, decode_responses=True, socket_connect_timeout=2)
        r.ping()
    except redis.RedisError as exc:
        err.print(f"[red]cannot reach Redis at {args.url}: {exc}[/red]")
        return 2

    def emit(entry: Entry, live: Live | None) -> None:
        entry_id, fields = entry
        if args.json:
            if view.call_id is None or fields.get("call_id") == view.call_id:
                print(json.dumps({"id": entry_id, **fields}, ensure_ascii=False), flush=True)
            return
        lines = view.feed(fields)
        if live is not None:  # the partials first, so that printing a line never shows a stale one
            live.update(view.live(), refresh=True)
        for line in lines:
            (live.console if live else out).print(line)

    live = Live(console=out, auto_refresh=False, transient=True) if show_live else None
    try:
        if live is not None:
            live.start()
        if args.group:
            for entry in _group(r, args):
                emit(entry, live)
            return 0
        history, last_id = _history(r, args)
        if args.call:
            history = interleave(history)
        for entry in history:
            emit(entry, live)
        if args.follow:
            for entry in _follow(r, args, last_id):
                emit(entry, live)
    except KeyboardInterrupt:
        return 130
    except redis.RedisError as exc:
        err.print(f"[red]Redis error: {exc}[/red]")
        return 1
    finally:
        if live is not None:
            live.stop()
        r.close()
    return 0
