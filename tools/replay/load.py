"""Call arrivals as a pure core: a concurrency target (optionally ramped), a rate cap, and a stop rule.

`due(now, active)` says how many calls to start now; `next_deadline(now, active)` when to ask again
(None: only when a call ends). Calls are spaced by 1/cps at most; a start delayed by the concurrency
cap does not bank rate for a burst later.
"""

from __future__ import annotations

import math

from tools.replay.config import LoadConfig


class LoadShape:
    def __init__(self, cfg: LoadConfig, t_start: float) -> None:
        self.cfg = cfg
        self.t_start = t_start
        self.started = 0
        self._next_allowed = t_start
        self.total: int | None = (
            cfg.total if cfg.total is not None else (None if cfg.duration_s else cfg.calls)
        )
        self.stop_at = t_start + cfg.duration_s if cfg.duration_s else None

    def target(self, now: float) -> int:
        """Concurrency allowed at `now`: from 1 up to `calls` linearly over the ramp."""
        calls = self.cfg.calls
        if self.cfg.ramp_s <= 0 or calls == 1:
            return calls
        frac = min(1.0, max(0.0, (now - self.t_start) / self.cfg.ramp_s))
        return min(calls, 1 + math.floor((calls - 1) * frac + 1e-9))

    def accepting(self, now: float) -> bool:
        if self.total is not None and self.started >= self.total:
            return False
        return self.stop_at is None or now < self.stop_at

    def due(self, now: float, active: int) -> int:
        n = 0
        target = self.target(now)
        while self.accepting(now) and active + n < target and now >= self._next_allowed:
            n += 1
            self.started += 1
            gap = 1.0 / self.cfg.cps
            # Keep the grid when a start is only a little late (timer wake-up); restart it after a
            # longer wait so no rate is banked.
            base = self._next_allowed if now - self._next_allowed < gap else now
            self._next_allowed = base + gap
        return n

    def next_deadline(self, now: float, active: int) -> float | None:
        if not self.accepting(now):
            return None
        target = self.target(now)
        if active < target:
            t = max(self._next_allowed, now)
        elif target < self.cfg.calls:
            t = self.t_start + self.cfg.ramp_s * target / (self.cfg.calls - 1)  # the next ramp step
        else:
            t = math.inf  # wait for a call to end
        if self.stop_at is not None:
            t = min(t, self.stop_at)
        return None if math.isinf(t) else t
