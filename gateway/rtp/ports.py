"""RTP/RTCP port pairs from a configured range (pure bookkeeping; binding is the adapter's job).

RFC 3550 §11: RTP on an even port, RTCP on the next (odd) one. Free pairs are handed out least recently
used first, and a released pair rests for `quarantine_s` before reuse, so that late packets of an
ended call do not land in the next call on that port.
"""

from __future__ import annotations

from collections import deque


class PortsExhausted(RuntimeError):
    """Every pair in the range is in use or resting: the caller should refuse the call (503)."""


def rtp_pair_ports(port_min: int, port_max: int) -> range:
    """The RTP ports of the range's pairs: each even port whose RTCP port (the next) is in the range too."""
    return range(port_min + (port_min & 1), port_max, 2)


class PortPool:
    def __init__(self, port_min: int, port_max: int, *, quarantine_s: float = 2.0) -> None:
        ports = rtp_pair_ports(port_min, port_max)
        if not ports:
            raise ValueError(f"RTP port range {port_min}-{port_max} holds no even/odd pair")
        self.port_min = ports.start
        self.port_max = port_max
        self.quarantine_s = quarantine_s
        # (port, free since); released pairs go to the back, so the front is the longest rested.
        self._free: deque[tuple[int, float]] = deque((p, float("-inf")) for p in ports)
        self._in_use: set[int] = set()

    @property
    def capacity(self) -> int:
        return len(self._free) + len(self._in_use)

    @property
    def in_use(self) -> int:
        return len(self._in_use)

    def available(self, now: float) -> int:
        return sum(1 for _, since in self._free if now >= since + self.quarantine_s)

    def acquire(self, now: float) -> int:
        """An even RTP port whose pair (port, port+1) is free and rested."""
        if not self._free or now < self._free[0][1] + self.quarantine_s:
            raise PortsExhausted(
                f"no free RTP port pair in {self.port_min}-{self.port_max} "
                f"({len(self._in_use)} in use, {len(self._free)} resting)"
            )
        port, _ = self._free.popleft()
        self._in_use.add(port)
        return port

    def release(self, port: int, now: float) -> None:
        if port not in self._in_use:
            raise ValueError(f"port {port} is not allocated")
        self._in_use.discard(port)
        self._free.append((port, now))
