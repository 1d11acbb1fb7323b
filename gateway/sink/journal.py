"""The crash journal: which calls are live, beside the spool, so that a restart can end them.

docs/events.md promises exactly one `call_end` for every `call_start`. A call that was up when the
process died (SIGKILL, OOM, power loss, an abandoned call at shutdown) would break that promise: its
session is gone with the process. The journal remembers, per call+leg whose `call_start` was
committed, the highest `seq` committed so far and the time of that event, until its `call_end` is
committed. On the next start the sink commits, for each call still in the journal, a `call_end` with
`reason=gateway_restart` whose `seq` follows the last one committed (so the Redis seq guard takes it).

File `calls.journal` in the spool directory, one line per entry, appended with one `write()`:
    S <json {call_id, leg, sip_call_id, lang, seq, ts}>   a call_start was committed
    Q <json {call_id, leg, seq, ts}>                        the call's latest committed seq
    E <json {call_id, leg}>                                 its call_end was committed
The sink core records commits as they happen and writes once per `flush()` (once per batch), before
a batch can reach Redis, so the journal's seq is never behind what Redis holds after a crash of the
process. (Not fsynced: after a power loss the journal may be a little behind, and the restart's
call_end of such a call may be refused by the seq guard as a duplicate; docs/events.md says so.)
A torn last line is skipped. The file is rewritten (tmp + rename) with only the live calls at
startup and whenever it grows past a few times their number.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from gateway.events import CallEvent

logger = logging.getLogger(__name__)

JOURNAL_FILE = "calls.journal"
COMPACT_MIN_LINES = 1000


@dataclass(slots=True)
class LiveCall:
    call_id: str
    leg: str
    sip_call_id: str
    lang: str
    seq: int  # highest committed seq of the call+leg
    started_ts: float  # wall-clock time of its call_start
    last_ts: float  # wall-clock time of its latest committed event


class CallJournal:
    """See the module docstring. Owned by the sink core (event-loop thread)."""

    def __init__(self, directory: Path, fd: int, live: dict[tuple[str, str], LiveCall]) -> None:
        self.dir = directory
        self._fd = fd
        self._live = live
        self._buf: list[str] = []
        self._dirty: set[tuple[str, str]] = set()
        self._lines = len(live)

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> tuple[CallJournal, list[LiveCall]]:
        """Read the journal; returns it (compacted) and the calls a previous run left live."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        path = d / JOURNAL_FILE
        live: dict[tuple[str, str], LiveCall] = {}
        if path.exists():
            with path.open("rb") as f:
                for line in f:
                    _apply(live, line)
        orphans = sorted(live.values(), key=lambda c: c.started_ts)
        journal = cls(d, -1, dict(live))
        journal._rewrite()
        return journal, orphans

    # --- recording (called by the sink core at each commit) ----------------------------------------
    def committed(self, fields: dict[str, str]) -> None:
        key = (fields["call_id"], fields["leg"])
        kind, seq, ts = fields["type"], int(fields["seq"]), _float(fields.get("ts", ""))
        if kind == "call_start":
            sip_call_id, lang = fields.get("sip_call_id", ""), fields.get("lang", "")
            started = LiveCall(key[0], key[1], sip_call_id, lang, seq, ts, ts)
            self._live[key] = started
            self._dirty.discard(key)
            self._buf.append("S " + _json(started))
        elif kind == "call_end":
            if self._live.pop(key, None) is not None:
                self._dirty.discard(key)
                self._buf.append("E " + json.dumps({"call_id": key[0], "leg": key[1]}))
        else:
            call = self._live.get(key)
            if call is not None and seq > call.seq:
                call.seq, call.last_ts = seq, ts
                self._dirty.add(key)

    def flush(self) -> None:
        """Write what was recorded since the last flush (one write; nothing when nothing changed)."""
        for key in self._dirty:
            call = self._live[key]
            entry = {"call_id": call.call_id, "leg": call.leg, "seq": call.seq, "ts": call.last_ts}
            self._buf.append("Q " + json.dumps(entry))
        self._dirty.clear()
        if not self._buf:
            return
        data = ("\n".join(self._buf) + "\n").encode("utf-8", "surrogateescape")
        self._lines += len(self._buf)
        self._buf.clear()
        try:
            os.write(self._fd, data)
        except OSError as exc:  # a full disk must not stop the events themselves
            logger.error("call journal write failed: %s", exc)
        if self._lines > max(COMPACT_MIN_LINES, 4 * len(self._live)):
            self._rewrite()

    @property
    def live(self) -> dict[tuple[str, str], LiveCall]:
        """The calls whose call_start was committed and whose call_end was not (yet)."""
        return self._live

    def close(self) -> None:
        self.flush()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # --- internals ---------------------------------------------------------------------------------
    def _rewrite(self) -> None:
        """Replace the file by one S line per live call (tmp + rename: a crash of the process keeps one
        or the other). No fsync: this runs on the event loop, and the journal is not fsynced anyway."""
        path = self.dir / JOURNAL_FILE
        tmp = self.dir / (JOURNAL_FILE + ".tmp")
        data = "".join(f"S {_json(c)}\n" for c in self._live.values()).encode("utf-8", "surrogateescape")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._lines = len(self._live)


def _json(call: LiveCall) -> str:
    return json.dumps(
        {
            "call_id": call.call_id,
            "leg": call.leg,
            "sip_call_id": call.sip_call_id,
            "lang": call.lang,
            "seq": call.seq,
            "ts": call.started_ts,
            "last_ts": call.last_ts,
        },
        ensure_ascii=True,
    )


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def _apply(live: dict[tuple[str, str], LiveCall], line: bytes) -> None:
    """One journal line into the table; a damaged (torn) line changes nothing."""
    kind, _, body = line.rstrip(b"\n").partition(b" ")
    try:
        entry = json.loads(body.decode("utf-8", "surrogateescape"))
        key = (str(entry["call_id"]), str(entry["leg"]))
        if kind == b"S":
            ts = float(entry["ts"])
            live[key] = LiveCall(
                key[0], key[1], str(entry.get("sip_call_id", "")), str(entry.get("lang", "")),
                int(entry["seq"]), ts, float(entry.get("last_ts", ts)),
            )  # fmt: skip
        elif kind == b"Q":
            call = live.get(key)
            if call is not None:
                call.seq, call.last_ts = max(call.seq, int(entry["seq"])), float(entry["ts"])
        elif kind == b"E":
            live.pop(key, None)
    except (ValueError, KeyError, TypeError, AttributeError):
        logger.warning("call journal: skipped a damaged line (%d bytes)", len(line))


def restart_call_end(call: LiveCall, now_ts: float) -> CallEvent:
    """The call_end of a call a previous run left live (`ts` = now; duration up to its last event)."""
    duration_ms = max(0, round((call.last_ts - call.started_ts) * 1000))
    return CallEvent(
        "call_end",
        call.call_id,
        call.sip_call_id,
        leg=call.leg,
        lang=call.lang,
        ts=now_ts,
        extra={"reason": "gateway_restart", "duration_ms": str(duration_ms)},
    )
