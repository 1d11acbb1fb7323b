"""How late an event loop runs its callbacks: a timer every `LAG_PROBE_S`, its lateness kept as the largest
per report period. A turn of the loop that takes long (many datagrams, front ends, a resampling batch) delays
every packet and chunk behind it; a media worker reports this once a second, and so does the single-process
gateway for its own loop, which carries the media path there."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

LAG_PROBE_S = 0.05


async def watch_loop_lag(
    report: Callable[[float], None], period_s: float, probe_s: float = LAG_PROBE_S
) -> None:
    """Until cancelled: every `period_s`, `report(s)` with the most the running loop woke a `probe_s` sleep
    late since the last report."""
    loop = asyncio.get_running_loop()
    worst, report_at = 0.0, loop.time() + period_s
    while True:
        asleep = loop.time()
        await asyncio.sleep(probe_s)
        now = loop.time()
        worst = max(worst, now - asleep - probe_s)
        if now >= report_at:
            report_at = now + period_s
            report(worst)
            worst = 0.0
