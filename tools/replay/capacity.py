"""`--find-capacity`: raise concurrency until p95 time-to-final exceeds a bound, report the highest
concurrency that held.

The bound defaults to the single-call p95 + 300 ms (how the published Rust/MLX server measured its
"concurrent live calls, p95 latency within +300 ms of 1 call"). Levels double from 1 until one fails,
then bisect between the last good and the first bad level down to `resolution` calls. A level holds
when every call completed and p95 TTF ≤ bound, where an utterance that never got a final counts as
infinitely late (so more than 5 % missing finals fails the level, as it should).

Each level starts from a quiet gateway: with a /metrics URL, the search first waits (bounded) until no
call is up and the engine is not refusing calls for lag. A level right after an overloaded one would
otherwise meet the overload guard still on (it clears a second or two after the engine catches up) and
fail on 503s that the level itself did not cause.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from tools.replay import audio, plots, report
from tools.replay.analysis import p95_nearest_rank
from tools.replay.config import DEFAULT_SETTLE_S, ReplayConfig
from tools.replay.report import CapacityLevel, CapacityReport, Report
from tools.replay.runner import ReplayError, run_replay_async, write_report
from tools.replay.scrape import SCRAPE_ERRORS, fetch_series

logger = logging.getLogger(__name__)

DEFAULT_MARGIN_S = 0.3
SETTLE_SERIES = ("ttg_active_calls", "ttg_engine_overloaded")


def settled(series: dict[str, float]) -> bool:
    """No call up and new calls not refused for the engine's lag. A series the gateway does not export
    does not hold a level back."""
    return not series.get("ttg_active_calls", 0.0) and not series.get("ttg_engine_overloaded", 0.0)


async def wait_until_settled(
    metrics_url: str,
    timeout_s: float,
    *,
    poll_s: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[bool, float]:
    """Poll `metrics_url` until the gateway is `settled`; (settled, seconds waited). An unreadable
    /metrics ends the wait at once (the run's own scraper says so); `timeout_s` bounds it."""
    t0 = clock()
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                series = await fetch_series(session, metrics_url, 2.0, SETTLE_SERIES)
            except SCRAPE_ERRORS:
                return False, clock() - t0
            if settled(series):
                return True, clock() - t0
            if clock() - t0 >= timeout_s:
                return False, clock() - t0
            await asyncio.sleep(poll_s)


def p95_with_missing(rep: Report) -> float:
    """p95 TTF over utterances of completed calls, a missing final counted as +inf."""
    p95 = p95_nearest_rank(
        math.inf if u.ttf_s is None else u.ttf_s
        for c in rep.calls
        if c.outcome == "completed"
        for u in c.utterances
    )
    return math.inf if p95 is None else float(p95)


def judge(rep: Report, bound_s: float) -> tuple[bool, str]:
    s = rep.summary
    if s.completed != s.calls:
        return False, f"{s.calls - s.completed} of {s.calls} calls not completed"
    p95 = p95_with_missing(rep)
    if math.isinf(p95):
        return False, f"{s.utterances_without_final or 0} of {s.utterances} utterances without a final"
    if p95 > bound_s:
        # The report's p95 column is over the finals that came (interpolated); this one is by nearest
        # rank with the missing ones as late, which can put it well above the column: say how many.
        missing = s.utterances_without_final or 0
        late = f" ({missing} of {s.utterances} utterances without a final, counted as late)"
        return False, f"p95 {p95 * 1000:.0f} ms > bound{late if missing else ''}"
    return True, ""


def next_level(good: int, bad: int | None, max_calls: int, resolution: int) -> int | None:
    """Doubling until the first bad level, then bisection; None when done."""
    if bad is None:
        n = min(good * 2, max_calls)
        return n if n > good else None
    if bad - good <= resolution:
        return None
    return (good + bad) // 2


async def find_capacity_async(
    cfg: ReplayConfig,
    library: audio.AudioLibrary,
    *,
    bound_s: float | None = None,
    margin_s: float = DEFAULT_MARGIN_S,
    max_calls: int = 256,
    resolution: int = 1,
    out_dir: Path | None = None,
    log: Callable[[str], None] = print,
    on_run: Callable[[Any], None] | None = None,
    settle_s: float = DEFAULT_SETTLE_S,
) -> CapacityReport:
    levels: list[CapacityLevel] = []
    prefix = cfg.call_id_prefix or "ttg-cap"

    async def run_level(n: int) -> Report:
        if cfg.metrics_url and levels and settle_s > 0:
            quiet, waited = await wait_until_settled(cfg.metrics_url, settle_s)
            if not quiet:
                log(f"concurrency {n}: the gateway was not quiet after {waited:.1f} s; starting anyway")
            elif waited >= 1.0:
                log(f"concurrency {n}: waited {waited:.1f} s for the gateway to be quiet")
        load = dataclasses.replace(cfg.load, calls=n, total=None if cfg.load.duration_s else n)
        level_cfg = dataclasses.replace(
            cfg, load=load, out_dir=None, progress=False, call_id_prefix=f"{prefix}-n{n}-{len(levels)}"
        )
        rep = await run_replay_async(level_cfg, library, on_run=on_run)
        if out_dir is not None:
            write_report(rep, out_dir / f"level-{n:04d}")
        return rep

    baseline = await run_level(1)
    base_p95 = p95_with_missing(baseline)
    if bound_s is None:
        if math.isinf(base_p95) or baseline.summary.completed != 1:
            raise ReplayError(
                "the single-call run gave no usable time-to-final (call "
                f"{baseline.calls[0].outcome if baseline.calls else 'missing'}, "
                f"{baseline.summary.utterances_without_final} utterances without a final): "
                "check the gateway and Redis, or pass --bound-ms"
            )
        bound_s = base_p95 + margin_s
    held, why = judge(baseline, bound_s)
    levels.append(CapacityLevel(1, baseline.summary, held, why))
    verdict = "held" if held else why
    log(f"concurrency 1: p95 TTF {base_p95 * 1000:.0f} ms → bound {bound_s * 1000:.0f} ms; {verdict}")
    good, bad = (1, None) if held else (0, 1)
    n = next_level(good, bad, max_calls, resolution) if held else None
    while n is not None:
        rep = await run_level(n)
        ok, why = judge(rep, bound_s)
        p95 = p95_with_missing(rep)
        levels.append(CapacityLevel(n, rep.summary, ok, why))
        log(f"concurrency {n}: p95 TTF {p95 * 1000:.0f} ms; {'held' if ok else why}")
        if ok:
            good = n
        else:
            bad = n
        n = next_level(good, bad, max_calls, resolution)
    cap = CapacityReport(
        bound_s=bound_s,
        baseline_p95_s=None if math.isinf(base_p95) else base_p95,
        capacity=good,
        levels=tuple(sorted(levels, key=lambda lv: lv.concurrency)),
    )
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        pngs = (
            ["latency_vs_concurrency.png"]
            if plots.latency_vs_concurrency(cap, out_dir / "latency_vs_concurrency.png")
            else []
        )
        report.write_json(cap, out_dir / "capacity.json")
        report.write_capacity_markdown(cap, out_dir / "capacity.md", pngs)
    return cap
