"""The spool: an append-only file of committed events waiting for Redis, replayed in order.

File `events.spool`, one record per line: `<crc32 of the JSON, 8 hex digits> <JSON of the XADD hash>\\n`
(UTF-8, JSON escapes keep every record on one line). `events.pos` holds the byte offset of the first
record not yet acknowledged by Redis (written by rename, so it is atomic).

Durability (docs/events.md "Spool"):
- A record is written with one `write()` to an O_APPEND descriptor when it is committed: it survives a
  crash of the process (the kernel has it) at once.
- `sync()` (fdatasync) makes it survive a crash of the host; the publisher calls it at most every
  `fsync_interval_s` while records are being written, off the event loop, and on close.
- The cursor is not synced: a stale cursor only replays records Redis already has, and the
  publisher's Lua script refuses those (per call+leg sequence guard), so replay never duplicates.

Startup (`Spool.open`) checks every line: a torn last line (a crash in the middle of a write) and a
line whose CRC or JSON is wrong are skipped and counted, never fatal. When anything was skipped or the
cursor is past the start, the records still to replay are rewritten into a fresh file (tmp + fsync +
rename), so new appends never follow a torn line and reading never meets a bad one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

SPOOL_FILE = "events.spool"
CURSOR_FILE = "events.pos"


@dataclass(frozen=True, slots=True)
class Record:
    """A committed event: its seq is assigned and its XADD hash fixed for good."""

    fields: dict[str, str]

    @property
    def type(self) -> str:
        return self.fields["type"]

    @property
    def call_id(self) -> str:
        return self.fields["call_id"]

    @property
    def leg(self) -> str:
        return self.fields["leg"]

    @property
    def seq(self) -> int:
        return int(self.fields["seq"])


@dataclass(slots=True)
class SpoolScan:
    """What `Spool.open` found on disk."""

    pending: int = 0  # records still to replay
    corrupt: int = 0  # lines skipped: torn tail, bad CRC, bad JSON, not a record
    max_seq: dict[tuple[str, str], int] = field(default_factory=dict)  # per (call_id, leg), all records


def encode_record(rec: Record) -> bytes:
    body = json.dumps(rec.fields, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return b"%08x %s\n" % (zlib.crc32(body), body)


def decode_line(line: bytes) -> Record | None:
    """A record from one complete line (with its newline), or None when the line is damaged."""
    if len(line) < 11 or line[8:9] != b" " or not line.endswith(b"\n"):
        return None
    body = line[9:-1]
    try:
        if int(line[:8], 16) != zlib.crc32(body):
            return None
        fields = json.loads(body.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(fields, dict) or not all(isinstance(v, str) for v in fields.values()):
        return None
    try:
        rec = Record(fields)
        _ = (rec.type, rec.call_id, rec.leg, rec.seq)
    except (KeyError, ValueError):
        return None
    return rec


class Spool:
    """Append-only record file with a replay cursor. Single-threaded: the event loop owns it
    (only `sync()` may run on another thread)."""

    def __init__(
        self, directory: Path, max_bytes: int, fd: int, size: int, cursor: int, pending: int
    ) -> None:
        self.dir = directory
        self.max_bytes = max_bytes
        self._fd = fd
        self._size = size  # bytes in the file
        self._cursor = cursor  # offset of the first record not acknowledged
        self._pending = pending  # records from the cursor to the end
        self._read_offset = cursor  # where the next read_batch starts (>= cursor while a batch is out)
        self._unsynced = False

    # --- opening and the startup check ------------------------------------------------------------
    @classmethod
    def open(cls, directory: str | os.PathLike[str], max_bytes: int = 1 << 30) -> tuple[Spool, SpoolScan]:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        path = d / SPOOL_FILE
        scan = SpoolScan()
        existed = path.exists()
        size = path.stat().st_size if existed else 0
        cursor = _read_cursor(d / CURSOR_FILE)
        if cursor > size:  # a crash between truncating the file and writing the cursor
            cursor = 0
        if existed:
            offset = 0
            with path.open("rb") as f:
                for line in f:
                    rec = decode_line(line)
                    if rec is None:
                        scan.corrupt += 1
                        logger.warning(
                            "spool %s: skipped a damaged record at byte %d (%d bytes)",
                            path,
                            offset,
                            len(line),
                        )
                    else:
                        key = (rec.call_id, rec.leg)
                        scan.max_seq[key] = max(scan.max_seq.get(key, 0), rec.seq)
                        if offset >= cursor:
                            scan.pending += 1
                    offset += len(line)
        if scan.corrupt or cursor > 0:
            # Keep only the whole records still to replay. The cursor goes to 0 before the rename: a
            # crash in between replays the old file from its start, which the Redis guard makes harmless.
            tmp = d / (SPOOL_FILE + ".tmp")
            with path.open("rb") as src, tmp.open("wb") as dst:
                offset = 0
                for line in src:
                    if offset >= cursor and decode_line(line) is not None:
                        dst.write(line)
                    offset += len(line)
                dst.flush()
                os.fsync(dst.fileno())
            _write_cursor(d / CURSOR_FILE, 0)
            os.replace(tmp, path)
            _fsync_dir(d)
            cursor = 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        if not existed:
            _fsync_dir(d)
        size = os.fstat(fd).st_size
        if scan.pending or scan.corrupt:
            logger.info(
                "spool %s: %d records to replay, %d damaged skipped", path, scan.pending, scan.corrupt
            )
        return cls(d, max_bytes, fd, size, cursor, scan.pending), scan

    # --- writing ----------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Records written and not yet acknowledged by Redis."""
        return self._pending

    @property
    def size(self) -> int:
        return self._size

    def append(self, records: list[Record]) -> int:
        """Append records in order; returns how many fit under `max_bytes` (the rest are not written)."""
        data = bytearray()
        n = 0
        for rec in records:
            line = encode_record(rec)
            if self._size + len(data) + len(line) > self.max_bytes:
                break
            data += line
            n += 1
        if data:
            written = os.write(self._fd, data)
            if written != len(data):  # a short write (disk full): never leave a torn line behind
                os.ftruncate(self._fd, self._size)
                raise OSError(f"spool: short write ({written} of {len(data)} bytes)")
            self._size += len(data)
            self._pending += n
            self._unsynced = True
        return n

    @property
    def unsynced(self) -> bool:
        return self._unsynced

    def sync(self) -> None:
        """fdatasync what was written (safe to call from a worker thread)."""
        self._unsynced = False
        fd = os.dup(self._fd)  # the loop may close or truncate meanwhile; a dup keeps this call valid
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)

    # --- replay -----------------------------------------------------------------------------------
    def read_batch(self, max_records: int) -> tuple[list[Record], list[int]]:
        """The next records after those already handed out, with the offset just past each one."""
        records: list[Record] = []
        offsets: list[int] = []
        end = self._read_offset
        with (self.dir / SPOOL_FILE).open("rb") as f:
            f.seek(self._read_offset)
            while len(records) < max_records:
                line = f.readline()
                if not line.endswith(b"\n"):
                    break  # end of file (append always writes whole lines)
                end += len(line)
                rec = decode_line(line)
                if rec is not None:  # cannot be damaged after the startup check; be safe anyway
                    records.append(rec)
                    offsets.append(end)
        self._read_offset = end
        if not records and self._read_offset == self._cursor and self._pending:
            # Nothing readable is left although records are counted as pending (only a damaged file
            # could do this): stop counting them, or the sink would wait for them forever.
            logger.error("spool %s: %d pending records are not readable; forgotten", self.dir, self._pending)
            self._pending = 0
        return records, offsets

    def rewind(self) -> None:
        """The records handed out were not stored: hand them out again next time."""
        self._read_offset = self._cursor

    def ack(self, n_records: int, end_offset: int) -> None:
        """Redis has the first `n_records` records handed out, which end at `end_offset`."""
        self._cursor = end_offset
        self._read_offset = max(self._read_offset, end_offset)
        self._pending -= n_records
        if self._pending <= 0 and self._cursor >= self._size:
            # Everything replayed: start an empty file. Truncate first; a crash between the two steps
            # leaves a cursor past the end, which open() treats as "replay everything" (= nothing).
            os.ftruncate(self._fd, 0)
            self._size = self._cursor = self._read_offset = self._pending = 0
        _write_cursor(self.dir / CURSOR_FILE, self._cursor)

    def iter_pending(self) -> Iterator[Record]:
        """Every record still to replay (for tests and tools)."""
        with (self.dir / SPOOL_FILE).open("rb") as f:
            f.seek(self._cursor)
            for line in f:
                rec = decode_line(line)
                if rec is not None:
                    yield rec

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.fdatasync(self._fd)
            os.close(self._fd)
            self._fd = -1


def _read_cursor(path: Path) -> int:
    try:
        return max(0, int(path.read_text().strip() or "0"))
    except (OSError, ValueError):
        return 0


def _write_cursor(path: Path, offset: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{offset}\n")
    os.replace(tmp, path)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
