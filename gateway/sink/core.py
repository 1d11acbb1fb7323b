"""The sink's pure core: queueing, commit order and seq, the drop policy, the spool, Redis up/down.

Theory of operation
-------------------
An event is first *pending* (in memory, no seq). It is *committed* when it leaves the pending queue,
either into a batch for Redis or into the spool: only then does it get its `seq` (gapless per
call+leg, in commit order), and from then on it is never dropped silently (only a full disk or a
Redis error that will never pass can drop it, both counted and logged).

Where committed records wait, oldest first:  spool (on disk)  <  `committed` (memory: a batch that
failed)  <  pending (not committed yet). Batches are always taken from the oldest place that has
records, so Redis receives every call+leg's records in seq order, and a batch is re-sent whole or
from the record where it stopped. The Lua script on the Redis side refuses any record whose seq is
not above the call+leg's last stored seq, so re-sending (lost reply, replay after a restart, a crash
between XADD and the spool cursor) never duplicates.

Drop policy when Redis is down or slow, in this order:
1. memory over `max_buffered`: every pending partial is dropped (stale by then), reason buffer_full;
2. still over, or Redis down for `spill_after_s`: *spill*: committed records and pending durable
   events go to the spool in order, pending partials are dropped (reason redis_down/buffer_full);
3. while Redis stays down after a spill, new durable events go straight to the spool and new
   partials are dropped (reason redis_down).
A spill waits while a batch from memory is out (it must come back or fail first, to keep order).
While Redis is down, retries carry only records committed already (or are a PING): nothing new is
committed until Redis answers, so partials stay uncommitted and droppable.

Driven by: `publish(ev, now)` (the caller), `poll(now)` (the adapter asks what to do: send a batch,
probe Redis, or nothing until `next_deadline()`), `batch_done`/`batch_failed`/`probe_done` (the
outcome of that action), `shutdown(now)`. No clock, no socket, no task; file I/O only through Spool.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.events import BASE_FIELDS, CallEvent, to_fields
from gateway.sink.journal import CallJournal
from gateway.sink.spool import Record, Spool, SpoolScan

logger = logging.getLogger(__name__)

DROP_REASONS: tuple[str, ...] = ("buffer_full", "redis_down", "shutdown", "spool_full", "rejected", "invalid")

# Redis error replies that pass by themselves (memory, failover, loading, disk): retry later.
# Anything else (WRONGTYPE, a script bug) would fail forever: that record is dropped and counted.
TRANSIENT_ERRORS: tuple[str, ...] = (
    "OOM",
    "READONLY",
    "LOADING",
    "BUSY",
    "MASTERDOWN",
    "TRYAGAIN",
    "NOREPLICAS",
    "MISCONF",
    "CLUSTERDOWN",
)


@dataclass(frozen=True, slots=True)
class SinkConfig:
    max_buffered: int = 20_000  # events in memory before partials are dropped and durables spilled
    batch_max: int = 500  # records per Redis round trip
    spill_after_s: float = 2.0  # Redis down this long: durable events move to the spool
    probe_interval_s: float = 5.0  # PING an idle Redis this often (keeps ttg_redis_up true)
    ended_calls_kept: int = 10_000  # seq counters kept after call_end (for a stray late event)


@dataclass(frozen=True, slots=True)
class SendBatch:
    """Send these records, in order, in one round trip."""

    records: tuple[Record, ...]
    from_spool: bool
    offsets: tuple[int, ...] = ()  # from_spool: the spool offset just past each record


@dataclass(frozen=True, slots=True)
class Probe:
    """Check that Redis answers (PING)."""


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """What Redis did with a batch: per record processed, in order, True = stored now, False = it
    already had it; `error` stopped the batch at record `len(stored)` (nothing after it was tried)."""

    stored: tuple[bool, ...]
    error: str | None = None


Action = SendBatch | Probe


class SinkHooks(Protocol):
    def published(self, type: str, duplicate: bool) -> None: ...
    def dropped(self, type: str, reason: str, n: int = 1) -> None: ...
    def spooled(self, type: str) -> None: ...
    def redis_up(self, up: bool) -> None: ...


class NullSinkHooks:
    def published(self, type: str, duplicate: bool) -> None:
        pass

    def dropped(self, type: str, reason: str, n: int = 1) -> None:
        pass

    def spooled(self, type: str) -> None:
        pass

    def redis_up(self, up: bool) -> None:
        pass


def is_transient(error: str) -> bool:
    return error.split(" ", 1)[0].upper() in TRANSIENT_ERRORS


class SinkCore:
    def __init__(
        self,
        cfg: SinkConfig,
        spool: Spool,
        scan: SpoolScan | None = None,
        hooks: SinkHooks | None = None,
        backoff: Callable[[int], float] = lambda failures: min(5.0, 0.05 * 2**failures),
        journal: CallJournal | None = None,
    ) -> None:
        self.cfg = cfg
        self.spool = spool
        self.journal = journal
        self.hooks: SinkHooks = hooks or NullSinkHooks()
        self._backoff = backoff
        self._pending: deque[CallEvent] = deque()
        self._n_partials = 0
        self._committed: deque[Record] = deque()
        self._inflight: SendBatch | None = None
        # Spooled records keep their seq across a restart: continue after the highest one on disk.
        self._next_seq: dict[tuple[str, str], int] = {
            k: v + 1 for k, v in (scan.max_seq if scan else {}).items()
        }
        # Calls a previous run left live continue after their last committed seq (journal.py).
        for key, call in (journal.live if journal else {}).items():
            self._next_seq[key] = max(self._next_seq.get(key, 1), call.seq + 1)
        self._ended: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._up = False
        self._down_since: float | None = None
        self._failures = 0
        self._retry_at = float("-inf")
        self._last_contact = float("-inf")
        self._closed = False

    # --- state ------------------------------------------------------------------------------------
    @property
    def redis_up(self) -> bool:
        return self._up

    @property
    def in_memory(self) -> int:
        out = len(self._pending) + len(self._committed)
        if self._inflight is not None and not self._inflight.from_spool:
            out += len(self._inflight.records)
        return out

    @property
    def buffered(self) -> int:
        """Events waiting for Redis, in memory or in the spool (ttg_events_buffered)."""
        return self.in_memory + self.spool.pending

    @property
    def degraded(self) -> bool:
        """Redis is not taking events and they no longer fit in memory (readiness). Before the first
        round trip Redis is not known to be down: a spool left by the previous run is being replayed."""
        return (
            not self._up
            and self._down_since is not None
            and (self.spool.pending > 0 or self.in_memory >= self.cfg.max_buffered)
        )

    @property
    def idle(self) -> bool:
        return self.buffered == 0 and self._inflight is None

    def next_seq(self, call_id: str, leg: str) -> int:
        key = (call_id, leg)
        return self._next_seq.get(key) or self._ended.get(key) or 1

    # --- input ------------------------------------------------------------------------------------
    def publish(self, ev: CallEvent) -> None:
        self._publish(ev)
        self._flush_journal()

    def _publish(self, ev: CallEvent) -> None:
        if ev.extra and not set(BASE_FIELDS).isdisjoint(ev.extra):
            logger.error("event of call %s dropped: extra fields overwrite schema fields", ev.call_id)
            self.hooks.dropped(ev.type, "invalid")
            return
        memory_out = self._inflight is not None and not self._inflight.from_spool
        if (self._closed or (not self._up and self.spool.pending)) and not (
            self._pending or self._committed or memory_out
        ):
            # Redis is down and the spool already holds older records (or we are shutting down):
            # durable events join the spool now; a partial would be stale before it could be sent.
            if ev.durable:
                self._to_spool([self._commit(ev)])
            else:
                self.hooks.dropped(ev.type, "shutdown" if self._closed else "redis_down")
            return
        self._pending.append(ev)
        if not ev.durable:
            self._n_partials += 1
        if len(self._pending) + len(self._committed) > self.cfg.max_buffered:
            self._make_room()

    # --- what to do next --------------------------------------------------------------------------
    def poll(self, now: float) -> Action | None:
        action = self._poll(now)
        self._flush_journal()  # before the batch can reach Redis: the journal is never behind it
        return action

    def _poll(self, now: float) -> Action | None:
        if self._inflight is not None:
            return None
        if (
            not self._up
            and self._down_since is not None
            and now - self._down_since >= self.cfg.spill_after_s
            and (self._pending or self._committed)
        ):
            self._spill("redis_down")
        if not self._up and now < self._retry_at:
            return None
        if self.spool.pending:
            records, offsets = self.spool.read_batch(self.cfg.batch_max)
            if records:
                self._inflight = SendBatch(tuple(records), True, tuple(offsets))
                return self._inflight
        # While Redis is down only records already committed are retried (or a PING when there are
        # none): committing more would give stale partials a seq, and so a place in the spool.
        if self._committed or (self._pending and self._up):
            out: list[Record] = []
            while self._committed and len(out) < self.cfg.batch_max:
                out.append(self._committed.popleft())
            while self._up and self._pending and len(out) < self.cfg.batch_max:
                ev = self._pending.popleft()
                if not ev.durable:
                    self._n_partials -= 1
                out.append(self._commit(ev))
            self._inflight = SendBatch(tuple(out), False)
            return self._inflight
        if not self._up or now - self._last_contact >= self.cfg.probe_interval_s:
            return Probe()
        return None

    def next_deadline(self) -> float | None:
        """When `poll` may have something new to do without a new event (None: only on publish)."""
        if self._inflight is not None:
            return None
        if self._up:
            return self._last_contact + self.cfg.probe_interval_s
        deadline = self._retry_at
        if self._down_since is not None and (self._pending or self._committed):
            deadline = min(deadline, self._down_since + self.cfg.spill_after_s)
        return deadline

    # --- outcomes ---------------------------------------------------------------------------------
    def batch_done(self, batch: SendBatch, outcome: BatchOutcome, now: float) -> None:
        assert batch is self._inflight, "outcome of a batch that is not out"
        self._inflight = None
        n = len(outcome.stored)
        for rec, stored in zip(batch.records, outcome.stored, strict=False):
            self.hooks.published(rec.type, duplicate=not stored)
        transient = outcome.error is not None and is_transient(outcome.error)
        if outcome.error is not None and not transient:
            rec = batch.records[n]
            logger.error(
                "Redis refused event %s for good, dropped: %s", rec.fields["event_id"], outcome.error
            )
            self.hooks.dropped(rec.type, "rejected")
            n += 1
        if batch.from_spool:
            if n:
                self.spool.ack(n, batch.offsets[n - 1])
            if n < len(batch.records):
                self.spool.rewind()
        else:
            self._committed.extendleft(reversed(batch.records[n:]))
        if transient:
            logger.warning("Redis refused a write (%s): retrying with backoff", outcome.error)
            self._failed(now)
        else:
            self._contact(now)

    def batch_failed(self, batch: SendBatch, now: float) -> None:
        """No answer (connection lost, timeout, cancelled): Redis may or may not have the records."""
        assert batch is self._inflight, "outcome of a batch that is not out"
        self._inflight = None
        if batch.from_spool:
            self.spool.rewind()
        else:
            self._committed.extendleft(reversed(batch.records))
        self._failed(now)

    def probe_done(self, ok: bool, now: float) -> None:
        if ok:
            self._contact(now)
        else:
            self._failed(now)

    def shutdown(self, now: float) -> None:
        """Stop sending: whatever is still in memory goes to the spool (partials are dropped).
        A batch from memory must have come back (or been failed) first."""
        assert self._inflight is None or self._inflight.from_spool, "a memory batch is still out"
        if self._inflight is not None:
            self.spool.rewind()
            self._inflight = None
        self._closed = True
        self._spill("shutdown")
        self._flush_journal()

    # --- internals --------------------------------------------------------------------------------
    def _commit(self, ev: CallEvent) -> Record:
        key = (ev.call_id, ev.leg)
        seq = self._next_seq.pop(key, None) or self._ended.pop(key, None) or 1
        if ev.type == "call_end":
            # call_end is the last event of a call+leg: keep its counter only for a while, so that the
            # table does not grow with every call (a stray late event still continues the sequence).
            self._ended[key] = seq + 1
            while len(self._ended) > self.cfg.ended_calls_kept:
                self._ended.popitem(last=False)
        else:
            self._next_seq[key] = seq + 1
        rec = Record(to_fields(ev, seq))
        if self.journal is not None:
            self.journal.committed(rec.fields)
        return rec

    def _flush_journal(self) -> None:
        if self.journal is not None:
            self.journal.flush()

    def _make_room(self) -> None:
        if self._n_partials:
            kept: deque[CallEvent] = deque(ev for ev in self._pending if ev.durable)
            self.hooks.dropped("partial", "buffer_full", len(self._pending) - len(kept))
            self._pending = kept
            self._n_partials = 0
        if len(self._pending) + len(self._committed) <= self.cfg.max_buffered:
            return
        if self._inflight is None or self._inflight.from_spool:
            self._spill("buffer_full")
        elif len(self._pending) + len(self._committed) > 2 * self.cfg.max_buffered:
            # A batch from memory is out (the spill must wait for it) and memory is twice over: drop
            # the newest event rather than grow without bound.
            ev = self._pending.pop()
            logger.error(
                "sink memory full while a batch is out: %s event of call %s dropped", ev.type, ev.call_id
            )
            self.hooks.dropped(ev.type, "buffer_full")

    def _spill(self, partial_reason: str) -> None:
        records = list(self._committed)
        self._committed.clear()
        dropped = 0
        for ev in self._pending:
            if ev.durable:
                records.append(self._commit(ev))
            else:
                dropped += 1
        if dropped:
            self.hooks.dropped("partial", partial_reason, dropped)
        self._pending.clear()
        self._n_partials = 0
        if records:
            self._to_spool(records)

    def _to_spool(self, records: list[Record]) -> None:
        try:
            n = self.spool.append(records)
        except OSError as exc:
            logger.error("spool write failed: %s", exc)
            n = 0
        for rec in records[:n]:
            self.hooks.spooled(rec.type)
        if n < len(records):
            logger.error(
                "spool full (%d bytes): %d committed events dropped", self.spool.max_bytes, len(records) - n
            )
            for rec in records[n:]:
                self.hooks.dropped(rec.type, "spool_full")

    def _contact(self, now: float) -> None:
        self._last_contact = now
        self._failures = 0
        self._down_since = None
        if not self._up:
            self._up = True
            self.hooks.redis_up(True)

    def _failed(self, now: float) -> None:
        if self._up or self._down_since is None:
            self._down_since = now
        if self._up:
            self._up = False
            self.hooks.redis_up(False)
        self._failures += 1
        self._retry_at = now + self._backoff(self._failures)
