"""A jitter buffer for one RTP source, keyed by extended sequence number (pure; `now` injected).

Tuned for ASR rather than for playback: nothing is played on a clock, so there is no reason to hold
packets that are in order. The policy:

- Priming: the first packet opens a window of `delay` seconds; earlier sequence numbers arriving in it
  go in front (so a reordered first packet is not lost). Release starts at the end of the window.
- In-order packets are released at once (the common case: one dict-free comparison).
- A gap (a later packet arrived, the next expected one has not) waits until `delay` after the first
  packet behind it arrived; then the missing sequence numbers are declared lost and release continues.
- A packet whose sequence number was already released is a duplicate. One whose number was declared
  lost is late; the caller drops it (its audio was concealed).
- More than `capacity` waiting packets give up the oldest gap at once (bounds memory under attack).

Loss bookkeeping follows RFC 3550 App. A.1's MAX_MISORDER: a declared-lost number stays "pending"
(it may still arrive late, which un-counts it) until the highest number seen is 100 past it; then it is
settled. `flush()` (end of source) settles everything.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

from gateway.rtp.seq import MAX_MISORDER

T = TypeVar("T")

RELEASED = 0
BUFFERED = 1
DUPLICATE = 2
LATE = 3


class JitterBuffer(Generic[T]):
    __slots__ = (
        "_buf",
        "_first",
        "_gap_since",
        "_highest",
        "_lost_order",
        "_lost_set",
        "_next",
        "_prime_until",
        "capacity",
        "delay",
        "lost",
    )

    def __init__(self, delay: float, capacity: int = 256) -> None:
        if delay < 0:
            raise ValueError("delay must be >= 0")
        self.delay = delay
        self.capacity = capacity
        self.lost = 0  # settled losses, cumulative over resets
        self._buf: dict[int, tuple[T, float]] = {}
        self._next: int | None = None
        self._first: int | None = None
        self._prime_until: float | None = None
        self._gap_since: float | None = None
        self._highest: int | None = None
        self._lost_order: deque[int] = deque()
        self._lost_set: set[int] = set()

    # --- input -----------------------------------------------------------------------------------

    def push(self, seq: int, item: T, now: float, out: list[T]) -> int:
        """Offer a packet; released items are appended to `out` in sequence order. Returns a status."""
        if self._highest is None or seq > self._highest:
            self._highest = seq
            if self._lost_order:
                self._settle()
        nxt = self._next
        if nxt is None:  # priming
            if seq in self._buf:
                return DUPLICATE
            self._buf[seq] = (item, now)
            if self._prime_until is None:
                self._prime_until = now + self.delay
            if self.delay == 0:
                self._start(out)
            return BUFFERED
        if seq < nxt:
            if seq in self._lost_set:
                self._lost_set.discard(seq)
                return LATE
            if self._first is not None and seq < self._first:
                return LATE  # older than where release started
            return DUPLICATE
        if seq == nxt and not self._buf:
            out.append(item)
            self._next = nxt + 1
            return RELEASED
        if seq in self._buf:
            return DUPLICATE
        self._buf[seq] = (item, now)
        if seq == nxt:
            self._release_run(out)
            return RELEASED
        if self._gap_since is None:
            self._gap_since = now
        if len(self._buf) > self.capacity:
            self._skip_gap(out)
        return BUFFERED

    def handle_timer(self, now: float, out: list[T]) -> None:
        if self._next is None:
            if self._prime_until is not None and now >= self._prime_until:
                self._start(out)
            return
        while self._gap_since is not None and now >= self._gap_since + self.delay:
            self._skip_gap(out)

    def next_deadline(self) -> float | None:
        if self._next is None:
            return self._prime_until
        return None if self._gap_since is None else self._gap_since + self.delay

    def flush(self, out: list[T]) -> None:
        """Release everything (end of source or of the call); gaps between waiting packets are lost."""
        if self._next is None and self._buf:
            self._start(out)
        while self._buf:
            self._skip_gap(out)
        self.lost += len(self._lost_set)
        self._lost_set.clear()
        self._lost_order.clear()

    def reset(self) -> None:
        """Forget the source (after `flush`): the next packet primes a new one. Counters are kept."""
        self._buf.clear()
        self._next = self._first = self._prime_until = self._gap_since = self._highest = None
        self.lost += len(self._lost_set)
        self._lost_set.clear()
        self._lost_order.clear()

    # --- state -----------------------------------------------------------------------------------

    @property
    def lost_total(self) -> int:
        """Settled plus pending losses (pending ones may still turn into late packets)."""
        return self.lost + len(self._lost_set)

    @property
    def idle(self) -> bool:
        """Nothing waiting and not priming: everything received so far has been released."""
        return not self._buf

    def __len__(self) -> int:
        return len(self._buf)

    # --- internals -------------------------------------------------------------------------------

    def _start(self, out: list[T]) -> None:
        self._next = self._first = min(self._buf)
        self._prime_until = None
        self._release_run(out)

    def _release_run(self, out: list[T]) -> None:
        buf = self._buf
        nxt = self._next
        assert nxt is not None
        while nxt in buf:
            out.append(buf.pop(nxt)[0])
            nxt += 1
        self._next = nxt
        self._gap_since = min(arrival for _, arrival in buf.values()) if buf else None

    def _skip_gap(self, out: list[T]) -> None:
        nxt = self._next
        assert nxt is not None
        lowest = min(self._buf)
        for seq in range(nxt, lowest):
            self._lost_order.append(seq)
            self._lost_set.add(seq)
        self._next = lowest
        self._release_run(out)

    def _settle(self) -> None:
        assert self._highest is not None
        horizon = self._highest - MAX_MISORDER
        order = self._lost_order
        while order and order[0] < horizon:
            seq = order.popleft()
            if seq in self._lost_set:
                self._lost_set.discard(seq)
                self.lost += 1
