"""Scraping the gateway's `/metrics` during a run, for the batch-size-over-time plot and the report.

Each scrape keeps a few cumulative sums; the series is the difference between consecutive scrapes:
mean encoder batch = Δ ttg_encoder_batch_size_sum / Δ ttg_encoder_batch_size_count over the interval.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

# Sample names summed over their labels.
WANTED = (
    "ttg_encoder_batch_size_sum",
    "ttg_encoder_batch_size_count",
    "ttg_encoder_step_seconds_sum",
    "ttg_encoder_step_seconds_count",
    "ttg_active_calls",
    "ttg_rtp_packets_received_total",
    "ttg_rtp_packets_lost_total",
    "ttg_asr_chunks_dropped_total",
    "ttg_calls_total",
)


@dataclass(frozen=True, slots=True)
class Scrape:
    t: float  # monotonic s
    values: dict[str, float]


@dataclass(frozen=True, slots=True)
class BatchPoint:
    t: float  # seconds since the run started, at the end of the interval
    mean_batch: float | None
    steps_per_s: float
    mean_step_ms: float | None
    active_calls: float | None


def parse_metrics(text: str, wanted: tuple[str, ...] = WANTED) -> dict[str, float]:
    """The `wanted` series of a /metrics page: `name` summed over its labels, `name{v}` the sample of
    that name whose only label has the value v."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = list(sample.labels.values())
            keys = [sample.name] + ([f"{sample.name}{{{labels[0]}}}"] if len(labels) == 1 else [])
            for key in keys:
                if key in wanted:
                    out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def batch_series(scrapes: list[Scrape], t0: float) -> list[BatchPoint]:
    points: list[BatchPoint] = []
    for a, b in itertools.pairwise(scrapes):
        dt = b.t - a.t
        if dt <= 0:
            continue
        dn = b.values.get("ttg_encoder_batch_size_count", 0.0) - a.values.get(
            "ttg_encoder_batch_size_count", 0.0
        )
        ds = b.values.get("ttg_encoder_batch_size_sum", 0.0) - a.values.get("ttg_encoder_batch_size_sum", 0.0)
        dsn = b.values.get("ttg_encoder_step_seconds_count", 0.0) - a.values.get(
            "ttg_encoder_step_seconds_count", 0.0
        )
        dss = b.values.get("ttg_encoder_step_seconds_sum", 0.0) - a.values.get(
            "ttg_encoder_step_seconds_sum", 0.0
        )
        points.append(
            BatchPoint(
                t=b.t - t0,
                mean_batch=ds / dn if dn > 0 else None,
                steps_per_s=max(dn, 0.0) / dt,
                mean_step_ms=1000.0 * dss / dsn if dsn > 0 else None,
                active_calls=b.values.get("ttg_active_calls"),
            )
        )
    return points


# What a failed scrape raises: no answer, an HTTP error status, a page that does not parse.
SCRAPE_ERRORS = (aiohttp.ClientError, TimeoutError, ValueError)


async def fetch_series(
    session: aiohttp.ClientSession, url: str, timeout_s: float, wanted: tuple[str, ...] = WANTED
) -> dict[str, float]:
    """One GET of a /metrics page, its `wanted` series (`parse_metrics`); raises one of SCRAPE_ERRORS."""
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        resp.raise_for_status()
        return parse_metrics(await resp.text(), wanted)


class MetricsScraper:
    def __init__(self, url: str, interval_s: float, clock: Callable[[], float]) -> None:
        self.url = url
        self.interval_s = interval_s
        self._clock = clock
        self.scrapes: list[Scrape] = []
        self.errors = 0
        self.last_error = ""

    async def scrape_once(self, session: aiohttp.ClientSession) -> None:
        try:
            values = await fetch_series(session, self.url, max(self.interval_s, 1.0))
            self.scrapes.append(Scrape(self._clock(), values))
        except SCRAPE_ERRORS as exc:
            self.errors += 1
            self.last_error = str(exc) or type(exc).__name__
            if self.errors == 1:
                logger.warning(
                    "scraping %s failed: %s (the run goes on without it)", self.url, self.last_error
                )

    async def run(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                started = self._clock()
                await self.scrape_once(session)
                await asyncio.sleep(max(0.0, self.interval_s - (self._clock() - started)))
