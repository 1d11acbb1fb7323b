"""Who may call, and how many (pure): source allow-list, per-source INVITE rate, the call cap, draining.

Decisions are SIP answers:
- a source outside `allow_cidrs` → 403 Forbidden for every request (ACKs are dropped, never answered);
- draining or `max_calls` reached → 503 Service Unavailable + Retry-After (RFC 3261 §21.5.4);
- a source over its INVITE rate → also 503 + Retry-After (the seconds until its bucket refills).
  Why 503 and not 429: SIP's 429 is "Provide Referrer Identity" (RFC 3892), and 503 + Retry-After is
  what SIP overload control builds on (RFC 7339); a proxy in front retries another gateway.
  Silence (dropping) would make callers retransmit for 32 s and look like a hang.

Overload (`OverloadGuard`, fed with the ASR engine's measured lag): once the engine has run further
behind than `max_lag_s` for two seconds (the time from a chunk's audio arriving to its decoding, the
largest over the last second or two), new INVITEs get 503 with a Retry-After of twice the lag (1-60 s),
until the lag is back under half the bound. Calls already admitted keep their audio: the point is to
stop adding load before the engine's queues start dropping chunks of calls in progress.

The rate limit is a token bucket per source IP (`invite_rate_per_s` sustained, `invite_burst` deep);
idle buckets are forgotten so the table stays bounded under a spoofed-source flood.
"""

from __future__ import annotations

import ipaddress
import math
from collections import OrderedDict
from dataclasses import dataclass

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    max_calls: int = 200
    allow_cidrs: tuple[str, ...] = ("0.0.0.0/0", "::/0")
    invite_rate_per_s: float = 0.0  # 0 = no rate limit
    invite_burst: int = 10
    retry_after_s: int = 5
    max_tracked_sources: int = 10_000


@dataclass(frozen=True, slots=True)
class Decision:
    status: int  # 0 = admitted
    reason: str = ""
    retry_after_s: int | None = None
    label: str = "admitted"  # ttg_calls_total{result=...}

    @property
    def admitted(self) -> bool:
        return self.status == 0


ADMIT = Decision(0)


class OverloadGuard:
    """Whether the engine is too far behind to take new calls: on once the lag stayed above
    `max_lag_s` for `hold_s` (a one-off stall is not overload), off once it is below half of it.
    `max_lag_s` 0 disables it."""

    def __init__(self, max_lag_s: float, hold_s: float = 2.0) -> None:
        self.max_lag_s = max_lag_s
        self.hold_s = hold_s
        self.overloaded = False
        self.lag_s = 0.0
        self._above_since: float | None = None

    def update(self, lag_s: float, now: float) -> bool:
        """The engine's latest lag; True when `overloaded` changed."""
        self.lag_s = lag_s
        was = self.overloaded
        if self.max_lag_s <= 0:
            self.overloaded = False
        elif lag_s > self.max_lag_s:
            if self._above_since is None:
                self._above_since = now
            if now - self._above_since >= self.hold_s:
                self.overloaded = True
        else:
            self._above_since = None
            if lag_s < self.max_lag_s / 2:
                self.overloaded = False
        return was != self.overloaded

    @property
    def retry_after_s(self) -> int:
        return max(1, min(60, math.ceil(2 * self.lag_s)))


class Admission:
    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._networks: tuple[IpNetwork, ...] = tuple(
            ipaddress.ip_network(c, strict=False) for c in config.allow_cidrs
        )
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # ip -> (tokens, at)
        self.draining = False
        self.overload: OverloadGuard | None = None  # set by whoever watches the engine

    def source_allowed(self, ip: str) -> bool:
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            return False
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        return any(addr.version == net.version and addr in net for net in self._networks)

    def admit_invite(self, ip: str, active_calls: int, now: float) -> Decision:
        """An initial INVITE from `ip` while `active_calls` are up. Consumes a rate token when admitted."""
        cfg = self.config
        if self.draining:
            return Decision(503, "Draining", cfg.retry_after_s, "rejected_draining")
        if active_calls >= cfg.max_calls:
            return Decision(503, "Too Many Calls", cfg.retry_after_s, "rejected_capacity")
        if self.overload is not None and self.overload.overloaded:
            return Decision(503, "Transcription Overloaded", self.overload.retry_after_s, "rejected_overload")
        if cfg.invite_rate_per_s > 0:
            wait = self._take_token(ip, now)
            if wait > 0:
                return Decision(503, "Rate Limited", max(1, math.ceil(wait)), "rejected_rate")
        return ADMIT

    def _take_token(self, ip: str, now: float) -> float:
        """0 when a token was taken, else the seconds until one is available."""
        cfg = self.config
        tokens, at = self._buckets.pop(ip, (float(cfg.invite_burst), now))
        tokens = min(float(cfg.invite_burst), tokens + (now - at) * cfg.invite_rate_per_s)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / cfg.invite_rate_per_s
        self._buckets[ip] = (tokens, now)
        # Forget the least recently seen sources first (their buckets would be full again by now).
        while len(self._buckets) > cfg.max_tracked_sources:
            self._buckets.popitem(last=False)
        return wait
