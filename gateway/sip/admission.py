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

A guard fed by lag alone reacts too late to a ramp: every call offered while the lag builds and its
hold runs is admitted (on the 2-core VM, 200 calls offered at 25 a second, twice its capacity, were all
admitted, and their streams then dropped chunks: docs/benchmarks.md). So the streams the engine is
trusted with are also limited (`ConcurrencyLimit`): the limit opens while the engine keeps up with the
streams it has and its load leaves room, and closes when it falls behind — additive/multiplicative, as
TCP's congestion window and request servers' concurrency limits — and a ramp is admitted at the pace the
engine absorbs it.

The rate limit is a token bucket per source IP (`invite_rate_per_s` sustained, `invite_burst` deep);
idle buckets are forgotten so the table stays bounded under a spoofed-source flood. Every initial
INVITE takes a token before it is authenticated, so a challenge (401) or a refusal (403) costs a
guesser as much as a call.

Password guessing (RFC 3261 §26.1.4 leaves it to the implementation): `auth_max_failures` failed
authentications (wrong password, user or a replay: 403) from one source within
`auth_failure_window_s` ban that source for `auth_ban_s`. While banned, its requests outside a dialog
are dropped unanswered, as a firewall would (an answer would tell a guesser the ban's state and make
the gateway a reflector); calls already up are untouched (in-dialog requests and ACKs pass). The
correct password does not lift a ban, so a dictionary loses its remaining words. Bans and the
failure history are bounded tables like the rate buckets.
"""

from __future__ import annotations

import ipaddress
import math
from collections import OrderedDict, deque
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
    auth_max_failures: int = 5  # failed authentications that ban a source (0 = never ban)
    auth_failure_window_s: float = 60.0
    auth_ban_s: float = 600.0


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


class ConcurrencyLimit:
    """How many streams the engine is trusted with (pure, fed with its lag, its load and the streams up).

    - The lag under `headroom` x `target_s` (the band): the limit grows by `growth` of itself a second
      (at least `min_step` streams a second), scaled by how far the lag is below the band (1 - lag /
      band): it eases into the point where it must hold instead of running into it at full speed, as
      delay-based congestion control does. The lag trails the streams by a second or so; at 10 % a
      second of 1 500 streams, the 150 let in during that second would carry it past the band.
    - Only while the streams up use at least `busy` of it (an unused limit does not grow: it is only
      raised on evidence that the engine keeps up with about that many), and never to more than one
      update's growth above the streams up: the lag and the load tell of the streams up, and a limit
      that led them would let in, before either could answer, every call in its lead (docs/benchmarks.md,
      "The call limit eased toward the lag's band").
    - At first it grows by `start_growth` of itself a second instead (doubling, as TCP's slow start
      opens its window before the first loss), up to the streams at which the load would reach half of
      `max_load` as one stream adds to it now: an accelerator whose capacity is thousands of streams
      would otherwise refuse most of a minute of calls while the limit opened from `floor` at `growth`
      (from 32 to 2 000 at 10 % a second: 43 s). A stream's share of the load is the load over the
      streams up `load_delay_s` before, not now: the load trails the streams let in (their audio, then
      the rate's window), and the streams up now would make each look cheaper than it is. The share is
      measured again at every update, and while the limit is at or past the streams it allows, the limit
      grows at `growth`: a reading taken while the streams doubled (a load that trailed them by less than
      `load_delay_s`, a slope fitted on a few steps) may put the room far too low, and must only pause
      the start, not end it. The start ends for good once the load reaches half of `max_load`, the lag
      has stayed at half of the growth band or more for `start_lag_hold_s`, or the limit is cut. A lag
      that high for less pauses it (growth at `growth`, eased): one stall shows in the lag for as long
      as its window (the largest of the last one to two seconds), and a stall while a few dozen streams
      are up says nothing of the engine's capacity (docs/benchmarks.md, "the fast start ended by one
      stall"). Without a load bound (`max_load` 0), or before a stream's share is known (the load
      measured, `floor` / 2 streams up long enough), the limit grows at `growth`.
    - Nor while the engine's `load` (its utilisation by the rows coming in, `EncoderScheduler.load`)
      is at `max_load` or more: the load rises with the streams as they are admitted, where the lag
      shows an engine past its capacity only after the queues have grown, and an engine that takes
      each stream for minutes cannot shed the excess it let in (docs/benchmarks.md, "A slower ramp
      past capacity"). `max_load` 0: the lag alone.
    - The lag between that and `target_s`: the limit holds. The lag trails the streams that cause it
      (it is the largest over the last second or two, and a queue takes a while to build), so a limit
      that grew until the lag reached the target would have let in, meanwhile, the streams that take
      it past the target.
    - The lag over `target_s`: the limit drops to `backoff` x the streams up, at most once per
      `cooldown_s` (the lag answers a cut with a delay too).
    - Always within [`floor`, `ceiling`]; it starts at `floor`. `target_s` 0 turns it off (the limit is
      the ceiling)."""

    def __init__(
        self,
        target_s: float,
        floor: int,
        ceiling: int,
        *,
        growth: float = 0.1,
        start_growth: float = 1.0,
        load_delay_s: float = 2.0,
        start_lag_hold_s: float = 3.0,
        min_step: float = 2.0,
        busy: float = 0.8,
        headroom: float = 0.5,
        max_load: float = 0.0,
        backoff: float = 0.9,
        cooldown_s: float = 2.0,
    ) -> None:
        self.target_s = target_s
        self.floor = max(1, min(floor, ceiling))
        self.ceiling = ceiling
        self.growth, self.start_growth, self.load_delay_s = growth, start_growth, load_delay_s
        self.start_lag_hold_s = start_lag_hold_s
        self.min_step, self.busy, self.backoff = min_step, busy, backoff
        self.headroom, self.max_load = headroom, max_load
        self.cooldown_s = cooldown_s
        self.value = float(self.floor if target_s > 0 else ceiling)
        self._at: float | None = None  # the last update
        self._cut_at = -math.inf
        self.starting = max_load > 0  # the start's fast growth (see above) still possible
        self._lag_high_since: float | None = None  # the lag at half the band or more since then
        self._history: deque[tuple[float, int]] = deque()  # (when, streams up) over `load_delay_s`

    @property
    def limit(self) -> int:
        return int(self.value)

    def update(self, lag_s: float, streams: int, now: float, load: float = 0.0) -> None:
        """The engine's latest lag and load, and the streams up now."""
        dt = 0.0 if self._at is None else max(0.0, now - self._at)
        self._at = now
        if self.target_s <= 0:
            return
        band = self.headroom * self.target_s
        per_stream = self._load_per_stream(load, streams, now)
        lag_high = lag_s >= band / 2
        if not lag_high:
            self._lag_high_since = None
        elif self._lag_high_since is None:
            self._lag_high_since = now
        if self.starting and (
            load >= self.max_load / 2
            or (self._lag_high_since is not None and now - self._lag_high_since >= self.start_lag_hold_s)
        ):
            self.starting = False  # near enough to what the engine takes: from here `growth` a second
        if lag_s > self.target_s:
            self.starting = False
            if now - self._cut_at >= self.cooldown_s:
                self.value = max(float(self.floor), min(self.value, self.backoff * streams))
                self._cut_at = now
        elif (
            lag_s < band
            and (self.max_load <= 0 or load < self.max_load)
            and streams >= self.busy * self.value
        ):
            ease = 1.0 - lag_s / band
            value = self.value + max(self.min_step, self.growth * self.value) * dt * ease
            if self.starting and per_stream is not None and not lag_high:
                room = self.max_load / 2 / per_stream  # the streams that would bring half the bound
                fast = self.value + max(self.min_step, self.start_growth * self.value) * dt
                value = max(value, min(fast, room))  # room below the limit: `growth` (a pause)
            # One step above the streams up at most (a full limit: one step above itself).
            base = self.value if streams >= self.limit else float(streams)
            value = min(value, base + (value - self.value))
            self.value = max(self.value, min(float(self.ceiling), value))

    def _load_per_stream(self, load: float, streams: int, now: float) -> float | None:
        """The load one stream brings: the load now over the streams up `load_delay_s` ago (None until
        the load is measured and at least `floor` / 2 streams were up that long ago)."""
        self._history.append((now, streams))
        while len(self._history) > 1 and self._history[1][0] <= now - self.load_delay_s:
            self._history.popleft()
        then, before = self._history[0]
        if then > now - self.load_delay_s or load <= 0 or before < self.floor / 2:
            return None
        return load / before


class Admission:
    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._networks: tuple[IpNetwork, ...] = tuple(
            ipaddress.ip_network(c, strict=False) for c in config.allow_cidrs
        )
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # ip -> (tokens, at)
        self._failures: OrderedDict[str, list[float]] = OrderedDict()  # ip -> recent failure times
        self._bans: OrderedDict[str, float] = OrderedDict()  # ip -> banned until
        self.draining = False
        self.overload: OverloadGuard | None = None  # set by whoever watches the engine
        self.limit: ConcurrencyLimit | None = None  # likewise

    def source_allowed(self, ip: str) -> bool:
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            return False
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        return any(addr.version == net.version and addr in net for net in self._networks)

    def rate_limit(self, ip: str, now: float) -> Decision:
        """Take a token for an initial INVITE from `ip` (before authentication)."""
        cfg = self.config
        if cfg.invite_rate_per_s > 0:
            wait = self._take_token(ip, now)
            if wait > 0:
                return Decision(503, "Rate Limited", max(1, math.ceil(wait)), "rejected_rate")
        return ADMIT

    def admit_invite(self, active_calls: int) -> Decision:
        """An initial INVITE that passed every check, while `active_calls` are up."""
        cfg = self.config
        if self.draining:
            return Decision(503, "Draining", cfg.retry_after_s, "rejected_draining")
        if active_calls >= cfg.max_calls:
            return Decision(503, "Too Many Calls", cfg.retry_after_s, "rejected_capacity")
        if self.overload is not None and self.overload.overloaded:
            return Decision(503, "Transcription Overloaded", self.overload.retry_after_s, "rejected_overload")
        if self.limit is not None and active_calls >= self.limit.limit:
            return Decision(503, "Transcription At Its Limit", cfg.retry_after_s, "rejected_limit")
        return ADMIT

    # --- password guessing ---

    def banned(self, ip: str, now: float) -> bool:
        until = self._bans.get(ip)
        if until is None:
            return False
        if now < until:
            return True
        del self._bans[ip]
        return False

    def auth_failed(self, ip: str, now: float) -> tuple[int, bool]:
        """Record a failed authentication from `ip`: (failures in the window, whether a ban began)."""
        cfg = self.config
        window = [t for t in self._failures.pop(ip, []) if now - t < cfg.auth_failure_window_s]
        window.append(now)
        count = len(window)
        if cfg.auth_max_failures and cfg.auth_ban_s > 0 and count >= cfg.auth_max_failures:
            self._bans[ip] = now + cfg.auth_ban_s
            self._bans.move_to_end(ip)
            while len(self._bans) > cfg.max_tracked_sources:
                self._bans.popitem(last=False)
            return count, True
        self._failures[ip] = window[-max(1, cfg.auth_max_failures) :]
        while len(self._failures) > cfg.max_tracked_sources:
            self._failures.popitem(last=False)
        return count, False

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
